"""QLoRA training step (torchao NF4 weights, frozen, with trainable low-rank
adapters, as torchtune trains them): our fully_shard against upstream's over
fsdp_ext, in the same rank processes, one step of each in turn.

    python benchmarks/qlora_step.py [--world-size 2] [--steps 16] [--blocks 8] [--dim 256]

Each block is two LoRA-adapted NF4 Linears (dim x 4*dim and back) and its own
FSDP group; the step is forward, backward and AdamW on the adapters. Both
sides gather the NF4 bytes through torchao's all-gather extension (its
Python hooks run per weight on both). Reported: the median step time (each
step the slowest rank's, the first quarter of the steps dropped) and
upstream's over ours. Needs torchao (`make test` installs it)."""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _workers import init_rank, run_ranks  # noqa: E402

IMPLS = ("upstream", "ours")


def _qlora_model(blocks, dim):
    import torch
    import torch.nn as nn
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

    class LoRALinear(nn.Module):
        def __init__(self, d_in, d_out, rank=8):
            super().__init__()
            self.weight = nn.Parameter(to_nf4(torch.randn(d_out, d_in) * d_in ** -0.5),
                                       requires_grad=False)
            self.lora_a = nn.Linear(d_in, rank, bias=False)
            self.lora_b = nn.Linear(rank, d_out, bias=False)

        def forward(self, x):
            return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))

    return nn.Sequential(*(nn.Sequential(LoRALinear(dim, 4 * dim), nn.GELU(),
                                         LoRALinear(4 * dim, dim)) for _ in range(blocks)))


def _worker(rank, world, init_file, queue, args):
    gloo = init_rank(rank, world, init_file)
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp as upstream

    import torch_fsdp_ext

    built = {}
    for impl in IMPLS:
        fully_shard = torch_fsdp_ext.fully_shard if impl == "ours" else upstream.fully_shard
        torch.manual_seed(0)
        model = _qlora_model(args.blocks, args.dim)
        for block in model:
            fully_shard(block)
        fully_shard(model)
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        built[impl] = (model, optim)
    times = {impl: [] for impl in IMPLS}
    losses = {impl: [] for impl in IMPLS}
    for step in range(args.steps):
        x = torch.randn(8, args.dim, generator=torch.Generator().manual_seed(1000 * step + rank))
        for impl in IMPLS:
            model, optim = built[impl]
            dist.barrier(group=gloo)
            start = time.perf_counter()
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            times[impl].append(time.perf_counter() - start)
            losses[impl].append(loss.item())
    for impl in IMPLS:  # each step the slowest rank's
        slowest = torch.tensor(times[impl], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=gloo)
        times[impl] = slowest.tolist()
    if rank == 0:
        queue.put({"times": times, "losses": losses})
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    args = parser.parse_args()
    result = run_ranks(args.world_size, _worker, args)
    skip = args.steps // 4
    median = {impl: statistics.median(result["times"][impl][skip:]) * 1e3 for impl in IMPLS}
    same = result["losses"]["ours"] == result["losses"]["upstream"]
    print(f"QLoRA step, {args.blocks} blocks of NF4 {args.dim}x{4 * args.dim} Linears with "
          f"rank-8 adapters, {args.world_size} ranks over fsdp_ext (median of steps "
          f"{skip}..{args.steps - 1}):")
    print("| contender | step ms |\n|---|---:|")
    for impl in IMPLS:
        print(f"| {impl} | {median[impl]:.1f} |")
    print(f"upstream's step over ours: {median['upstream'] / median['ours']:.2f}x; "
          f"losses {'bitwise equal' if same else 'DIFFER'} at every step")


if __name__ == "__main__":
    main()
