#include "fsdp/host_block_cache.hpp"

#include <ATen/EmptyTensor.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstring>

namespace fsdp_ext::fsdp {

HostBlockCache& HostBlockCache::instance() {
  static HostBlockCache* cache = new HostBlockCache();
  return *cache;
}

at::Tensor HostBlockCache::empty(int64_t numel, at::ScalarType dtype) {
  return at::detail::empty_generic({numel}, &instance(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   dtype, std::nullopt);
}

c10::DataPtr HostBlockCache::allocate(size_t bytes) {
  const c10::Device cpu(c10::DeviceType::CPU);
  if (bytes == 0) return c10::DataPtr(nullptr, cpu);
  Block* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = idle_.find(bytes);
    if (it != idle_.end() && !it->second.empty()) {
      block = it->second.back();
      it->second.pop_back();
      idle_bytes_ -= bytes;
    }
  }
  if (block == nullptr) block = new Block{c10::alloc_cpu(bytes), bytes};
  return c10::DataPtr(block->data, block, &HostBlockCache::give_back, cpu);
}

void HostBlockCache::copy_data(void* destination, const void* source, size_t bytes) const {
  default_copy_data(destination, source, bytes);
}

void HostBlockCache::give_back(void* block) {
  instance().keep_or_free(static_cast<Block*>(block));
}

void HostBlockCache::keep_or_free(Block* block) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (idle_bytes_ + block->bytes <= kIdleBytesLimit) {
      idle_[block->bytes].push_back(block);
      idle_bytes_ += block->bytes;
      return;
    }
  }
  c10::free_cpu(block->data);
  delete block;
}

size_t HostBlockCache::idle_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return idle_bytes_;
}

void HostBlockCache::release_idle() {
  std::unordered_map<size_t, std::vector<Block*>> idle;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    idle.swap(idle_);
    idle_bytes_ = 0;
  }
  for (auto& [bytes, blocks] : idle) {
    for (Block* block : blocks) {
      c10::free_cpu(block->data);
      delete block;
    }
  }
}

}  // namespace fsdp_ext::fsdp
