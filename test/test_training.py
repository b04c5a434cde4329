"""torch's own DDP and upstream fully_shard train over fsdp_ext with the same
losses as over gloo (same model, data and seeds, in the same processes)."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from tiny_transformer import TinyTransformer, batch_for, shard  # noqa: E402

STEPS = 6


def _train(model, rank, steps=STEPS):
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        tokens, targets = batch_for(rank, step)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def check_ddp_parity(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for name, group in (("fsdp_ext", dist.group.WORLD), ("gloo", ctx.gloo_group)):
        torch.manual_seed(0)
        model = DDP(TinyTransformer(layers=2), process_group=group, bucket_cap_mb=1)
        results[name] = _train(model, ctx.rank)
    torch.testing.assert_close(results["fsdp_ext"], results["gloo"], rtol=1e-5, atol=1e-6)
    assert results["fsdp_ext"][-1] < results["fsdp_ext"][0]
    return results


def _sharded_model(group, allocate_from_group=False):
    from torch.distributed.device_mesh import DeviceMesh

    torch.manual_seed(0)
    return shard(TinyTransformer(layers=3), DeviceMesh.from_group(group, "cpu"),
                 allocate_from_group)


def check_fully_shard_parity(ctx):
    results = {}
    for name, group in (("fsdp_ext", dist.group.WORLD), ("gloo", ctx.gloo_group)):
        results[name] = _train(_sharded_model(group), ctx.rank)
    torch.testing.assert_close(results["fsdp_ext"], results["gloo"], rtol=1e-5, atol=1e-6)
    assert results["fsdp_ext"][-1] < results["fsdp_ext"][0]
    return results


def check_fully_shard_with_group_allocation(ctx):
    """set_allocate_memory_from_process_group_for_comm(True) over fsdp_ext:
    same losses as without it (and as gloo), and the buffers really come
    from the group and are read by peers in place."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    results = {}
    for name, group, allocate in (("gloo", ctx.gloo_group, False),
                                  ("fsdp_ext", dist.group.WORLD, False),
                                  ("fsdp_ext+alloc", dist.group.WORLD, True)):
        model = _sharded_model(group, allocate)
        if allocate:
            before = backend._pool_stats()
        results[name] = _train(model, ctx.rank)
    after = backend._pool_stats()
    # Over fsdp_ext the reduction order is the same with and without group
    # buffers, so the losses agree exactly; gloo's order may differ slightly.
    assert results["fsdp_ext+alloc"] == results["fsdp_ext"], results
    torch.testing.assert_close(results["fsdp_ext+alloc"], results["gloo"], rtol=1e-5, atol=1e-6)
    assert after["allocations"] > before["allocations"], (before, after)
    if ctx.world_size > 1:
        assert after["pieces_in_place"] > before["pieces_in_place"], (before, after)
    return results


def test_fully_shard_with_group_allocation(pool):
    pool.run(check_fully_shard_with_group_allocation)


def test_ddp_matches_gloo(pool):
    pool.run(check_ddp_parity)


def test_upstream_fully_shard_matches_gloo(pool):
    pool.run(check_fully_shard_parity)
