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

inline void post_divide(void* data, size_t bytes, const ReduceSpec& spec) {
  if (spec.post_divisor != 1.0) {
    divide_in_place(data, bytes / element_size(spec.type), spec.type, spec.post_divisor);
  }
}

// output = own (op) every other source in order, a block at a time so the
// accumulator stays in L1/L2 while the sources stream through: one pass over
// memory instead of one per source. AVG's divide follows on each block while
// it is still in cache (the same divide post_divide makes, so the same bits),
// so callers must not post_divide again. `own` may alias `output`.
inline void reduce_sources(MutableSpan output, const void* own,
                           const std::vector<const void*>& others, const ReduceSpec& spec) {
  constexpr size_t kBlockBytes = 32 << 10;
  const size_t element = element_size(spec.type);
  const size_t block = kBlockBytes / element * element;
  char* out = static_cast<char*>(output.data);
  for (size_t offset = 0; offset < output.bytes; offset += block) {
    const size_t bytes = std::min(block, output.bytes - offset);
    copy_if_distinct(out + offset, static_cast<const char*>(own) + offset, bytes);
    for (const void* source : others) {
      reduce_into(out + offset, static_cast<const char*>(source) + offset, bytes / element,
                  spec.type, spec.kind);
    }
    post_divide(out + offset, bytes, spec);
  }
}

// PREMUL_SUM in place (all-reduce works on the caller's buffer anyway).
inline void pre_scale_in_place(MutableSpan data, const ReduceSpec& spec) {
  if (spec.pre_scale != 1.0) {
    scale_in_place(data.data, data.bytes / element_size(spec.type), spec.type, spec.pre_scale);
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

// Large messages are sent as pieces of this size, so that the receiver can
// work on the first (reduce it, pass it on within its host) while the rest
// are still on the wire: one 8 MiB message left a reduce-scatter's whole
// reduction after the transfer (16 MiB across two hosts: 59 % of the link).
constexpr size_t kPipelinePieceBytes = 1 << 20;

// The byte ranges [offset, offset + bytes) that cut `total` into pieces of at
// most kPipelinePieceBytes, each a whole number of `element`s.
struct Piece {
  size_t offset;
  size_t bytes;
};
// An empty total is one empty piece (the member still takes part).
inline std::vector<Piece> pieces_of(size_t total, size_t element) {
  if (total == 0) return {Piece{0, 0}};
  const size_t piece = std::max(element, kPipelinePieceBytes / element * element);
  std::vector<Piece> out;
  for (size_t offset = 0; offset < total; offset += piece) {
    out.push_back(Piece{offset, std::min(piece, total - offset)});
  }
  return out;
}

inline ConstSpan sub(ConstSpan span, const Piece& piece) {
  return ConstSpan{static_cast<const char*>(span.data) + piece.offset, piece.bytes};
}
inline MutableSpan sub(MutableSpan span, const Piece& piece) {
  return MutableSpan{static_cast<char*>(span.data) + piece.offset, piece.bytes};
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
