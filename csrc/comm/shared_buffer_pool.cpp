#include "comm/shared_buffer_pool.h"

#include <algorithm>
#include <string>

#include "comm/error.h"

namespace fsdp_ext::comm {

size_t shared_size_class(size_t bytes) {
  constexpr size_t kSmallest = 4096;
  if (bytes <= kSmallest) return kSmallest;
  size_t power = kSmallest;
  while (power * 2 < bytes) power *= 2;
  // bytes is in (power, 2 * power]: pick the first quarter step that fits,
  // but never a fraction of a page: segments are mapped in whole pages, and
  // sub-page classes would keep separate free lists for the same memory.
  const size_t step = std::max(power / 4, kSmallest);
  return (bytes + step - 1) / step * step;
}

SharedBufferPool::SharedBufferPool(std::shared_ptr<UcxContext> ucx) : ucx_(std::move(ucx)) {}

SharedBufferPool::~SharedBufferPool() = default;

uint64_t SharedBufferPool::next_segment_id() {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_id_++;
}

void* SharedBufferPool::allocate(size_t bytes) {
  const size_t size_class = shared_size_class(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  ++allocations_;
  std::vector<Buffer*>& free_list = free_by_class_[size_class];
  if (!free_list.empty()) {
    Buffer* buffer = free_list.back();
    free_list.pop_back();
    buffer->in_use = true;
    ++in_use_;
    ++reuses_;
    return buffer->memory.data();
  }
  auto buffer = std::make_unique<Buffer>();
  buffer->id = next_id_++;
  buffer->size_class = size_class;
  buffer->memory = SharedMemorySegment::create(size_class, "fsdp_ext-buffer");
  if (ucx_) {
    buffer->registration = std::make_unique<UcxRegistration>(
        ucx_, buffer->memory.data(), buffer->memory.bytes());
  }
  buffer->in_use = true;
  void* data = buffer->memory.data();
  buffers_.emplace(reinterpret_cast<uintptr_t>(data), std::move(buffer));
  ++in_use_;
  return data;
}

void SharedBufferPool::release(void* data) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = buffers_.find(reinterpret_cast<uintptr_t>(data));
  if (it == buffers_.end() || !it->second->in_use) {
    throw CommError(ErrorKind::kTransport,
                    "shared buffer pool: release of an address it did not hand out");
  }
  Buffer* buffer = it->second.get();
  buffer->in_use = false;
  --in_use_;
  free_by_class_[buffer->size_class].push_back(buffer);
}

std::optional<SharedLocation> SharedBufferPool::locate(const void* data, size_t bytes) const {
  const auto address = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = buffers_.upper_bound(address);
  if (it == buffers_.begin()) return std::nullopt;
  --it;
  const Buffer& buffer = *it->second;
  const uintptr_t base = it->first;
  if (address + bytes > base + buffer.memory.bytes()) return std::nullopt;
  return SharedLocation{buffer.id, buffer.memory.bytes(), address - base, buffer.memory.fd()};
}

SharedPoolStats SharedBufferPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  SharedPoolStats stats;
  stats.segments = buffers_.size();
  stats.in_use = in_use_;
  for (const auto& [base, buffer] : buffers_) {
    stats.reserved_bytes += buffer->memory.bytes();
    if (buffer->registration) ++stats.registrations;
  }
  stats.allocations = allocations_;
  stats.reuses = reuses_;
  return stats;
}

}  // namespace fsdp_ext::comm
