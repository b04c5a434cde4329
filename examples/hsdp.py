"""HSDP: fully_shard on a 2-D (replicate, shard) device mesh over fsdp_ext.

    torchrun --standalone --nproc-per-node 4 examples/hsdp.py
        [--replicas 2] [--steps 8] [--check-upstream] [--losses-json losses.json]

The 4 ranks form a 2 x 2 mesh: parameters are sharded across the "shard"
dimension and replicated across "replicate". Each step all-gathers within a
shard group, reduce-scatters gradients within it, and all-reduces the
gradient shards across replicas. Across hosts, put a host's ranks in one
shard group (torchrun --nnodes 2 --nproc-per-node 2: --replicas 2).

--check-upstream trains the same model a second time, in the same processes,
with torch's own fully_shard on the same mesh over gloo, and says whether the
losses are the same bit for bit.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.fsdp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import torch_fsdp_ext  # registers the fsdp_ext backend; our fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_transformer import TinyTransformer, batch_for  # noqa: E402


def train(fully_shard, mesh, steps):
    """Shards a fresh model (same seed every call) on the 2-D mesh and trains
    it; returns the per-step losses (averaged over all ranks)."""
    torch.manual_seed(0)
    model = TinyTransformer(layers=2)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rank = dist.get_rank()
    losses = []
    for step in range(steps):
        tokens, targets = batch_for(rank, step)  # every rank its own batch
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        dist.all_reduce(loss_avg := loss.detach().clone(), op=dist.ReduceOp.AVG)
        losses.append(loss_avg.item())
    placements = str(model.head.weight.placements)
    return {"losses": losses, "placements": placements}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2, help="size of the replicate dimension")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--check-upstream", action="store_true",
                        help="also train with torch's fully_shard over gloo and compare")
    parser.add_argument("--losses-json", help="rank 0 writes the results here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("fsdp_ext")
    shape = (args.replicas, dist.get_world_size() // args.replicas)
    names = ("replicate", "shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    results = {"ours": train(torch_fsdp_ext.fully_shard, mesh, args.steps)}
    if args.check_upstream:
        gloo_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names,
                                     backend_override={0: "gloo", 1: "gloo"})
        results["upstream"] = train(torch.distributed.fsdp.fully_shard, gloo_mesh, args.steps)

    if dist.get_rank() == 0:
        ours = results["ours"]
        print(f"HSDP on a {shape[0]} x {shape[1]} (replicate, shard) mesh; "
              f"head.weight placements {ours['placements']}")
        upstream = results.get("upstream", {}).get("losses")
        for step, loss in enumerate(ours["losses"]):
            print(f"step {step:3d}  loss {loss:.6f}"
                  + (f"  upstream over gloo {upstream[step]:.6f}" if upstream else ""))
        if upstream:
            print("same losses as torch's fully_shard over gloo, bit for bit"
                  if ours["losses"] == upstream else
                  "losses differ from torch's fully_shard over gloo")
        if args.losses_json:
            with open(args.losses_json, "w") as out:
                json.dump(dict(results, mesh_shape=shape), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
