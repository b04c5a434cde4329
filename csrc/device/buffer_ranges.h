// Which of a pool's buffers holds an address range: the lookup of the
// group's device buffer pool (device_buffer_pool.h), free of CUDA so that the
// C++ unit tests check its edges on any machine
// (test/cpp/stream_ordered_reuse_test.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>

namespace fsdp_ext::device {

// The base address of the buffer in `buffers` (keyed by base address, of
// `size_of(buffer)` bytes each) that holds all of [address, address + bytes),
// or 0 when none does. Buffers are half-open ranges: the first byte past a
// buffer is not in it, even for a range of 0 bytes, since another
// allocation (torch's, a neighbouring cudaMalloc) may start exactly there.
template <typename Buffer, typename SizeOf>
uintptr_t base_holding(const std::map<uintptr_t, Buffer>& buffers, uintptr_t address,
                       size_t bytes, SizeOf size_of) {
  auto it = buffers.upper_bound(address);
  if (it == buffers.begin()) return 0;
  --it;
  const uintptr_t offset = address - it->first;
  const size_t size = size_of(it->second);
  if (offset >= size) return 0;
  return bytes <= size - offset ? it->first : 0;
}

}  // namespace fsdp_ext::device
