// All-reduce, all-gather, broadcast and barrier over the small-op channel.
#include "comm/algorithms/small_ops.h"

#include <cstring>

#include "comm/algorithm_selection.h"
#include "comm/algorithms/span_helpers.h"
#include "comm/error.h"
#include "comm/reduce_kernels.h"

namespace fsdp_ext::comm {
namespace {

// The op's detail word: dtype (bits 0-7) and reduction (8-15) of a
// reduction, and the members of a bucket (16-31; 0 for a single op), so that
// a bucket and a single op of the same size are told apart.
uint32_t encode_reduction(const ReduceSpec& spec, size_t members = 0) {
  return static_cast<uint32_t>(spec.type) | (static_cast<uint32_t>(spec.kind) << 8) |
         (static_cast<uint32_t>(members) << 16);
}

// Every rank must have called the same op with the same size; the first
// rank that did not is named, with both ops, on every rank (each reads all
// headers, so all of them fail alike and none waits on the others).
void check_same_op(const SmallOpChannel& channel) {
  for (int peer = 0; peer < channel.size(); ++peer) {
    if (peer == channel.rank()) continue;
    if (std::string drift = channel.out_of_step(peer); !drift.empty()) {
      throw CommError(ErrorKind::kMismatch, drift);
    }
  }
  const ChannelOpKind& mine = channel.kind_of(channel.rank());
  for (int peer = 0; peer < channel.size(); ++peer) {
    const ChannelOpKind& theirs = channel.kind_of(peer);
    if (theirs != mine) {
      throw CommError(ErrorKind::kMismatch,
                      "rank " + std::to_string(peer) + " called " +
                          describe_small_op(theirs) + " where rank " +
                          std::to_string(channel.rank()) + " called " + describe_small_op(mine));
    }
  }
}

char* begin_with(SmallOpChannel& channel, uint64_t seq, SmallOp op, uint32_t detail,
                 uint64_t bytes, size_t contribution_bytes) {
  return channel.begin(ChannelOpKind{static_cast<uint32_t>(op), detail, bytes},
                       contribution_bytes, seq);
}

// Copies `data` to `slot`, scaled once on the way in for PREMUL_SUM.
void copy_contribution(char* slot, ConstSpan data, const ReduceSpec& spec) {
  if (spec.pre_scale != 1.0) {
    scale_copy(slot, data.data, data.bytes / element_size(spec.type), spec.type, spec.pre_scale);
  } else if (data.bytes > 0) {
    std::memcpy(slot, data.data, data.bytes);
  }
}

void contribute_for_reduction(SmallOpChannel& channel, uint64_t seq, SmallOp op,
                              ConstSpan data, const ReduceSpec& spec) {
  copy_contribution(begin_with(channel, seq, op, encode_reduction(spec), data.bytes, data.bytes),
                    data, spec);
  channel.publish();
}

// out = the bytes at `offset` of every rank's contribution, reduced starting
// with rank `first`'s, then the others in rank order, then divided for AVG.
// An all-reduce starts with rank 0 on every rank (the same rounding
// everywhere); a reduce-scatter block with its owner's, the order the direct
// and shared-memory reduce-scatters use, so a block rounds the same whichever
// algorithm its bucket takes.
void reduce_contributions(const SmallOpChannel& channel, size_t offset, MutableSpan out,
                          const ReduceSpec& spec, int first) {
  if (out.bytes == 0) return;
  const size_t count = out.bytes / element_size(spec.type);
  std::memcpy(out.data, channel.data_of(first) + offset, out.bytes);
  for (int r = 0; r < channel.size(); ++r) {
    if (r == first) continue;
    reduce_into(out.data, channel.data_of(r) + offset, count, spec.type, spec.kind);
  }
  detail::post_divide(out.data, out.bytes, spec);
}

}  // namespace

bool takes_small_op_channel(size_t bytes, const char* algorithm_variable) {
  return bytes <= SmallOpChannel::kMaxBytes &&
         (algorithm_variable == nullptr || small_op_channel_allowed(algorithm_variable));
}

void start_small_allreduce(SmallOpChannel& channel, uint64_t seq, ConstSpan data,
                           const ReduceSpec& spec) {
  contribute_for_reduction(channel, seq, SmallOp::kAllreduce, data, spec);
}

void finish_small_allreduce(const SmallOpChannel& channel, MutableSpan data,
                            const ReduceSpec& spec) {
  check_same_op(channel);
  reduce_contributions(channel, 0, data, spec, /*first=*/0);
}

void start_small_reduce_scatter(SmallOpChannel& channel, uint64_t seq, ConstSpan input,
                                const ReduceSpec& spec) {
  contribute_for_reduction(channel, seq, SmallOp::kReduceScatter, input, spec);
}

void finish_small_reduce_scatter(const SmallOpChannel& channel, MutableSpan output,
                                 const ReduceSpec& spec) {
  check_same_op(channel);
  reduce_contributions(channel, channel.rank() * output.bytes, output, spec,
                       /*first=*/channel.rank());
}

void start_small_allgather(SmallOpChannel& channel, uint64_t seq, ConstSpan input) {
  char* slot = begin_with(channel, seq, SmallOp::kAllgather, 0, input.bytes, input.bytes);
  if (input.bytes > 0) std::memcpy(slot, input.data, input.bytes);
  channel.publish();
}

void finish_small_allgather(const SmallOpChannel& channel, const std::vector<MutableSpan>& outputs) {
  check_same_op(channel);
  for (int r = 0; r < channel.size(); ++r) {
    if (outputs[r].bytes > 0) std::memcpy(outputs[r].data, channel.data_of(r), outputs[r].bytes);
  }
}

namespace {

size_t total_bytes(const std::vector<ConstSpan>& spans) {
  size_t total = 0;
  for (const ConstSpan& span : spans) total += span.bytes;
  return total;
}

}  // namespace

void start_small_allgather_bucket(SmallOpChannel& channel, uint64_t seq,
                                  const std::vector<ConstSpan>& inputs) {
  const size_t total = total_bytes(inputs);
  char* slot = begin_with(channel, seq, SmallOp::kAllgather,
                          static_cast<uint32_t>(inputs.size()) << 16, total, total);
  for (const ConstSpan& input : inputs) {
    if (input.bytes > 0) std::memcpy(slot, input.data, input.bytes);
    slot += input.bytes;
  }
  channel.publish();
}

void finish_small_allgather_bucket(const SmallOpChannel& channel,
                                   const std::vector<std::vector<MutableSpan>>& outputs) {
  check_same_op(channel);
  for (int r = 0; r < channel.size(); ++r) {
    const char* source = channel.data_of(r);
    for (const std::vector<MutableSpan>& member : outputs) {
      if (member[r].bytes > 0) std::memcpy(member[r].data, source, member[r].bytes);
      source += member[r].bytes;
    }
  }
}

void start_small_reduce_scatter_bucket(SmallOpChannel& channel, uint64_t seq,
                                       const std::vector<ConstSpan>& inputs,
                                       const ReduceSpec& spec) {
  const size_t total = total_bytes(inputs);
  char* slot = begin_with(channel, seq, SmallOp::kReduceScatter,
                          encode_reduction(spec, inputs.size()), total, total);
  for (const ConstSpan& input : inputs) {
    copy_contribution(slot, input, spec);
    slot += input.bytes;
  }
  channel.publish();
}

void finish_small_reduce_scatter_bucket(const SmallOpChannel& channel,
                                        const std::vector<MutableSpan>& outputs,
                                        const ReduceSpec& spec) {
  check_same_op(channel);
  size_t member_offset = 0;  // member m's whole input in every slot
  for (const MutableSpan& output : outputs) {
    reduce_contributions(channel, member_offset + channel.rank() * output.bytes, output, spec,
                         /*first=*/channel.rank());
    member_offset += output.bytes * channel.size();
  }
}

void start_small_broadcast(SmallOpChannel& channel, uint64_t seq, ConstSpan data, int root) {
  const bool is_root = channel.rank() == root;
  char* slot = begin_with(channel, seq, SmallOp::kBroadcast, static_cast<uint32_t>(root), data.bytes,
                          is_root ? data.bytes : 0);
  if (is_root && data.bytes > 0) std::memcpy(slot, data.data, data.bytes);
  channel.publish();
}

void finish_small_broadcast(const SmallOpChannel& channel, MutableSpan data, int root) {
  check_same_op(channel);
  if (channel.rank() != root && data.bytes > 0) {
    std::memcpy(data.data, channel.data_of(root), data.bytes);
  }
}

void start_small_barrier(SmallOpChannel& channel, uint64_t seq) {
  begin_with(channel, seq, SmallOp::kBarrier, 0, 0, 0);
  channel.publish();
}

void finish_small_barrier(const SmallOpChannel& channel) {
  check_same_op(channel);
}

}  // namespace fsdp_ext::comm
