"""torch's own DDP and upstream fully_shard train over fsdp_ext with the same
losses as over gloo (same model, data and seeds, in the same processes)."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from tiny_transformer import TinyTransformer, batch_for  # noqa: E402

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


def check_fully_shard_parity(ctx):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    results = {}
    for name, group in (("fsdp_ext", dist.group.WORLD), ("gloo", ctx.gloo_group)):
        mesh = DeviceMesh.from_group(group, "cpu")
        torch.manual_seed(0)
        model = TinyTransformer(layers=3)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        results[name] = _train(model, ctx.rank)
    torch.testing.assert_close(results["fsdp_ext"], results["gloo"], rtol=1e-5, atol=1e-6)
    assert results["fsdp_ext"][-1] < results["fsdp_ext"][0]
    return results


def test_ddp_matches_gloo(pool):
    pool.run(check_ddp_parity)


def test_upstream_fully_shard_matches_gloo(pool):
    pool.run(check_fully_shard_parity)
