"""Host-shared unsharded parameters (FSDPModule.set_host_shared_parameters):
one copy of a group's unsharded parameters per host, in memory every rank
of its shard group maps. This file maps the memory; the C++ group lays the
parameters out in it and keeps the ranks in step (Note [ordering of
host-shared unsharded parameters] in csrc/fsdp/host_shared_parameters.hpp).

The memory is a file in /dev/shm that the group's rank 0 creates at the
size the group asks for and every rank maps shared; it is unlinked as soon
as all have mapped it, so it goes away with the last mapping (when the
modules are freed, or the processes exit, whichever way)."""

from __future__ import annotations

import logging
import os
import socket
import uuid

import torch
import torch.distributed as dist

from .. import _C

logger = logging.getLogger("torch_fsdp_ext")

_SHM_DIR = "/dev/shm"
_PAGE = 4096


def share_groups(groups: list, label: str) -> None:
    """Maps host-shared memory for each group with more than one shard rank.
    Collective over each group's shard ranks, in group order."""
    for group in groups:
        pg = group.shard_group
        if pg is None or pg.size() == 1 or group.host_shared:
            continue
        _share(group, pg, f"{label} (group {group.module_fqn or 'root'})")


def _share(group, pg, label: str) -> None:
    n, rank = pg.size(), pg.rank()
    where: list = [None] * n
    dist.all_gather_object(where, (socket.gethostname(), os.getpid()), group=pg)
    hosts = sorted({host for host, _ in where})
    if len(hosts) > 1:
        raise NotImplementedError(
            f"set_host_shared_parameters: the shard group of {label} spans hosts {hosts}; "
            "host-shared parameters need every rank of a shard group on one host (HSDP with "
            "a shard group per host works)"
        )
    control_bytes = -(-n * _C._HOST_SHARED_CONTROL_BYTES_PER_RANK // _PAGE) * _PAGE
    total = control_bytes + group.host_shared_bytes()
    path: list = [None]
    if rank == 0:
        path[0] = os.path.join(_SHM_DIR, f"torch_fsdp_ext-{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(path[0], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, total)  # zeros: the control block starts at epoch 0
        finally:
            os.close(fd)
    dist.broadcast_object_list(path, src=dist.get_global_rank(pg, 0), group=pg)
    try:
        memory = torch.from_file(path[0], shared=True, size=total, dtype=torch.uint8)
    finally:
        dist.barrier(group=pg)  # everyone has mapped it (or failed to)
        if rank == 0:
            os.unlink(path[0])
    pids = [pid for _, pid in where]
    timeout = dist.default_pg_timeout.total_seconds()
    group.use_host_shared(memory[control_bytes:], memory[:control_bytes], pids, timeout)
    logger.info("fsdp_ext: %s: unsharded parameters host-shared, %.1f MiB for %d ranks on %s",
                label, (total - control_bytes) / 2**20, n, hosts[0])
