// Small helpers shared by the algorithm files.
#pragma once

#include <cstring>

#include "comm/algorithms/algorithms.h"
#include "comm/reduce_kernels.h"

namespace fsdp_ext::comm::detail {

inline void copy_if_distinct(void* dst, const void* src, size_t bytes) {
  if (bytes != 0 && dst != src) std::memcpy(dst, src, bytes);
}

inline int ring_next(int rank, int size) { return (rank + 1) % size; }
inline int ring_prev(int rank, int size) { return (rank + size - 1) % size; }
inline int wrap(int value, int size) { return ((value % size) + size) % size; }

// PREMUL_SUM: a scaled copy of `input` in scratch (input is left untouched).
inline const void* pre_scaled(OpContext& context, const void* input, size_t bytes,
                              const ReduceSpec& spec) {
  if (spec.pre_scale == 1.0) return input;
  void* copy = context.scratch(bytes);
  scale_copy(copy, input, bytes / element_size(spec.type), spec.type, spec.pre_scale);
  return copy;
}

inline void post_scale(void* data, size_t bytes, const ReduceSpec& spec) {
  if (spec.post_scale != 1.0) {
    scale_in_place(data, bytes / element_size(spec.type), spec.type, spec.post_scale);
  }
}

}  // namespace fsdp_ext::comm::detail
