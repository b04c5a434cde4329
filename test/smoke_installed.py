"""A first run of an installed torch_fsdp_ext, as a new user would try it:

    torchrun --standalone --nproc-per-node 2 test/smoke_installed.py

On each rank: a 2-rank all-reduce over fsdp_ext checked element by element,
then one training step of a small model sharded by our fully_shard and by
upstream's from the same weights and batch, whose losses and gradients must be
equal bit for bit. Prints which torch_fsdp_ext, torch and UCX ran.
test/compat_pass.sh runs it after `pip install --no-build-isolation .`.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as upstream_fully_shard

import torch_fsdp_ext


def main():
    dist.init_process_group("fsdp_ext")
    rank, world = dist.get_rank(), dist.get_world_size()

    values = torch.arange(8191, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(values)
    expected = torch.arange(8191, dtype=torch.float32) * (world * (world + 1) // 2)
    torch.testing.assert_close(values, expected, rtol=0, atol=0)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ours, upstream = copy.deepcopy(model), copy.deepcopy(model)
    for shard, net in ((torch_fsdp_ext.fully_shard, ours), (upstream_fully_shard, upstream)):
        for layer in net:
            if isinstance(layer, nn.Linear):
                shard(layer)
        shard(net)
    batch = torch.randn(6, 16, generator=torch.Generator().manual_seed(rank))
    losses = []
    for net in (ours, upstream):
        loss = net(batch).square().mean()
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1]), losses
    for (name, a), (_, b) in zip(ours.named_parameters(), upstream.named_parameters()):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), name

    if rank == 0:
        ucx = torch_fsdp_ext._C._ucx_library()
        print(f"smoke ok: torch_fsdp_ext from {torch_fsdp_ext.__file__}, torch {torch.__version__}, "
              f"UCX {ucx['version']} ({ucx['built_against']}, {ucx['directory']}), world size {world}, "
              f"loss {losses[0].item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
