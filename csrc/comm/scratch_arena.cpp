#include "comm/scratch_arena.h"

#include <cstdlib>
#include <new>

namespace fsdp_ext::comm {
namespace {
constexpr size_t kAlignment = 64;
size_t round_up(size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }
}  // namespace

void ScratchArena::FreeDeleter::operator()(void* p) const { std::free(p); }

void* ScratchArena::allocate(size_t bytes) {
  const size_t need = round_up(bytes == 0 ? 1 : bytes);
  for (Region& region : regions_) {
    if (region.capacity - region.used >= need) {
      void* out = static_cast<char*>(region.memory.get()) + region.used;
      region.used += need;
      return out;
    }
  }
  const size_t capacity = std::max(need, high_water_);
  void* memory = std::aligned_alloc(kAlignment, round_up(capacity));
  if (!memory) throw std::bad_alloc();
  regions_.push_back(Region{Block(memory), capacity, need});
  return memory;
}

void ScratchArena::reset() {
  size_t total = 0;
  for (Region& region : regions_) {
    total += region.used;
    region.used = 0;
  }
  if (regions_.size() > 1) {
    // This op needed several blocks: replace them by one of the combined size.
    high_water_ = std::max(high_water_, total);
    regions_.clear();
  }
}

}  // namespace fsdp_ext::comm
