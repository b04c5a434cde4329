"""The differences between the torch versions we support (2.11 to 2.15).

Each difference is named here once, with the version that brought it; the rest
of the package (and the tests) asks this module instead of checking versions.
Its C++ counterpart is ``csrc/torch_compat.hpp``.
"""

import torch

# (major, minor) of the running torch, e.g. (2, 11).
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

# torch 2.12: shard_placement_fn may return a ShardPlacementResult, which gives
# a parameter a mesh of its own (experts sharded over an expert-parallel mesh);
# fully_shard also takes dp_mesh_dims (DataParallelMeshDims). Both None before.
try:
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:
    ShardPlacementResult = None
    DataParallelMeshDims = None


# torch 2.15: every parameter has a gradient dtype policy (Tensor.grad_dtype,
# and _has_grad_dtype_override telling "set" from "unset"), which FSDP follows;
# MixedPrecisionPolicy(reduce_dtype=None) then reduces in the parameters'
# gradient dtypes (their original dtype unless set), where 2.11-2.14 reduce in
# param_dtype; and MixedPrecisionPolicy.param_dtype_override_fn gives a
# parameter a param_dtype of its own. The runtime's side of it is
# csrc/torch_compat.hpp's kGradDtypePolicies.
PER_PARAMETER_DTYPES = TORCH_VERSION >= (2, 15)

# torch 2.15: FSDPModule.reset_iter_state also drops the sharded gradients
# (the failed iteration's), where 2.11-2.14 keep them.
RESET_ITER_STATE_DROPS_SHARDED_GRADS = TORCH_VERSION >= (2, 15)

# torch 2.15: dist.monitored_barrier takes any group with a CPU backend (and
# so reaches fsdp_ext's monitoredBarrier); 2.11-2.14 refuse every backend
# not named gloo, where torch_fsdp_ext.monitored_barrier is the way in.
MONITORED_BARRIER_TAKES_ANY_CPU_BACKEND = TORCH_VERSION >= (2, 15)

# torch 2.15: FSDPModule.finalize_backward(async_op=True) returns one of
# these (exported by torch.distributed.fsdp); None before. Our handle is a
# subclass of it where it exists (FSDPModule.finalize_backward is ours on
# every torch of the range).
try:
    from torch.distributed.fsdp import GradientReductionHandle
except ImportError:
    GradientReductionHandle = None


def needs_newer_torch(feature: str, version: tuple) -> str:
    """Why `feature` is unavailable: it came with torch `version`; this is older.
    The message for an error, or for a test's skip."""
    wanted = ".".join(str(part) for part in version)
    return f"{feature} needs torch >= {wanted}; this is torch {torch.__version__}"
