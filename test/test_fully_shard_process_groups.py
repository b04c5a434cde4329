"""Our fully_shard over a process group implemented in Python: torch's threaded
test process group (every rank a thread of this process). It has no C++
backend, so the runtime issues its collectives through torch.distributed's
functions instead of the C++ ProcessGroup API; training must match
upstream's fully_shard on the same group, FSDP and HSDP."""

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_testing import IMPLS, fsdp_api, requires_upstream

STEPS = 3


def _model(dim=6):
    """Initial values from a private generator: the ranks are threads of one
    process, so the global RNG would be shared between them."""
    model = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return model


def _train(rank, mesh_shape, policy):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if policy == "bf16" else MixedPrecisionPolicy()
    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        model = _model()
        api.fully_shard(model[0], mesh=mesh, mp_policy=mp)
        api.fully_shard(model, mesh=mesh, mp_policy=mp)
        optim = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(STEPS):
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(x).float().pow(2).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        out[impl] = (losses, [p.detach().full_tensor() for p in model.parameters()])
    return out


def _run_threads(world_size, fn):
    """Runs fn(rank) on `world_size` threads joined by the threaded process
    group; returns the per-rank results or raises the first rank's error."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    results, errors = {}, {}
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store = dist.HashStore()

    def worker(rank):
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            results[rank] = fn(rank)
        except BaseException as error:  # reported below with its rank
            errors[rank] = error
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world_size)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a rank thread did not finish"
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed: {errors[rank]!r}") from errors[rank]
    return [results[r] for r in range(world_size)]


@requires_upstream("threaded_process_group_rounds")
@pytest.mark.parametrize("mesh_shape,policy", [((2,), "none"), ((2,), "bf16"), ((2, 2), "none")],
                         ids=["fsdp2", "fsdp2-bf16", "hsdp2x2"])
def test_python_process_group_trains_like_upstream(mesh_shape, policy):
    world = 1
    for size in mesh_shape:
        world *= size
    per_rank = _run_threads(world, lambda rank: _train(rank, mesh_shape, policy))
    for rank, out in enumerate(per_rank):
        ours_losses, ours_params = out["ours"]
        up_losses, up_params = out["upstream"]
        assert ours_losses == up_losses, (rank, ours_losses, up_losses)
        for a, b in zip(ours_params, up_params):
            assert torch.equal(a, b), rank
