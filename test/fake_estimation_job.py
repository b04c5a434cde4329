"""Memory estimation on fake tensors, as torchtitan's memory estimation runs
it: one process, a fake process group of 4 ranks (this is rank 3, whose shards
are the shortest), the model built and trained under FakeTensorMode, torch's
FSDPMemTracker watching two steps (statistics reset after the first); then
two plain fake steps without the tracker, also on a fake group of one rank. Upstream's fully_shard and ours in turn;
prints one JSON object (test_drop_in.py compares them).

    python test/fake_estimation_job.py"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fsdp_testing import MLPStack, fsdp_api, tracker_phase_sizes  # noqa: E402

# The per-module kinds the tracker counts the same on both (test_drop_in.py).
TRACKED_KINDS = ("SHARDED_PARAM", "UNSHARDED_PARAM", "UNSHARDED_GRAD", "OPT")


def build(impl, mesh, hidden):
    api = fsdp_api(impl)
    model = MLPStack(n=2, dim=64, hidden=hidden)
    for module in model:
        if not isinstance(module, nn.Linear):
            api.fully_shard(module, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def step(model, optim, batch):
    loss = model(batch).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def estimate(impl, mesh):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    with FakeTensorMode():
        # Even shards: upstream pads uneven ones again at lazy init, inside
        # the first tracked forward, and the tracker then counts those as
        # activations (ours are padded once, so their sharded parameters).
        model, optim = build(impl, mesh, hidden=256)
        batch = torch.randn(8, 64)
        tracker = FSDPMemTracker(model, optim)
        tracker.track_inputs((batch,))
        with tracker:
            step(model, optim, batch)
            tracker.reset_mod_stats()
            step(model, optim, batch)
        peak = {str(kind): size
                for kind, size in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
        phases = {f"{fqn} {phase}": sizes
                  for (fqn, phase), sizes in tracker_phase_sizes(tracker, TRACKED_KINDS).items()}
    return {"peak": peak, "phases": phases}


def plain_fake_step(impl, mesh):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        # 250 hidden rows over 4 ranks: padded shards, rank 3's the shortest.
        model, optim = build(impl, mesh, hidden=250)
        batch = torch.randn(8, 64)
        losses = [step(model, optim, batch) for _ in range(2)]
        return {
            "shards": [list(p._local_tensor.shape) for p in model.parameters()],
            "all fake": all(isinstance(p._local_tensor, FakeTensor) for p in model.parameters())
            and all(isinstance(loss, FakeTensor) for loss in losses),
            "optimizer state": sorted(str(list(v.shape)) for s in optim.state.values()
                                      for v in s.values() if v.dim() > 0),
        }


def main():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=3, world_size=4, store=FakeStore())
    mesh = init_device_mesh("cpu", (4,))
    result = {impl: {"estimate": estimate(impl, mesh), "plain": plain_fake_step(impl, mesh)}
              for impl in ("upstream", "ours")}
    dist.destroy_process_group()
    # One rank: nothing gathered, each shard copied into its own storage.
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    mesh = init_device_mesh("cpu", (1,))
    for impl in ("upstream", "ours"):
        result[impl]["plain, one rank"] = plain_fake_step(impl, mesh)
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
