// The shared-memory protocol's one building block, used by the algorithms
// for groups on one host. It replaces moving bytes through messages with
// telling peers where to read them:
//
//   1. offer/expect: each rank lists, per peer, the pieces that peer must
//      read from it, and the sizes it will read from each peer;
//   2. exchange(): pieces not already in shared memory (ordinary tensors)
//      are copied once into this rank's staging slot; one small header
//      message per peer pair carries every piece's location (a whole bucket
//      in one message); sizes are checked against what the reader expects;
//   3. the algorithm copies or reduces straight out of peers' memory
//      (source());
//   4. finish(): every reader tells each owner it is done, and each owner
//      waits for that before its op completes, so its buffers stay untouched
//      while peers read them.
//
// Pieces in buffers from the group's pool are read in place: zero staging
// copies. The messages are tiny, so the cost of a collective is the copy or
// reduction itself plus two message rounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "comm/algorithms/algorithms.h"
#include "comm/reduce_spec.h"
#include "comm/shared_memory_domain.h"

namespace fsdp_ext::comm {

// The smallest piece offered as process memory. Below it a staging copy by
// the owner plus a read out of shared memory beats one process_vm_readv,
// which pins every page it reads. Measured on the 2-core VM, world size 2,
// ranks bound to cores, 1 MiB ops (512 KiB pieces), read directly vs staged:
// all-gather 30 vs 76 us, reduce-scatter 78 vs 111 us; unbound, no worse
// within the noise. The all-reduce's two phases got slower (174 vs 131 us
// bound), so it keeps 1 MiB.
constexpr size_t kProcessReadMinBytes = 512 << 10;
constexpr size_t kAllreduceProcessReadMinBytes = 1 << 20;
// For readers that take pieces only through source(): nothing is offered as
// process memory (source() has no address for it).
constexpr size_t kNoProcessReads = SIZE_MAX;

// What an exchange belongs to, carried in every header: ranks that called
// different collectives (or the same ones in another order) meet in
// exchanges of different kinds, and the reader says so by name.
enum class SharedExchangeKind : uint32_t {
  kUnnamed = 0,  // tests
  kAllGather = 1,
  kAllReduceInputs = 2,
  kAllReduceResults = 3,
  kBroadcast = 4,
  kReduceScatter = 5,
};
const char* shared_exchange_kind_name(uint32_t kind);

class SharedSourceExchange {
 public:
  // Uses steps `first_step` (headers) and `first_step + 1` (done messages);
  // `staging_slot` is the domain slot for pieces that need staging.
  // `process_read_min_bytes`: pieces outside shared memory of at least this
  // size are offered as ordinary process memory, which readers copy with
  // process_vm_readv through copy_out, copy_range or reduce_pieces: one copy
  // instead of a staging copy by the owner plus the read.
  // `kind`: which collective's exchange this is, checked against the peers'.
  SharedSourceExchange(OpContext& context, SharedMemoryDomain& domain, uint32_t first_step,
                       int staging_slot = 0, size_t process_read_min_bytes = kNoProcessReads,
                       SharedExchangeKind kind = SharedExchangeKind::kUnnamed);

  void offer(int peer, std::vector<ConstSpan> pieces);
  void expect(int peer, std::vector<size_t> piece_bytes);
  // The sizes of the tensors this rank's pieces are cut from, the same for
  // what it offers and what it expects (piece i of every peer comes from
  // tensor i). Set, every reader checks that the owner's tensors have the
  // same sizes as its own before it reads anything: a mismatch of the
  // tensors is then seen by every rank, also where the pieces agree.
  void set_whole_bytes(std::vector<size_t> whole_bytes) { whole_bytes_ = std::move(whole_bytes); }
  // The reductions the pieces feed, one per tensor as for set_whole_bytes:
  // every reader checks that the owner reduces the same dtype with the same
  // op (AVG apart from SUM; PREMUL_SUM's factor may differ by rank).
  void set_reductions(std::vector<ReduceSpec> specs) { reductions_ = std::move(specs); }

  void exchange();
  // Start of `peer`'s piece `index` (valid until finish()); null if empty
  // or offered as process memory (use copy_range).
  const char* source(int peer, size_t index) const { return sources_[peer][index]; }
  // Copies `peer`'s piece `index` into `destination`.
  void copy_out(int peer, size_t index, void* destination) {
    domain_.copy_from_peer(peer, headers_in_[peer][index], destination);
  }
  // Copies `bytes` from `offset` of `peer`'s piece `index` into
  // `destination`: how a reader consumes, a cache-sized chunk at a time, a
  // piece offered as process memory (which has no source()).
  void copy_range(int peer, size_t index, size_t offset, size_t bytes, void* destination) {
    SharedPiece part = headers_in_[peer][index];
    if (part.in_process_memory) {
      part.process_address += offset;
    } else {
      part.offset += offset;
    }
    part.bytes = bytes;
    domain_.copy_from_peer(peer, part, destination);
  }
  // output = own (op) every peer's piece `index`, peers in rank order, a
  // chunk at a time. Pieces in shared memory are reduced in place; pieces
  // offered as process memory are first copied a chunk at a time into
  // scratch, so the reduction takes them from cache. `own` may alias
  // `output`. The same order on every rank, whatever the pieces' kind, so
  // results are bitwise identical. AVG's divide is made here, chunk by chunk.
  void reduce_pieces(size_t index, MutableSpan output, const void* own, const ReduceSpec& spec);
  void finish();

 private:
  OpContext& context_;
  SharedMemoryDomain& domain_;
  uint32_t header_step_;
  int staging_slot_;
  size_t process_read_min_bytes_;
  SharedExchangeKind kind_;
  std::vector<std::vector<ConstSpan>> offers_;
  std::vector<bool> offered_;
  std::vector<std::vector<size_t>> expected_;
  std::vector<bool> expecting_;
  std::vector<size_t> whole_bytes_;  // empty: not checked
  std::vector<ReduceSpec> reductions_;  // empty: not checked
  std::vector<std::vector<SharedPiece>> headers_out_;
  std::vector<std::vector<SharedPiece>> headers_in_;
  std::vector<std::vector<const char*>> sources_;
  char* chunks_ = nullptr;  // one chunk per peer, for pieces read as process memory
};

}  // namespace fsdp_ext::comm
