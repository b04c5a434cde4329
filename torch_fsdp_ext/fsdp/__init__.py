"""Our FSDP2: ``fully_shard`` with the parameter-group state machines in C++.

Same public API as ``torch.distributed.fsdp``; the policy classes and
``UnshardHandle`` are torch's own, so code written for upstream passes them
unchanged, and our ``FSDPModule`` is a subclass of upstream's.
``use_as_fully_shard()`` makes ``torch.distributed.fsdp.fully_shard`` ours.
"""

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from ._module import (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from ._routing import FullyShardRouting, use_as_fully_shard
from ._trace import FSDPEvent, ShardedState, TrainingState, trace_fsdp_events

__all__ = [
    "CPUOffloadPolicy",
    "FSDPEvent",
    "FSDPModule",
    "FullyShardRouting",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ShardedState",
    "TrainingState",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "trace_fsdp_events",
    "use_as_fully_shard",
]
