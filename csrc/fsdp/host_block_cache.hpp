#pragma once

// Host memory for the buffers FSDP frees and allocates again every group and
// step (the unsharded parameters' storage, the collectives' flat buffers),
// kept for reuse instead of going back to malloc.
//
// Why: each group's unsharded storage is allocated at its unshard and freed
// at its reshard, the same sizes every step. glibc gives a freed heap top
// back to the OS once it passes its trim threshold (128 KiB by default) and
// the next allocation faults the pages in again, zeroed by the kernel. On a
// model of many small blocks that was a brk pair per group and about a third
// of the runtime's host time per step (issue 36; docs/benchmarks.md). Upstream
// FSDP2 gets the same reuse on a GPU from the CUDA caching allocator; on the
// host it pays the faults.
//
// A block freed by its tensor goes into a free list for its exact size; an
// allocation of that size takes the most recently freed one back. Idle
// blocks are bounded (kIdleBytesLimit): past the bound the least recently
// freed ones go back to the system, so sizes no longer asked for (a second
// model's, a step whose set of gradients changed) give way to the ones that
// repeat; a block larger than the bound is never kept. Blocks are reported
// to torch's CPU memory profiler as the default allocator reports its own,
// while a tensor holds them. Thread-safe: tensors die on any thread
// (autograd's, a Python finalizer's).

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstddef>
#include <iterator>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace fsdp_ext::fsdp {

class HostBlockCache final : public c10::Allocator {
 public:
  // Idle memory kept at most (and the largest block kept at all).
  static constexpr size_t kIdleBytesLimit = size_t{64} << 20;

  // The process's one cache. Never destroyed: blocks can be freed by tensors
  // that outlive static destruction.
  static HostBlockCache& instance();

  // A CPU tensor of `numel` elements of `dtype` whose storage comes from the
  // cache (and goes back to it when the storage frees or replaces it); an
  // ordinary torch.empty while torch's memory tracker watches
  // (dispatch_modes.hpp).
  static at::Tensor empty(int64_t numel, at::ScalarType dtype);

  c10::DataPtr allocate(size_t bytes) override;
  void copy_data(void* destination, const void* source, size_t bytes) const override;

  size_t idle_bytes() const;
  // Frees every idle block (tests).
  void release_idle();

 private:
  struct Block {
    void* data;
    size_t bytes;
  };
  using IdleList = std::list<Block*>;  // least recently freed first

  HostBlockCache() = default;
  static void give_back(void* block);  // the DataPtr's deleter
  void keep(Block* block);
  static void free_block(Block* block);

  mutable std::mutex mutex_;
  IdleList idle_;
  // The idle blocks of each size, as positions in idle_, oldest first.
  std::unordered_map<size_t, std::vector<IdleList::iterator>> idle_by_size_;
  size_t idle_bytes_ = 0;
};

}  // namespace fsdp_ext::fsdp
