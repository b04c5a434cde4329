// How gradients are divided around the reduce collectives, as upstream
// FSDP2's _get_gradient_divide_factors decides, expressed with SUM only.
//
// Upstream asks the backend for ReduceOp.AVG (NCCL divides in the kernel) or
// PREMUL_SUM(1/f); gloo and MPI have neither for every op, so AVG is SUM then
// a divide of the output by the group size (what our backend's AVG does too,
// bit for bit). PREMUL_SUM(1/f) goes to the backends that implement it
// (CollectiveGroup::reduce_scatter; their rounding in bf16/fp16 is theirs)
// and is a multiply of the input before the SUM elsewhere (gloo, where
// upstream's raises).
// Dtypes that may overflow (anything but fp32/bf16) split the factor into a
// power-of-two divide before the reduce-scatter and the rest after the
// all-reduce, exactly as upstream. `force_sum` (set_force_sum_reduction_for_
// comms) takes that path for every dtype: the whole factor after the last
// collective for fp32/bf16, split for the others.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>

namespace fsdp_ext::fsdp {

struct ReduceFactors {
  std::optional<double> pre_divide;           // input /= (overflow split)
  std::optional<double> pre_multiply;         // input *= (PREMUL_SUM(1/f))
  std::optional<double> single_rank_divide;   // shard world 1: no RS, output = input / f
  std::optional<double> reduce_scatter_divide;  // RS output /= shard world (AVG)
  std::optional<double> all_reduce_divide;      // AR output /= replicas (AVG)
  std::optional<double> post_divide;          // after every collective
};

// shard_world: the reduce-scatter group's size; replicas: the all-reduce
// group's size, 0 without one (FSDP); factor: set_gradient_divide_factor.
ReduceFactors reduce_factors(c10::ScalarType reduce_dtype, int64_t shard_world, int64_t replicas,
                             std::optional<double> factor, bool force_sum = false);

}  // namespace fsdp_ext::fsdp
