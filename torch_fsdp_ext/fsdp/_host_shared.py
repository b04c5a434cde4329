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


def host_layout(hosts_by_rank: list, rank: int) -> tuple:
    """(this host's ranks, this rank's column) of a shard group whose rank r
    runs on host hosts_by_rank[r]: the ranks on this rank's host in rank
    order, and the ranks at this rank's position on every host, hosts in
    order of their first rank. Hosts with unequal rank counts are refused."""
    hosts: dict = {}
    for r, host in enumerate(hosts_by_rank):
        hosts.setdefault(host, []).append(r)
    counts = {host: len(ranks) for host, ranks in hosts.items()}
    if len(set(counts.values())) > 1:
        raise NotImplementedError(
            "set_host_shared_parameters: a shard group over hosts with unequal numbers of its "
            f"ranks ({counts}); host-shared parameters need the same number on every host")
    mine = hosts[hosts_by_rank[rank]]
    position = mine.index(rank)
    return mine, [ranks[position] for ranks in hosts.values()]


def _share(group, pg, label: str) -> None:
    n, rank = pg.size(), pg.rank()
    where: list = [None] * n
    dist.all_gather_object(where, (socket.gethostname(), os.getpid()), group=pg)
    host_ranks, column = host_layout([host for host, _ in where], rank)
    leader = host_ranks[0]
    control_bytes = -(-len(host_ranks) * _C._HOST_SHARED_CONTROL_BYTES_PER_RANK // _PAGE) * _PAGE
    total = control_bytes + group.host_shared_bytes()
    # Each host's first rank creates that host's file; every rank maps its own
    # host's.
    created = None
    if rank == leader:
        created = os.path.join(_SHM_DIR, f"torch_fsdp_ext-{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(created, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, total)  # zeros: the control block starts at epoch 0
        finally:
            os.close(fd)
    paths: list = [None] * n
    dist.all_gather_object(paths, created, group=pg)
    try:
        memory = torch.from_file(paths[leader], shared=True, size=total, dtype=torch.uint8)
    finally:
        dist.barrier(group=pg)  # everyone has mapped it (or failed to)
        if created is not None:
            os.unlink(created)
    host_pids = [where[r][1] for r in host_ranks]
    timeout = dist.default_pg_timeout.total_seconds()
    group.use_host_shared(memory[control_bytes:], memory[:control_bytes], host_ranks, host_pids,
                          column, timeout)
    logger.info("fsdp_ext: %s: unsharded parameters host-shared, %.1f MiB for %d ranks on %s%s",
                label, (total - control_bytes) / 2**20, len(host_ranks), where[rank][0],
                "" if len(column) == 1 else
                f"; shards of the other {len(column) - 1} host(s) from column ranks {column}")
