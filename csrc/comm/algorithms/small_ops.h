// Collectives over the small-op channel (small_op_channel.h): every rank's
// contribution fits in one slot, so one exchange of flags completes the op.
//
// Each op is split in two so that its caller decides how to wait in
// between (poll on the calling thread, or hand the wait to the engine):
//   start  -- writes this rank's contribution and publishes it as the
//             group's collective number `seq`; never blocks;
//   finish -- once every rank has arrived: checks that all ranks called the
//             same op with the same size (kMismatch naming the first rank
//             that did not; the caller prefixes the op's name), then
//             computes this rank's result.
// Results are the same bytes on every rank: an all-reduce combines the
// contributions in rank order on each of them.
#pragma once

#include <string>
#include <vector>

#include "comm/algorithms/algorithms.h"
#include "comm/small_op_channel.h"

namespace fsdp_ext::comm {

// Whether a collective of `bytes` per rank goes through the channel (on a
// group that has it, outside a coalescing batch): it fits a slot and
// `algorithm_variable` (the op's FSDP_EXT_*_ALGO, or null for an op without
// one) forces no algorithm. Every rank of a group answers alike for the same
// call: the sizes must agree anyway, and so must the variables.
bool takes_small_op_channel(size_t bytes, const char* algorithm_variable);

void start_small_allreduce(SmallOpChannel& channel, uint64_t seq, ConstSpan data,
                           const ReduceSpec& spec);
void finish_small_allreduce(const SmallOpChannel& channel, MutableSpan data,
                            const ReduceSpec& spec);

void start_small_allgather(SmallOpChannel& channel, uint64_t seq, ConstSpan input);
void finish_small_allgather(const SmallOpChannel& channel, const std::vector<MutableSpan>& outputs);

// Each rank contributes its whole input (`size` equal blocks) and reduces
// its own block of everyone's: its own contribution first, then the others
// in rank order (as the direct and shared-memory reduce-scatters do).
void start_small_reduce_scatter(SmallOpChannel& channel, uint64_t seq, ConstSpan input,
                                const ReduceSpec& spec);
void finish_small_reduce_scatter(const SmallOpChannel& channel, MutableSpan output,
                                 const ReduceSpec& spec);

// Buckets (allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced):
// one channel op for all members, their inputs back to back in the slot.
// outputs[m][r]: member m's block from rank r. A reduce-scatter bucket has
// one spec for every member; each block is reduced as a single op's is.
void start_small_allgather_bucket(SmallOpChannel& channel, uint64_t seq,
                                  const std::vector<ConstSpan>& inputs);
void finish_small_allgather_bucket(const SmallOpChannel& channel,
                                   const std::vector<std::vector<MutableSpan>>& outputs);
void start_small_reduce_scatter_bucket(SmallOpChannel& channel, uint64_t seq,
                                       const std::vector<ConstSpan>& inputs,
                                       const ReduceSpec& spec);
void finish_small_reduce_scatter_bucket(const SmallOpChannel& channel,
                                        const std::vector<MutableSpan>& outputs,
                                        const ReduceSpec& spec);

void start_small_broadcast(SmallOpChannel& channel, uint64_t seq, ConstSpan data, int root);
void finish_small_broadcast(const SmallOpChannel& channel, MutableSpan data, int root);

void start_small_barrier(SmallOpChannel& channel, uint64_t seq);
void finish_small_barrier(const SmallOpChannel& channel);

}  // namespace fsdp_ext::comm
