// Communication buffers handed out by a process group (allocate_tensor).
//
// Every buffer is its own shared-memory segment, registered with UCX, so
//   - peers on the same host read it in place (no staging copy), and
//   - UCX transfers from it find the registration already made.
// Freed buffers go back to a free list keyed by size class and are reused;
// the pool only maps new memory when no free buffer of the class is left.
// Thread-safe: buffers are allocated on Python threads and may be freed on
// the progress thread (when an op drops the last reference).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "comm/shared_memory_segment.h"
#include "comm/ucx_handles.h"

namespace fsdp_ext::comm {

// Where a byte range lives in this rank's shared memory, in the terms a peer
// needs to map it.
struct SharedLocation {
  uint64_t segment_id = 0;
  uint64_t segment_bytes = 0;
  uint64_t offset = 0;
  int32_t fd = -1;
};

struct SharedPoolStats {
  size_t segments = 0;        // mapped buffers, in use or free
  size_t in_use = 0;          // handed out and not yet released
  size_t reserved_bytes = 0;  // total size of the mapped buffers
  size_t registrations = 0;   // live UCX memory registrations
  size_t allocations = 0;     // allocate() calls so far
  size_t reuses = 0;          // of which served from the free list
};

class SharedBufferPool {
 public:
  // `ucx` may be null (no registration, e.g. in tests of the pool alone).
  explicit SharedBufferPool(std::shared_ptr<UcxContext> ucx);
  ~SharedBufferPool();
  SharedBufferPool(const SharedBufferPool&) = delete;
  SharedBufferPool& operator=(const SharedBufferPool&) = delete;

  void* allocate(size_t bytes);
  // `data` must come from allocate(); the buffer becomes reusable at once,
  // so callers release only after every operation on it has finished.
  void release(void* data);
  // The location of [data, data + bytes) if the whole range lies inside one
  // of this pool's buffers.
  std::optional<SharedLocation> locate(const void* data, size_t bytes) const;
  SharedPoolStats stats() const;

  // Identifiers for shared segments outside the pool (staging), from the
  // same sequence, so a peer never confuses two segments of this rank.
  uint64_t next_segment_id();

 private:
  struct Buffer {
    uint64_t id = 0;
    size_t size_class = 0;
    bool in_use = false;
    SharedMemorySegment memory;
    std::unique_ptr<UcxRegistration> registration;
  };

  std::shared_ptr<UcxContext> ucx_;
  mutable std::mutex mutex_;
  uint64_t next_id_ = 1;
  // All buffers by base address (for locate and release).
  std::map<uintptr_t, std::unique_ptr<Buffer>> buffers_;
  std::unordered_map<size_t, std::vector<Buffer*>> free_by_class_;
  size_t in_use_ = 0;
  size_t allocations_ = 0;
  size_t reuses_ = 0;
};

// Size classes: whole pages (what a segment maps anyway), four steps per
// power of two from 16 KiB (at most 25 % slack there); below, 4, 8, 12 and
// 16 KiB.
size_t shared_size_class(size_t bytes);

}  // namespace fsdp_ext::comm
