#include "fsdp/gradient_divide.hpp"

#include <cmath>

namespace fsdp_ext::fsdp {
namespace {

std::optional<double> unless_one(double value) {
  return value == 1.0 ? std::nullopt : std::optional<double>(value);
}

}  // namespace

ReduceFactors reduce_factors(c10::ScalarType reduce_dtype, int64_t shard_world, int64_t replicas,
                             std::optional<double> factor, bool force_sum) {
  ReduceFactors out;
  // With one shard rank there is no reduce-scatter: upstream copies the
  // input, divided by an explicit factor, and applies no RS op at all.
  const bool reduce_scatters = shard_world > 1;
  if (!reduce_scatters && factor) out.single_rank_divide = *factor;
  const bool overflow_risk = reduce_dtype != c10::kFloat && reduce_dtype != c10::kBFloat16;
  const int64_t data_parallel = shard_world * (replicas > 0 ? replicas : 1);
  if (!overflow_risk && !force_sum) {
    if (!factor) {
      if (data_parallel == 1) return out;  // SUM, SUM
      if (reduce_scatters) out.reduce_scatter_divide = static_cast<double>(shard_world);
      if (replicas > 0) out.all_reduce_divide = unless_one(static_cast<double>(replicas));
      return out;
    }
    if (reduce_scatters) {
      if (*factor == static_cast<double>(shard_world)) {
        out.reduce_scatter_divide = *factor;  // AVG
      } else {
        out.pre_multiply = 1.0 / *factor;  // PREMUL_SUM(1/factor)
      }
    }
    return out;  // the all-reduce SUMs
  }
  const double total = factor.value_or(static_cast<double>(data_parallel));
  if (!overflow_risk) {
    out.post_divide = unless_one(total);  // after every SUM
    return out;
  }
  double pre = 1;
  while (std::fmod(total, pre) == 0 && total / pre > pre) pre *= 2;
  out.pre_divide = unless_one(pre);
  out.post_divide = unless_one(total / pre);
  return out;
}

}  // namespace fsdp_ext::fsdp
