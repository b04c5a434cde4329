"""``monitored_barrier`` for fsdp_ext groups.

torch's ``dist.monitored_barrier`` refuses every backend not named gloo
(``ValueError: monitored_barrier is only implemented for GLOO backend``).
Ours gives the same diagnosis on an fsdp_ext group: rank 0 waits for every
other rank, within the timeout, and every rank raises a ``RuntimeError``
naming the ranks that did not arrive. On a gloo group it calls torch's.
"""

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ._registration import BACKEND_NAME


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """Like ``torch.distributed.monitored_barrier``, on fsdp_ext and gloo groups.

    Args:
        group: the process group (default: the default group).
        timeout: a ``timedelta``; by default torch's default for the backend
            (30 minutes), as ``dist.monitored_barrier`` takes it, not the
            group's own timeout.
        wait_all_ranks: rank 0 checks every rank and names all that are
            missing, instead of stopping at the first.
    """
    if c10d._rank_not_in_group(group):
        return
    backend = dist.get_backend(group)
    if backend == dist.Backend.GLOO:
        dist.monitored_barrier(group, timeout, wait_all_ranks)
        return
    if BACKEND_NAME not in str(backend):
        raise ValueError(
            f"torch_fsdp_ext.monitored_barrier: the group's backend is {backend!r}; "
            f"it runs on {BACKEND_NAME} and gloo groups"
        )
    if timeout is None:
        timeout = c10d._get_default_timeout(backend)
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"torch_fsdp_ext.monitored_barrier: timeout must be a datetime.timedelta, "
            f"got {type(timeout).__name__}"
        )
    group_to_use = c10d._get_default_group() if group is None else group
    group_to_use.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
