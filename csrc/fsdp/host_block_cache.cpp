#include "fsdp/host_block_cache.hpp"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include "fsdp/dispatch_modes.hpp"

namespace fsdp_ext::fsdp {

HostBlockCache& HostBlockCache::instance() {
  static HostBlockCache* cache = new HostBlockCache();
  return *cache;
}

at::Tensor HostBlockCache::empty(int64_t numel, at::ScalarType dtype) {
  // Seen by torch's memory tracker (or made fake by a fake mode), as
  // upstream's buffers are (dispatch_modes.hpp).
  if (allocations_through_dispatcher()) {
    return at::empty({numel}, at::TensorOptions().dtype(dtype));
  }
  return at::detail::empty_generic({numel}, &instance(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   dtype, std::nullopt);
}

c10::DataPtr HostBlockCache::allocate(size_t bytes) {
  const c10::Device cpu(c10::DeviceType::CPU);
  if (bytes == 0) return c10::DataPtr(nullptr, cpu);
  Block* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto same_size = idle_by_size_.find(bytes);
    if (same_size != idle_by_size_.end() && !same_size->second.empty()) {
      IdleList::iterator newest = same_size->second.back();
      same_size->second.pop_back();
      block = *newest;
      idle_.erase(newest);
      idle_bytes_ -= bytes;
    }
  }
  if (block == nullptr) block = new Block{c10::alloc_cpu(bytes), bytes};
  c10::profiledCPUMemoryReporter().New(block->data, bytes);
  return c10::DataPtr(block->data, block, &HostBlockCache::give_back, cpu);
}

void HostBlockCache::copy_data(void* destination, const void* source, size_t bytes) const {
  default_copy_data(destination, source, bytes);
}

void HostBlockCache::give_back(void* context) {
  Block* block = static_cast<Block*>(context);
  c10::profiledCPUMemoryReporter().Delete(block->data);
  instance().keep(block);
}

void HostBlockCache::keep(Block* block) {
  if (block->bytes > kIdleBytesLimit) {
    free_block(block);
    return;
  }
  std::vector<Block*> evicted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(block);
    idle_by_size_[block->bytes].push_back(std::prev(idle_.end()));
    idle_bytes_ += block->bytes;
    while (idle_bytes_ > kIdleBytesLimit) {
      Block* oldest = idle_.front();
      // The oldest block overall is the oldest of its size.
      std::vector<IdleList::iterator>& same_size = idle_by_size_[oldest->bytes];
      same_size.erase(same_size.begin());
      if (same_size.empty()) idle_by_size_.erase(oldest->bytes);
      idle_.pop_front();
      idle_bytes_ -= oldest->bytes;
      evicted.push_back(oldest);
    }
  }
  for (Block* old : evicted) free_block(old);
}

void HostBlockCache::free_block(Block* block) {
  c10::free_cpu(block->data);
  delete block;
}

size_t HostBlockCache::idle_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return idle_bytes_;
}

void HostBlockCache::release_idle() {
  IdleList idle;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    idle.swap(idle_);
    idle_by_size_.clear();
    idle_bytes_ = 0;
  }
  for (Block* block : idle) free_block(block);
}

}  // namespace fsdp_ext::fsdp
