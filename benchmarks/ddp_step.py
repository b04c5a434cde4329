"""One DDP training step: torch's DistributedDataParallel over fsdp_ext against
gloo, in the same run.

    python benchmarks/ddp_step.py [--world-sizes 2 4] [--steps 30] [--dim 512] [--layers 6]
    python benchmarks/ddp_step.py --hosts 2 [--ranks-per-host 1] [--netem-rate-mbit 10000]

Every rank builds the same MLP stack three times (same seed): `local` (no
DDP: the compute alone, the floor), DDP over the fsdp_ext default group, and
DDP over a gloo group of the same ranks. Steps alternate between the three,
so host noise hits all alike. Reports the median step time after the
warm-up steps (slowest rank), each backend's overhead over `local`, and the
last losses of the two DDP runs (the same data and model, so they agree up to
the order of summation). Writes benchmarks/results/ddp_step.json.

--hosts 2 runs the ranks on two emulated hosts (test/multihost.py, root):
every all-reduce crosses TCP. The same run measures the link (plain TCP both
ways at once, best of 3 rounds, before and after) and reports the link's
lower bound for the step: the gradients' bytes (an all-reduce over two hosts
moves its whole buffer across the link in each direction) over what TCP
carried, or the local step if longer. Writes ddp_step_2hosts.json.
"""

import argparse
import json
import os
import statistics
import sys
import time

from _workers import init_rank, init_torchrun_rank, run_on_two_hosts, run_ranks

WARMUP = 5


def _model(dim, layers):
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)]
    return nn.Sequential(*blocks)


def _worker(rank, world, init_file, queue, steps, dim, layers, batch, pin):
    import torch.distributed as dist

    gloo = init_rank(rank, world, init_file, pin)
    result = _time_steps(rank, world, gloo, steps, dim, layers, batch)
    if rank == 0:
        queue.put(result)
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def _torchrun_worker(args):
    """One rank of a --hosts 2 run; rank 0 writes its result to the file."""
    import torch.distributed as dist

    gloo = init_torchrun_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    result = _time_steps(rank, world, gloo, args.steps, args.dim, args.layers, args.batch)
    if rank == 0:
        with open(args.torchrun_worker, "w") as f:
            json.dump(result, f)
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def _time_steps(rank, world, gloo, steps, dim, layers, batch):
    """Rank 0: the slowest rank's median step per contender, and the losses."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    contenders = {
        "local": _model(dim, layers),
        "fsdp_ext": DDP(_model(dim, layers)),
        "gloo": DDP(_model(dim, layers), process_group=gloo),
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in contenders.items()}
    seconds = {name: [] for name in contenders}
    losses = {name: [] for name in contenders}
    for step in range(steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        inputs = torch.randn(batch, dim, generator=generator)
        for name, model in contenders.items():
            dist.barrier(group=gloo)
            start = time.perf_counter()
            loss = model(inputs).square().mean()
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            seconds[name].append(time.perf_counter() - start)
            losses[name].append(loss.item())
    # The slowest rank's median per contender.
    everyone = [None] * world
    dist.all_gather_object(everyone, seconds, group=gloo)
    medians = {name: max(statistics.median(r[name][WARMUP:]) for r in everyone)
               for name in contenders}
    return {"world_size": world, "median_s": medians, "losses": losses,
            "parameters": sum(p.numel() for p in contenders["local"].parameters())}


def _across_two_hosts(args):
    from _tcp_link import best

    r, link = run_on_two_hosts(__file__, sys.argv[1:], args.ranks_per_host, args.netem_rate_mbit)
    med = r["median_s"]
    both_ways = best(link, both_ways=True)
    # An all-reduce over two hosts: each host sends its half of the partial
    # sums and its half of the result, the whole buffer, in each direction.
    crossing = r["parameters"] * 4
    link_ms = crossing / (both_ways * 1e9) * 1e3
    bound = max(link_ms, med["local"] * 1e3)
    r["max_loss_difference"] = max(abs(a - b) for a, b in zip(r["losses"]["fsdp_ext"],
                                                            r["losses"]["gloo"]))
    shaped = f"shaped to {args.netem_rate_mbit} Mbit/s" if args.netem_rate_mbit else "unshaped"
    print(f"two hosts x {args.ranks_per_host} rank(s), link {shaped}: plain TCP carried "
          f"{both_ways:.2f} GB/s per direction, both ways busy; {r['parameters']} parameters, "
          f"{crossing / 2**20:.1f} MiB across the link per direction per step: link time "
          f"{link_ms:.1f} ms, local step {med['local'] * 1e3:.1f} ms, bound {bound:.1f} ms\n")
    print("| contender | step ms | step / bound | vs gloo |")
    print("|---|---:|---:|---:|")
    for name in ("local", "fsdp_ext", "gloo"):
        print(f"| {name} | {med[name] * 1e3:.1f} | {med[name] * 1e3 / bound:.2f}x | "
              f"{med['gloo'] / med[name]:.2f}x |")
    print(f"\nmax |loss diff| fsdp_ext vs gloo: {r['max_loss_difference']:.2e}")
    output = args.output or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         "ddp_step_2hosts.json")
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w") as f:
        json.dump({"args": vars(args), "result": r, "link_GBps": link, "bound_ms": bound}, f,
                  indent=1)
    print(f"\nwrote {output}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output", default=None)
    parser.add_argument("--pin-ranks", action="store_true",
                        help="bind each rank (and its threads) to one core, every contender alike")
    parser.add_argument("--hosts", type=int, choices=[1, 2], default=1)
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--netem-rate-mbit", type=int, default=None,
                        help="--hosts 2: shape the link between the hosts to this rate")
    parser.add_argument("--torchrun-worker", metavar="RESULT_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    if args.torchrun_worker:
        return _torchrun_worker(args)
    if args.hosts == 2:
        return _across_two_hosts(args)
    results = []
    print(f"{'ws':>3}{'params':>11}{'local ms':>10}{'fsdp_ext ms':>13}{'gloo ms':>10}"
          f"{'fsdp_ext over local':>21}{'gloo over local':>17}{'gloo / fsdp_ext':>17}"
          f"{'max |loss diff|':>17}")
    for world in args.world_sizes:
        r = run_ranks(world, _worker, args.steps, args.dim, args.layers, args.batch,
                      args.pin_ranks)
        med = r["median_s"]
        diff = max(abs(a - b) for a, b in zip(r["losses"]["fsdp_ext"], r["losses"]["gloo"]))
        r["max_loss_difference"] = diff
        results.append(r)
        print(f"{world:>3}{r['parameters']:>11}{med['local'] * 1e3:>10.1f}"
              f"{med['fsdp_ext'] * 1e3:>13.1f}{med['gloo'] * 1e3:>10.1f}"
              f"{med['fsdp_ext'] / med['local']:>20.2f}x{med['gloo'] / med['local']:>16.2f}x"
              f"{med['gloo'] / med['fsdp_ext']:>16.2f}x{diff:>17.2e}")
    output = args.output or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         "ddp_step.json")
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(f"\nwrote {output}")


if __name__ == "__main__":
    main()
