"""FSDP2 training-step time over fsdp_ext (with and without buffers allocated
from the process group) against gloo, in the same processes.

    python benchmarks/fsdp_step.py [--world-size 2] [--steps 30] [--dim 512] [--layers 4]

Each contender trains its own copy of the same model (same seeds, same data),
one step each in turn, so host noise hits all alike:

  gloo            upstream fully_shard over gloo
  fsdp_ext        upstream fully_shard over fsdp_ext
  fsdp_ext+alloc  the same, with set_allocate_memory_from_process_group_for_comm(True):
                  all-gather outputs and reduce-scatter buffers come from the group's
                  shared-memory pool, so peers read them in place

The default model is wide and the batch small, so that communication and the
copies around it are a large part of the step (as in FSDP at scale), not
hidden behind compute. Reports the median step time of the steps after the
first third (each step: the slowest rank), and checks that the losses match.
"""

import argparse
import json
import os
import statistics
import sys
import time

from _workers import init_rank, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def _worker(rank, world, init_file, queue, args):
    gloo = init_rank(rank, world, init_file)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh

    from tiny_transformer import TinyTransformer, batch_for, shard

    contenders = {"gloo": (gloo, False), "fsdp_ext": (dist.group.WORLD, False),
                  "fsdp_ext+alloc": (dist.group.WORLD, True)}
    models, optims = {}, {}
    for name, (group, allocate) in contenders.items():
        torch.manual_seed(0)
        models[name] = shard(TinyTransformer(dim=args.dim, heads=8, layers=args.layers),
                             DeviceMesh.from_group(group, "cpu"), allocate)
        optims[name] = torch.optim.SGD(models[name].parameters(), lr=0.01)
    times = {name: [] for name in models}
    losses = {name: [] for name in models}
    for step in range(args.steps):
        tokens, targets = batch_for(rank, step, batch=args.batch, seq=args.seq)
        for name, model in models.items():
            dist.barrier(group=gloo)
            start = time.perf_counter()
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            optims[name].step()
            optims[name].zero_grad()
            times[name].append(time.perf_counter() - start)
            losses[name].append(loss.item())
    for name in models:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
        times[name] = t.tolist()
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    stats = backend._pool_stats()
    if rank == 0:
        params = sum(p.numel() for p in models["gloo"].parameters())
        queue.put({"times": times, "losses": losses, "pool": stats, "params": params})
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results",
                                                           "fsdp_step.json"))
    args = parser.parse_args()
    result = run_ranks(args.world_size, _worker, args)
    steady = args.steps // 3
    medians = {name: statistics.median(t[steady:]) for name, t in result["times"].items()}
    print(f"{result['params'] / 1e6:.2f}M parameters, {args.world_size} ranks, "
          f"dim {args.dim}, {args.layers} layers, batch {args.batch}x{args.seq}, "
          f"median of steps {steady}..{args.steps - 1}")
    print(f"{'contender':<16}{'step ms':>10}{'vs gloo':>9}{'vs fsdp_ext':>13}{'final loss':>12}")
    for name, median in medians.items():
        print(f"{name:<16}{median * 1e3:>10.2f}{medians['gloo'] / median:>8.2f}x"
              f"{medians['fsdp_ext'] / median:>12.2f}x{result['losses'][name][-1]:>12.5f}")
    same = result["losses"]["fsdp_ext"] == result["losses"]["fsdp_ext+alloc"]
    worst = max(abs(a - b) for a, b in zip(result["losses"]["fsdp_ext"], result["losses"]["gloo"]))
    print(f"losses: fsdp_ext+alloc {'identical to' if same else 'DIFFER from'} fsdp_ext; "
          f"largest difference to gloo {worst:.2e}")
    print(f"pool on rank 0: {result['pool']}")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "median_seconds": medians, **result}, f, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
