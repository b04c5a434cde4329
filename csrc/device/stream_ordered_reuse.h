// Which freed device buffer an allocation may take now: the bookkeeping of
// the group's device buffer pool (device_buffer_pool.h), free of CUDA so that
// the C++ unit tests check it on any machine (test/cpp/stream_ordered_reuse_test.cpp).
//
// Note [a freed buffer is reused in stream order]
// Device memory is freed on the host while streams may still have work on it
// queued. As torch's caching allocator does, a buffer is released with a
// fence (an event) recorded on every stream that used it: the stream it was
// allocated on and each stream recorded since (the group's stream, which
// runs the collectives). An allocation on stream S may take it once every
// fence on a stream other than S has passed: work S enqueues after the
// allocation runs after S's own fence anyway, in S's order. So a buffer freed
// and allocated again on the stream FSDP allocates its communication buffers
// on is reused at once, and one another stream still reads is not handed out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace fsdp_ext::device {

// A stream, by its handle's value (cudaStream_t's, or any id in the tests).
using StreamId = uintptr_t;

// Fence: movable, with `bool passed()` (the device got past it; may cache
// the answer) and `void wait()` (blocks the host until it has).
template <typename Fence>
class StreamOrderedReuse {
 public:
  struct Fenced {
    StreamId stream;
    Fence fence;
  };

  // `buffer` (of `size_class`) is free, once `fences` have passed.
  void put(void* buffer, size_t size_class, std::vector<Fenced> fences) {
    free_.emplace(size_class, Entry{buffer, std::move(fences)});
  }

  // A free buffer of `size_class` an allocation on `stream` may take now
  // (Note above), removed from the free list; nullptr when there is none.
  // Of several, the one freed first.
  void* take(size_t size_class, StreamId stream) {
    auto [begin, end] = free_.equal_range(size_class);
    for (auto it = begin; it != end; ++it) {
      if (usable_on(it->second, stream)) {
        void* buffer = it->second.buffer;
        free_.erase(it);
        return buffer;
      }
    }
    return nullptr;
  }

  // Blocks until every free buffer's fences have passed (before the pool
  // asks the device for more memory than it has: Note [a full device]).
  void wait_all() {
    for (auto& [size_class, entry] : free_) {
      for (Fenced& fenced : entry.fences) fenced.fence.wait();
      entry.fences.clear();
    }
  }

  // Every free buffer, removed from the free list, once its fences have
  // passed (blocks until then): for buffers that must not be handed out
  // again (the pool's switch to another kind of buffer).
  std::vector<void*> take_all() {
    wait_all();
    std::vector<void*> buffers;
    for (auto& [size_class, entry] : free_) buffers.push_back(entry.buffer);
    free_.clear();
    return buffers;
  }

  size_t free_buffers() const { return free_.size(); }
  // Free buffers some allocation could not take yet (a fence not passed).
  size_t pending() {
    size_t count = 0;
    for (auto& [size_class, entry] : free_) {
      for (Fenced& fenced : entry.fences) {
        if (!fenced.fence.passed()) {
          ++count;
          break;
        }
      }
    }
    return count;
  }

 private:
  struct Entry {
    void* buffer;
    std::vector<Fenced> fences;
  };

  static bool usable_on(Entry& entry, StreamId stream) {
    for (Fenced& fenced : entry.fences) {
      if (fenced.stream != stream && !fenced.fence.passed()) return false;
    }
    return true;
  }

  // By size class; within one, in the order freed (multimap keeps
  // insertion order among equal keys).
  std::multimap<size_t, Entry> free_;
};

// Size classes of device buffers: four steps per power of two (at most 25 %
// slack) from 4 KiB; below, whole 512-byte units (CUDA's allocation
// alignment is 256 bytes; smaller steps would only make more classes).
inline size_t device_size_class(size_t bytes) {
  constexpr size_t kUnit = 512;
  if (bytes <= 4096) return bytes <= kUnit ? kUnit : (bytes + kUnit - 1) / kUnit * kUnit;
  size_t power = 4096;
  while (power * 2 < bytes) power *= 2;  // power < bytes <= 2 * power
  const size_t step = power / 4;
  return (bytes + step - 1) / step * step;
}

}  // namespace fsdp_ext::device
