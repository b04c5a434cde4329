// The differences between the torch versions we build against (2.11 to 2.15),
// each under the version that brought it, so the rest of the code is written
// once against the names of the newest torch. Add a difference here, never as
// a version check at its point of use.
#pragma once

#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/version.h>

#define FSDP_EXT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||           \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace fsdp_ext::torch_compat {

// torch 2.13: PREMUL_SUM's factor and its maker dropped their NCCL prefix
// (c10d::NCCLPreMulSumSupplement and c10d::makeNCCLPreMulSum before; 2.13
// keeps the old supplement name as an alias, not the old maker).
#if FSDP_EXT_TORCH_AT_LEAST(2, 13)
using PreMulSumSupplement = c10d::PreMulSumSupplement;
inline c10d::ReduceOp make_premul_sum(double factor) { return c10d::makePreMulSum(factor); }
#else
using PreMulSumSupplement = c10d::NCCLPreMulSumSupplement;
inline c10d::ReduceOp make_premul_sum(double factor) { return c10d::makeNCCLPreMulSum(factor); }
#endif

// torch 2.15: a parameter's gradient dtype is a policy of its own
// (Tensor.grad_dtype, and _has_grad_dtype_override to tell "set" from
// "unset"), and FSDP follows it: with MixedPrecisionPolicy.reduce_dtype
// unset, gradients are reduced in the promotion of each parameter's gradient
// dtype (its original dtype unless set), a group may mix gradient dtypes,
// and each reduced shard is cast back to its parameter's gradient dtype;
// reduce_dtype is kept even where it equals param_dtype. 2.11-2.14 reduce in
// reduce_dtype (dropped where it equals param_dtype) or else in the
// gradients' own dtype, which must agree, and cast every shard to the
// parameters' dtype.
constexpr bool kGradDtypePolicies = FSDP_EXT_TORCH_AT_LEAST(2, 15);

}  // namespace fsdp_ext::torch_compat
