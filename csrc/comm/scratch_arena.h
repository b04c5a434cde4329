// Reusable temporary memory for collective algorithms (receive staging,
// partial sums). Growing once and reusing avoids a fresh mmap and its page
// faults on every large operation, which would cost as much as the copy.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace fsdp_ext::comm {

class ScratchArena {
 public:
  // Hands out `bytes` of 64-byte aligned memory valid until reset().
  void* allocate(size_t bytes);
  // Starts a new operation; merges blocks so the next op needs one.
  void reset();

 private:
  struct FreeDeleter {
    void operator()(void* p) const;
  };
  using Block = std::unique_ptr<void, FreeDeleter>;
  struct Region {
    Block memory;
    size_t capacity = 0;
    size_t used = 0;
  };
  std::vector<Region> regions_;
  size_t high_water_ = 0;
};

}  // namespace fsdp_ext::comm
