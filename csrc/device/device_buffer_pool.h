// Device memory handed out by a process group (allocate_tensor on CUDA), on
// one device.
//
// Every buffer is its own allocation, exported once, when it is made: a
// cudaMalloc with a legacy IPC handle, or -- once share_by_descriptors() was
// called, where peers cannot open legacy handles -- a cuMemCreate allocation
// whose file descriptor the pool's DescriptorServer offers to peers
// (descriptor_memory.h). Peers open each buffer once (PeerMemoryMap caches by
// the handle) and read it in place, also where torch's own allocator hands
// out memory without such a handle (expandable segments). Freed buffers go back
// to a free list by size class and are reused in stream order (Note [a freed
// buffer is reused in stream order], stream_ordered_reuse.h); the pool asks
// the device for new memory only when no free buffer fits. It never gives
// memory back while it lives: peers may have a buffer open, and freeing
// memory a peer has mapped is undefined behaviour in CUDA.
//
// Thread-safe: buffers are allocated and freed on any thread.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/descriptor_sharing.h"
#include "device/descriptor_memory.h"
#include "device/ipc_memory.h"
#include "device/stream_ordered_reuse.h"

namespace fsdp_ext::device {

struct DeviceBufferStats {
  size_t buffers = 0;         // made so far, in use or free
  size_t in_use = 0;          // handed out and not yet released
  size_t reserved_bytes = 0;  // total size of the buffers
  size_t allocations = 0;     // buffers handed out so far
  size_t reuses = 0;          // of which served from the free list
  size_t exported = 0;        // buffers peers can open (an IPC handle or a descriptor)
};

// A CUDA event recorded at a buffer's release (the Fence of
// StreamOrderedReuse). Owns the event.
class ReleaseFence {
 public:
  explicit ReleaseFence(cudaStream_t stream);
  ~ReleaseFence();
  ReleaseFence(ReleaseFence&& other) noexcept
      : event_(other.event_), passed_(other.passed_) {
    other.event_ = nullptr;
  }
  ReleaseFence& operator=(ReleaseFence&&) = delete;
  ReleaseFence(const ReleaseFence&) = delete;

  bool passed();
  void wait();

 private:
  cudaEvent_t event_ = nullptr;
  bool passed_ = false;
};

class DeviceBufferPool {
 public:
  // `release_cached` frees what another allocator on the device caches
  // (torch's: emptyCache), tried once before an allocation fails.
  DeviceBufferPool(int device, std::function<void()> release_cached);
  ~DeviceBufferPool();
  DeviceBufferPool(const DeviceBufferPool&) = delete;
  DeviceBufferPool& operator=(const DeviceBufferPool&) = delete;

  // A buffer of at least `bytes` (0 is allowed: nullptr) for work on
  // `stream`. Throws CommError (kDevice) when the device has no memory left,
  // saying how much the pool holds.
  void* allocate(size_t bytes, cudaStream_t stream);
  // Work on `stream` uses the buffer holding `data`: its release fences
  // that stream too (as torch's Tensor.record_stream). False when `data` is
  // not in one of this pool's buffers.
  bool record_use(const void* data, cudaStream_t stream);
  // `data` (from allocate) is free once the work on its streams so far is
  // done. Never throws (tensor deleters call it).
  void release(void* data) noexcept;
  // How a peer reads [data, data + bytes): its buffer's handle and the
  // offset; nullopt when the range is not in one of this pool's buffers, or
  // the buffer has no handle (IPC refused on this machine).
  std::optional<IpcBuffer> locate(const void* data, size_t bytes) const;
  int device() const { return device_; }
  DeviceBufferStats stats() const;

  // From now on new buffers are shared as file descriptors instead of by
  // legacy IPC handles (which the peers could not open): the buffers made so
  // far are no longer offered (locate: nullopt; ops on them are staged), and
  // once free never handed out again (waits for the free ones' fences).
  // Throws CommError where the device cannot make such memory, or the
  // server cannot listen. Idempotent.
  void share_by_descriptors();
  // Where the pool's DescriptorServer listens ("" before share_by_descriptors).
  std::string descriptor_address() const;
  // The pool's memory is left to the process's exit instead of being freed
  // at its end: work still queued on a stream may use it, and cudaFree
  // would wait for that work (Note [a group's stream that does not drain],
  // backend/cuda/cuda_path.cpp).
  void abandon_memory();

 private:
  struct Buffer {
    size_t size_class = 0;
    bool in_use = false;
    std::vector<StreamId> streams;  // allocated on, then recorded
    std::optional<cudaIpcMemHandle_t> handle;  // legacy buffers peers may open
    // Descriptor buffers: the memory (offered under its base address as id).
    // (A legacy buffer after the switch to descriptors, one with neither
    // of the above, is never handed out again: peers could not read it in
    // place. Kept, not freed: a peer may have opened it after all.)
    std::unique_ptr<DescriptorAllocation> shared_memory;
  };
  // The base of the buffer holding [data, data + bytes), or 0 (mutex_ held;
  // base_holding in buffer_ranges.h).
  uintptr_t base_of(const void* data, size_t bytes) const;
  // A new buffer from the device; nullptr when it has no memory left (mutex_ held).
  void* make_buffer(size_t size_class);
  void* make_legacy_buffer(size_t size_class, Buffer* buffer);
  void* make_descriptor_buffer(size_t size_class, Buffer* buffer);

  const int device_;
  std::function<void()> release_cached_;
  mutable std::mutex mutex_;
  // Set by share_by_descriptors; destroyed after the buffers (the destructor
  // frees them first), so that no peer is refused a buffer that still lives.
  std::unique_ptr<comm::DescriptorServer> server_;
  std::map<uintptr_t, Buffer> buffers_;  // by base address
  StreamOrderedReuse<ReleaseFence> free_;
  size_t in_use_ = 0;
  size_t reserved_bytes_ = 0;
  size_t allocations_ = 0;
  size_t reuses_ = 0;
  size_t exported_ = 0;
  bool abandoned_ = false;  // abandon_memory()
};

}  // namespace fsdp_ext::device
