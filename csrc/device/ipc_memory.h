// Device memory read in place by the other processes of a host, by one of
// two kinds of handle:
//
//   legacy      CUDA's IPC handles (cudaIpcGetMemHandle / cudaIpcOpenMemHandle).
//               A handle names a whole allocation (one cudaMalloc, e.g. a
//               segment of torch's caching allocator), so a buffer is exported
//               as (handle of its allocation, offset in it). Memory from
//               cuMemCreate (torch's expandable segments) has none:
//               export_buffer reports that, and the op is staged.
//   descriptor  an allocation of the group's own made to be shared as a file
//               descriptor (descriptor_memory.h), named by the id its owner's
//               DescriptorServer offers it under; for machines that refuse
//               legacy handles.
//
// Opening a handle costs a driver round trip and a mapping, so each peer's
// allocations are opened once and kept (PeerMemoryMap); the same allocation
// always exports the same handle bytes (or id), which are the cache key.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "device/descriptor_memory.h"

namespace fsdp_ext::device {

enum class IpcKind : uint8_t { kLegacy = 0, kDescriptor = 1 };

// What a peer needs to read or write one of this process's buffers. Plain
// bytes: exchanged between the ranks through the host transport.
struct IpcBuffer {
  IpcKind kind = IpcKind::kLegacy;
  cudaIpcMemHandle_t handle{};    // legacy: of the allocation that holds the buffer
  uint64_t allocation_id = 0;     // descriptor: the id its owner's server offers it under
  uint64_t allocation_bytes = 0;  // descriptor: the allocation's size (mapped whole)
  uint64_t offset = 0;            // of the buffer in that allocation
};

static_assert(std::is_trivially_copyable_v<IpcBuffer>, "IpcBuffer travels as raw bytes");

// Tests only: from now on legacy handles are not made (export_buffer and the
// buffer pool behave as if cudaIpcGetMemHandle refused), so the route's
// fallback to file descriptors runs on machines that allow them.
void refuse_legacy_handles_for_tests(bool refuse);
bool legacy_handles_refused_for_tests();

// The handle of the allocation starting at `allocation_base`, for the buffer
// at `data` inside it; nullopt where the memory has no legacy IPC handle.
std::optional<IpcBuffer> export_buffer(void* allocation_base, void* data);

// The peers' allocations this process has opened, by peer and handle. Closes
// them all on destruction; at most `capacity` stay open (the least recently
// used is closed first, after `drain` has made sure no queued work reads it),
// but never one the current op (since begin_op) uses: its pointer is already
// handed out, and its reads are not enqueued yet. An op that needs more keeps
// them all open until a later op evicts.
class PeerMemoryMap {
 public:
  explicit PeerMemoryMap(size_t capacity = 512) : capacity_(capacity) {}
  ~PeerMemoryMap();
  PeerMemoryMap(const PeerMemoryMap&) = delete;
  PeerMemoryMap& operator=(const PeerMemoryMap&) = delete;

  // The peer's buffer, mapped into this process (opened on first use).
  // `drain` is called before an eviction closes an older mapping.
  template <typename Drain>
  void* open(int peer, const IpcBuffer& buffer, Drain&& drain) {
    if (opened_.size() >= capacity_ && !find(peer, buffer) && oldest_is_from_an_earlier_op()) {
      drain();
      evict_oldest();
    }
    return static_cast<char*>(base_of(peer, buffer)) + buffer.offset;
  }
  // An op begins: the mappings it opens or uses from here on stay open
  // until the next begin_op.
  void begin_op() { ++op_; }
  // Where each rank's DescriptorServer listens (by rank; "" for a rank
  // whose buffers are not shared as descriptors), for opening descriptor
  // buffers.
  void set_descriptor_servers(std::vector<std::string> addresses) {
    descriptor_servers_ = std::move(addresses);
  }
  size_t size() const { return opened_.size(); }
  uint64_t opens() const { return opens_.load(); }  // handles opened so far (cache misses)

 private:
  // (peer, kind, legacy handle bytes, descriptor id): one of the last two is zero.
  using Key = std::tuple<int, IpcKind, std::array<char, sizeof(cudaIpcMemHandle_t)>, uint64_t>;
  struct Entry {
    void* base;
    std::unique_ptr<DescriptorMapping> mapping;  // descriptor buffers: what unmaps it
    std::list<Key>::iterator age;                // position in lru_
    uint64_t last_op;                            // the op that used it last (op_)
  };
  static Key key_of(int peer, const IpcBuffer& buffer);
  bool find(int peer, const IpcBuffer& buffer) const;
  void* base_of(int peer, const IpcBuffer& buffer);
  std::unique_ptr<DescriptorMapping> open_descriptor(int peer, const IpcBuffer& buffer) const;
  static void close(Entry& entry);
  void evict_oldest();
  bool oldest_is_from_an_earlier_op() const;

  size_t capacity_;
  std::map<Key, Entry> opened_;
  std::list<Key> lru_;  // most recently used first
  uint64_t op_ = 0;
  std::atomic<uint64_t> opens_{0};  // read by counters on any thread
  std::vector<std::string> descriptor_servers_;
};

}  // namespace fsdp_ext::device
