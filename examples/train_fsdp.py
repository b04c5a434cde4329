"""Train a small transformer with our FSDP2 (torch_fsdp_ext.fully_shard) over fsdp_ext.

    torchrun --standalone --nproc-per-node 4 examples/train_fsdp.py [--steps N]
        [--impl ours|upstream] [--backend fsdp_ext|gloo]

Prints the loss and step time every few steps on rank 0.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_fsdp_ext  # registers the fsdp_ext backend; our fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_transformer import TinyTransformer, batch_for, shard  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--backend", default="fsdp_ext")
    parser.add_argument("--impl", choices=["ours", "upstream"], default="ours",
                        help="torch_fsdp_ext.fully_shard or torch.distributed.fsdp.fully_shard")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fully_shard = torch_fsdp_ext.fully_shard if args.impl == "ours" else None  # None: upstream
    model = shard(TinyTransformer(layers=args.layers), fully_shard=fully_shard)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"training {params / 1e6:.2f}M parameters, {args.impl} fully_shard over "
              f"'{args.backend}', "
              f"{world} ranks", flush=True)
    times = []
    for step in range(args.steps):
        tokens, targets = batch_for(rank, step)
        start = time.perf_counter()
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        dist.all_reduce(loss_avg := loss.detach().clone(), op=dist.ReduceOp.AVG)
        times.append(time.perf_counter() - start)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss_avg.item():.4f}  step time {times[-1] * 1e3:7.1f} ms",
                  flush=True)
    if rank == 0:
        steady = sorted(times[len(times) // 3:])
        print(f"median step time {steady[len(steady) // 2] * 1e3:.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
