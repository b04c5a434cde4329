// Shared memory among the ranks of a group that all run on one host.
//
// The backend creates one per group at init. Each rank offers the others two
// kinds of shared memory: buffers from its SharedBufferPool (what
// allocate_tensor hands out), which peers read in place, and two staging
// slots, into which a rank copies data that is not in shared memory so that
// peers can read it. Peers map each other's segments lazily, on first use,
// and keep the mappings until the group ends (staging slots are replaced
// when they grow; a newer slot evicts the older mapping).
//
// Whether the group uses shared memory at all is decided collectively at
// init (every rank on one host, and every rank able to map every other's
// memory); until then, and when it is off, enabled() is false and the
// algorithms use UCX messages only.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "comm/shared_buffer_pool.h"
#include "comm/shared_memory_segment.h"

namespace fsdp_ext::comm {

// How a peer finds one piece of this rank's shared memory. Sent verbatim in
// the shared-memory protocol's header messages.
struct SharedPiece {
  uint64_t segment_id = 0;
  uint64_t segment_bytes = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  int32_t fd = -1;
  // 0: a pool buffer (peers keep it mapped); k > 0: staging slot k - 1 (a
  // newer segment for the same slot replaces the older mapping).
  uint32_t staging_slot = 0;
  // Non-zero: not shared memory at all but ordinary memory of the owner at
  // `process_address`, which the reader copies with process_vm_readv (one
  // copy, done by the kernel) instead of the owner staging it first.
  uint32_t in_process_memory = 0;
  // Which exchange of which collective the owner offers it in
  // (SharedExchangeKind, algorithms/shared_source_exchange.h): a reader in
  // another collective names both instead of reporting sizes that differ.
  uint32_t exchange_kind = 0;
  uint64_t process_address = 0;
  // The size of the whole tensor the piece is cut from, where the exchange
  // says (0: it does not). Readers compare it with their own tensor's:
  // pieces cut at rank-dependent boundaries (the all-reduce's blocks) can
  // have equal sizes although the tensors differ.
  uint64_t whole_bytes = 0;
  // The reduction the piece is an input of, where the exchange says (0:
  // it does not): reduction_code() of its dtype and op. Readers compare it
  // with their own: ranks that reduce different dtypes of the same size, or
  // with different ops, agree on every size and would combine the bytes
  // each in its own way.
  uint32_t reduction = 0;
  uint32_t reserved = 0;
};

// Pieces placed one after another in a staging slot start on cache lines.
inline size_t align_for_staging(size_t bytes) { return (bytes + 63) / 64 * 64; }

class SharedMemoryDomain {
 public:
  static constexpr int kStagingSlots = 2;

  explicit SharedMemoryDomain(std::shared_ptr<SharedBufferPool> pool);
  SharedMemoryDomain(const SharedMemoryDomain&) = delete;
  SharedMemoryDomain& operator=(const SharedMemoryDomain&) = delete;

  bool enabled() const { return enabled_.load(std::memory_order_acquire); }
  // Set once at init, after the ranks agreed (see the backend).
  // `process_reads`: every rank may also read every other's ordinary memory
  // with process_vm_readv (same uid, no ptrace restriction).
  void enable(std::vector<pid_t> peer_pids, bool process_reads);
  bool process_reads() const { return process_reads_; }

  // --- progress thread only ---------------------------------------------
  // Staging memory of at least `bytes` in `slot`, valid until the next call
  // for the same slot. Peers can map it.
  char* staging(int slot, size_t bytes);
  // The shared location of [data, data + bytes) if it lies in this rank's
  // pool or staging slots.
  std::optional<SharedPiece> locate(const void* data, size_t bytes) const;
  // A pointer to `piece` of `peer`'s memory, mapping the segment if needed.
  const char* map_peer(int peer, const SharedPiece& piece);

  // The first staging slot, for the init probe: peers map it to test access.
  SharedPiece probe_piece();
  // Maps `peer`'s probe piece (throws CommError when that is impossible).
  void probe_peer(int peer, pid_t peer_pid, const SharedPiece& piece);
  // Copies `bytes` at `address` in process `pid` into `destination` with
  // process_vm_readv. Throws CommError on failure.
  static void read_process_memory(pid_t pid, uint64_t address, void* destination, size_t bytes);
  // Copies `piece` of `peer`'s memory into `destination`, whatever its kind.
  void copy_from_peer(int peer, const SharedPiece& piece, void* destination);

  // How pieces were offered to peers: in place (already in shared memory),
  // after a staging copy, or as process memory for process_vm_readv; so
  // tests can see which path an op took (any thread).
  enum class Offer { kInPlace, kStaged, kProcessMemory };
  void count_offered(Offer how) {
    (how == Offer::kInPlace ? in_place_ : how == Offer::kStaged ? staged_ : process_reads_offered_)
        .fetch_add(1, std::memory_order_relaxed);
  }
  uint64_t pieces_offered_in_place() const { return in_place_.load(); }
  uint64_t pieces_staged() const { return staged_.load(); }
  uint64_t pieces_offered_for_process_reads() const { return process_reads_offered_.load(); }

  // How many peer segments are mapped now (for leak tests; any thread).
  size_t mapped_peer_segments() const { return mapped_count_.load(std::memory_order_relaxed); }

 private:
  struct StagingSlot {
    uint64_t id = 0;
    SharedMemorySegment memory;
  };
  const char* map_peer_with_pid(int peer, pid_t pid, const SharedPiece& piece);

  std::shared_ptr<SharedBufferPool> pool_;
  std::atomic<bool> enabled_{false};
  std::vector<pid_t> peer_pids_;
  bool process_reads_ = false;
  StagingSlot staging_[kStagingSlots];
  struct PeerStaging {
    uint64_t id = 0;
    SharedMemorySegment memory;
  };
  // (peer, segment id) -> mapping of that peer's pool buffer.
  std::map<std::pair<int, uint64_t>, SharedMemorySegment> peer_buffers_;
  // (peer, staging slot) -> mapping of that peer's current staging segment.
  std::map<std::pair<int, uint32_t>, PeerStaging> peer_staging_;
  std::atomic<size_t> mapped_count_{0};
  std::atomic<uint64_t> in_place_{0};
  std::atomic<uint64_t> staged_{0};
  std::atomic<uint64_t> process_reads_offered_{0};
};

}  // namespace fsdp_ext::comm
