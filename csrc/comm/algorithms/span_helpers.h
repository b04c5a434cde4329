// Small helpers shared by the algorithm files.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/algorithms/algorithms.h"
#include "comm/reduce_kernels.h"
#include "comm/tag_scheme.h"

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

// `bytes` of `element`-sized items cut into `parts` contiguous blocks whose
// element counts differ by at most one (all-reduce's per-rank blocks).
inline std::vector<MutableSpan> split_blocks(MutableSpan data, size_t element, int parts) {
  const size_t count = data.bytes / element;
  std::vector<MutableSpan> blocks(parts);
  size_t offset = 0;
  for (int p = 0; p < parts; ++p) {
    const size_t block = count / parts + (static_cast<size_t>(p) < count % parts ? 1 : 0);
    blocks[p] = MutableSpan{static_cast<char*>(data.data) + offset * element, block * element};
    offset += block;
  }
  return blocks;
}

// Runs `run` over the bucket in windows whose members' steps fit the tag's
// step field (`steps_per_member` each); windows after the first take a new
// sequence number. Every rank cuts the same windows.
template <typename Member, typename Run>
void in_step_windows(OpContext& context, const std::vector<Member>& bucket,
                     uint32_t steps_per_member, Run run) {
  const size_t per_window = std::max<size_t>(1, tag::kMaxSteps / std::max(1u, steps_per_member));
  if (bucket.size() <= per_window) {
    run(bucket);
    return;
  }
  for (size_t start = 0; start < bucket.size(); start += per_window) {
    if (start > 0) context.begin_next_collective();
    const size_t end = std::min(bucket.size(), start + per_window);
    run(std::vector<Member>(bucket.begin() + start, bucket.begin() + end));
  }
}

}  // namespace fsdp_ext::comm::detail
