"""Collective latency and bandwidth: fsdp_ext against gloo in the same run.

    python benchmarks/collectives.py [--world-sizes 2 4] [--max-bytes 64M] [--repeats 5]
    python benchmarks/collectives.py --hosts 2 [--ranks-per-host 1 2] [--netem-rate-mbit R]
                                     [--netem-delay-ms D]      (root: network namespaces)

With --hosts 2 the ranks run on two emulated hosts (test/multihost.py: two
network namespaces joined by a veth link, distinct hostnames, real `torchrun
--nnodes 2`), so everything between hosts crosses TCP. Before and after the
collectives the same run measures the link itself (_tcp_link.py: plain TCP,
one way and both ways at once, one stream and one per rank of a host, best
of 3 rounds each) and reports, per op, the bytes that must cross the link
per second (nccl-tests' bus bandwidth for one rank per host) as a fraction
of what TCP carried in the op's pattern, next to gloo's, and which of the
targets (>= 50 % at 1 MiB, >= 80 % from 16 MiB, never slower than gloo) are
missed. --netem-rate-mbit shapes the link (a token bucket; netem when a
delay is asked for, which needs a kernel with sch_netem). Results go to
collectives_2hosts.json / .png.

For every op and message size, the contenders run in the same processes
(fsdp_ext as the default group, gloo as a second group over the same ranks),
alternating, so host noise hits all alike:

  fsdp_ext        ordinary tensors (torch.empty)
  fsdp_ext+alloc  buffers from group._get_backend(cpu).allocate_tensor (what
                  FSDP2 uses with set_allocate_memory_from_process_group_for_comm)
  gloo            ordinary tensors

all_gather_into_tensor uses FSDP2's layout (the input is this rank's slice of
the output); the *_coalesced rows issue a bucket of 4 equal members inside
dist._coalescing_manager (one fused op for fsdp_ext). Reports the median of
the repeats (each repeat: two untimed ops, then the timed ones; the slowest
rank's time), the bus bandwidth (the bytes
each rank must move, nccl-tests' convention), ratios to gloo, to single-core
memcpy at the same size, and (one host) to the copy limit: what the same
number of ranks get while all copy that many bytes out of a peer's freshly
written memory at once (measure_limits; also the cross-core hand-off
latency, the floor for small ops). Writes benchmarks/results/collectives.json
and a plot of bus bandwidth against size, collectives.png, next to it.
"""

import argparse
import json
import os
import statistics
import sys
import time

from _workers import init_rank, init_torchrun_rank, run_ranks
from _workers import run_on_two_hosts as two_hosts
from torch_fsdp_ext import _C

OPS = ["all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_into_tensor_coalesced",
       "reduce_scatter_tensor_coalesced", "all_reduce", "broadcast"]
# Ops that get a run with buffers allocated from the group.
ALLOC_OPS = set(OPS)
BUCKET_MEMBERS = 4


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def human(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def sizes_between(min_bytes, max_bytes):
    sizes, size = [], 4
    while size <= max_bytes:
        if size >= min_bytes:
            sizes.append(size)
        size *= 4
    return sizes


def iterations_for(nbytes):
    # Enough back-to-back ops per repeat to get past the ramp-up this VM shows
    # after a pause (the first ~10 large ops after an idle barrier run up to
    # 2.5x slower, for gloo too), plus WARMUP untimed ones per repeat. Ops of a
    # few microseconds get more, so that a repeat lasts milliseconds and one
    # scheduler tick lost to another process is not a 4x "slowest repeat".
    if nbytes <= 4 << 10:
        return 1000
    if nbytes <= 64 << 10:
        return 200
    if nbytes <= 1 << 20:
        return 50
    if nbytes <= 4 << 20:
        return 30
    if nbytes <= 16 << 20:
        return 12
    return 4


WARMUP = 2


def bus_factor(op, n):
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op.startswith(("all_gather", "reduce_scatter")):
        return (n - 1) / n
    return 1.0


def _make_runner(op, nbytes, world, rank, group, allocate):
    """A closure running `op` once on `group`, with buffers from `allocate`."""
    import torch
    import torch.distributed as dist

    members = BUCKET_MEMBERS if op.endswith("_coalesced") else 1
    # Each member's full size is a multiple of the world size, in floats.
    per_member = max(world, nbytes // 4 // members) // world * world
    fulls = [allocate(per_member) for _ in range(members)]
    for full in fulls:
        full.fill_(1.0)
    if op.startswith("all_gather"):
        parts = [f.narrow(0, rank * (per_member // world), per_member // world) for f in fulls]
    else:
        parts = [allocate(per_member // world) for _ in range(members)]

    if op == "all_gather_into_tensor":
        return lambda: dist.all_gather_into_tensor(fulls[0], parts[0], group=group), per_member
    if op == "reduce_scatter_tensor":
        return lambda: dist.reduce_scatter_tensor(parts[0], fulls[0], group=group), per_member
    if op == "all_reduce":
        return lambda: dist.all_reduce(fulls[0], group=group), per_member
    if op == "broadcast":
        return lambda: dist.broadcast(fulls[0], src=0, group=group), per_member

    def coalesced():
        with dist._coalescing_manager(group=group):
            for full, part in zip(fulls, parts):
                if op.startswith("all_gather"):
                    dist.all_gather_into_tensor(full, part, group=group)
                else:
                    dist.reduce_scatter_tensor(part, full, group=group)

    return coalesced, per_member * members


def _worker(rank, world, init_file, queue, ops, sizes, repeats, pin):
    gloo = init_rank(rank, world, init_file, pin)
    import torch.distributed as dist

    results = _measure(rank, world, gloo, ops, sizes, repeats)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def _torchrun_worker(ops, sizes, repeats, result_file):
    """One rank of a --hosts run, started by torchrun on an emulated host."""
    import torch.distributed as dist

    gloo = init_torchrun_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = _measure(rank, world, gloo, ops, sizes, repeats)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _measure(rank, world, gloo, ops, sizes, repeats):
    import torch
    import torch.distributed as dist

    cpu = torch.device("cpu")
    backend = dist.group.WORLD._get_backend(cpu)
    shared_memory = backend.supports_tensor_alloc(cpu)

    def ordinary(numel):
        return torch.empty(numel)

    def from_group(numel):
        return backend.allocate_tensor(numel, dtype=torch.float32, device=cpu)

    results = []
    for op in ops:
        for nbytes in sizes:
            contenders = {"fsdp_ext": (dist.group.WORLD, ordinary), "gloo": (gloo, ordinary)}
            if op in ALLOC_OPS and shared_memory:
                contenders["fsdp_ext+alloc"] = (dist.group.WORLD, from_group)
            runners = {}
            for name, (group, allocate) in contenders.items():
                runners[name], numel = _make_runner(op, nbytes, world, rank, group, allocate)
            iters = iterations_for(nbytes)
            samples = {name: [] for name in runners}
            for run in runners.values():
                run()  # warm-up (connections, scratch and staging memory)
            for _ in range(repeats):
                for name, run in runners.items():
                    dist.barrier(group=gloo)
                    for _ in range(WARMUP):
                        run()
                    start = time.perf_counter()
                    for _ in range(iters):
                        run()
                    samples[name].append((time.perf_counter() - start) / iters)
            # The op is as slow as its slowest rank: take the max over ranks.
            for name in runners:
                t = torch.tensor(samples[name], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
                samples[name] = t.tolist()
            if rank == 0:
                results.append({"op": op, "bytes": numel * 4, "world_size": world,
                                "shared_memory": shared_memory, "seconds": samples})
    return results


def run_on_two_hosts(ranks_per_host, ops, sizes, repeats, netem):
    """Runs the measurement under torchrun on two emulated hosts; rank 0's
    rows, each with the link's limits measured around the run."""
    args = ["--repeats", str(repeats), "--min-bytes", str(sizes[0]), "--max-bytes",
            str(sizes[-1]), "--ops", *ops]
    rows, link = two_hosts(__file__, args, ranks_per_host, **netem)
    print(f"{ranks_per_host} rank(s) per host: plain TCP between the hosts, GB/s per "
          f"direction (best of the rounds before and after): "
          + ", ".join(f"{key} {value:.2f}" for key, value in link.items()))
    for row in rows:
        row["link_GBps"] = link
    return rows


def link_traffic(op, nbytes, hosts):
    """(bytes that must cross the link in each direction, whether the op
    sends both ways): all-gather and reduce-scatter move the other hosts'
    share, all-reduce twice that, broadcast the whole message one way. With
    one rank per host this is nccl-tests' bus bandwidth numerator."""
    share = nbytes * (hosts - 1) / hosts
    if op == "all_reduce":
        return 2 * share, True
    if op == "broadcast":
        return nbytes, False
    return share, True


def measure_memcpy(sizes):
    """Single-core copy bandwidth (GB/s) per size: the physical reference."""
    import torch

    torch.set_num_threads(1)
    out = {}
    for nbytes in sizes:
        src = torch.ones(max(1, nbytes // 4))
        dst = torch.empty_like(src)
        iters = max(3, min(2000, (256 << 20) // max(nbytes, 1)))
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src)
            best = min(best, (time.perf_counter() - start) / iters)
        out[nbytes] = src.numel() * 4 / best / 1e9
    return out


def measure_limits(sizes, world_sizes):
    """The physical references of a shared-memory collective on this machine
    (comm/memory_limits.h, in C++ with the GIL released):

    copy[ws][bytes]  GB/s per rank when `ws` ranks all copy `bytes` out of a
                     peer's freshly written buffer at once (bytes over the
                     best round, first start to last end) -- what an
                     all-gather's readers do; in-cache sizes and memory-bound
                     sizes alike, on the cores this machine has;
    handoff_us       the round trip of a flag between two cores: the least a
                     small collective can cost (each rank must learn that its
                     peer's data is ready, and the peer that it was read).
    """
    copy = {}
    for world in world_sizes:
        copy[world] = {}
        for nbytes in sizes:
            rounds = max(5, min(200, (256 << 20) // max(nbytes * world, 1)))
            seconds = _C._concurrent_peer_copy_seconds(world, nbytes, rounds)
            copy[world][nbytes] = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    handoff_us = _C._handoff_round_trip_ns(20000) / 1e3
    return {"copy_GBps": copy, "handoff_round_trip_us": handoff_us}


def summarize(entry, memcpy, limits=None):
    n, nbytes, op = entry["world_size"], entry["bytes"], entry["op"]
    med = {k: statistics.median(v) for k, v in entry["seconds"].items()}
    moved = nbytes * bus_factor(op, n)
    reference = memcpy[min(memcpy, key=lambda s: abs(s - nbytes))]
    base_op = op.removesuffix("_coalesced")
    row = {
        "op": op, "world_size": n, "bytes": nbytes,
        # Limits are measured for one host only, where small ops take the
        # small-op channel (coalesced ones stay one fused bucket).
        "algorithm": _C._selected_algorithm(
            base_op, nbytes, n, entry["shared_memory"],
            small_op_channel=limits is not None and not op.endswith("_coalesced"),
            spans_hosts="link_GBps" in entry),
        "memcpy_GBps": reference,
        "fsdp_ext_worst_over_median": max(entry["seconds"]["fsdp_ext"]) / med["fsdp_ext"],
    }
    for name, seconds in med.items():
        row[f"{name}_us"] = seconds * 1e6
        row[f"{name}_busbw_GBps"] = moved / seconds / 1e9
        if name != "gloo":
            row[f"{name}_speedup_vs_gloo"] = med["gloo"] / seconds
            row[f"{name}_busbw_over_memcpy"] = moved / seconds / 1e9 / reference
    if "fsdp_ext+alloc" in med:
        row["fsdp_ext+alloc_worst_over_median"] = (max(entry["seconds"]["fsdp_ext+alloc"])
                                                   / med["fsdp_ext+alloc"])
    if "link_GBps" in entry:
        # Against what plain TCP carried between the hosts in the same run,
        # in the op's pattern (both directions at once, or one), with as
        # many streams as helped.
        crossing, both_ways = link_traffic(op, nbytes, 2)
        from _tcp_link import best

        limit = best(entry["link_GBps"], both_ways)
        row["link_limit_GBps"] = limit
        row["ranks_per_host"] = n // 2
        for name in med:
            row[f"{name}_link_GBps"] = crossing / med[name] / 1e9
            row[f"{name}_over_link"] = crossing / med[name] / 1e9 / limit
    if limits is not None:
        # Against what ranks reading each other's memory can reach at this
        # size (each rank copying the message once), and for latency against
        # the cross-core hand-off.
        measured = limits["copy_GBps"][n]
        limit = measured[min(measured, key=lambda size: abs(size - nbytes))]
        row["copy_limit_GBps"] = limit
        row["handoff_round_trip_us"] = limits["handoff_round_trip_us"]
        for name in med:
            if name != "gloo":
                row[f"{name}_busbw_over_copy_limit"] = moved / med[name] / 1e9 / limit
                row[f"{name}_over_handoff"] = med[name] * 1e6 / limits["handoff_round_trip_us"]
    return row


def print_table(rows):
    header = (f"{'op':<34}{'ws':>3}{'size':>9}  {'algo':<7}{'ours us':>10}{'alloc us':>10}"
              f"{'gloo us':>11}{'speedup':>9}{'alloc x':>9}{'busbw':>8}{'alloc':>8}{'gloo':>7}"
              f"{'memcpy':>8}{'%mcpy':>7}{'%alloc':>7}{'limit':>7}{'%lim':>6}{'%limA':>6}"
              f"{'worst':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        alloc = "fsdp_ext+alloc" in [k.removesuffix("_us") for k in r if k.endswith("_us")]

        def a(key, fmt):
            return format(r[key], fmt) if alloc else "-"

        print(f"{r['op']:<34}{r['world_size']:>3}{human(r['bytes']):>9}  {r['algorithm']:<7}"
              f"{r['fsdp_ext_us']:>10.1f}{a('fsdp_ext+alloc_us', '.1f'):>10}{r['gloo_us']:>11.1f}"
              f"{r['fsdp_ext_speedup_vs_gloo']:>8.1f}x"
              f"{a('fsdp_ext+alloc_speedup_vs_gloo', '.1f'):>8}{'x' if alloc else ' '}"
              f"{r['fsdp_ext_busbw_GBps']:>8.2f}{a('fsdp_ext+alloc_busbw_GBps', '.2f'):>8}"
              f"{r['gloo_busbw_GBps']:>7.2f}{r['memcpy_GBps']:>8.1f}"
              f"{100 * r['fsdp_ext_busbw_over_memcpy']:>6.0f}%"
              f"{a('fsdp_ext+alloc_busbw_over_memcpy', '.0%'):>7}"
              + (f"{r['copy_limit_GBps']:>7.1f}{r['fsdp_ext_busbw_over_copy_limit']:>6.0%}"
                 f"{a('fsdp_ext+alloc_busbw_over_copy_limit', '.0%'):>6}"
                 if "copy_limit_GBps" in r else f"{'-':>7}{'-':>6}{'-':>6}")
              + f"{r['fsdp_ext_worst_over_median']:>7.2f}")


def print_link_table(rows):
    """The two-host rows: each contender's bytes across the link per second
    (link_traffic) and that as a fraction of what plain TCP carried."""
    header = (f"{'op':<34}{'hxr':>4}{'size':>9}  {'algo':<7}{'ours us':>10}{'alloc us':>10}"
              f"{'gloo us':>11}{'vs gloo':>8}{'link GB/s':>10}{'gloo':>7}{'limit':>7}"
              f"{'%limit':>7}{'%alloc':>7}{'%gloo':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        alloc = "fsdp_ext+alloc_us" in r
        best = min(r["fsdp_ext_us"], r.get("fsdp_ext+alloc_us", float("inf")))
        print(f"{r['op']:<34}{'2x' + str(r['ranks_per_host']):>4}{human(r['bytes']):>9}  "
              f"{r['algorithm']:<7}{r['fsdp_ext_us']:>10.1f}"
              f"{format(r['fsdp_ext+alloc_us'], '.1f') if alloc else '-':>10}"
              f"{r['gloo_us']:>11.1f}{r['gloo_us'] / best:>7.2f}x{r['fsdp_ext_link_GBps']:>10.2f}"
              f"{r['gloo_link_GBps']:>7.2f}{r['link_limit_GBps']:>7.2f}"
              f"{r['fsdp_ext_over_link']:>7.0%}"
              f"{format(r['fsdp_ext+alloc_over_link'], '.0%') if alloc else '-':>7}"
              f"{r['gloo_over_link']:>7.0%}")


def link_targets(rows):
    """Issue 26's targets, checked on ordinary tensors (what a user gets):
    >= 50 % of the link at 1 MiB, >= 80 % from 16 MiB, never slower than
    gloo. Returns one line per miss (an empty list: all met)."""
    misses = []
    for r in rows:
        where = f"{r['op']} 2x{r['ranks_per_host']} {human(r['bytes'])}"
        if r["fsdp_ext_us"] > r["gloo_us"]:
            misses.append(f"{where}: slower than gloo ({r['fsdp_ext_us']:.0f} vs "
                          f"{r['gloo_us']:.0f} us)")
        want = 0.8 if r["bytes"] >= 16 << 20 else 0.5 if r["bytes"] >= 1 << 20 else None
        if want is not None and r["fsdp_ext_over_link"] < want:
            misses.append(f"{where}: {r['fsdp_ext_over_link']:.0%} of the link (target "
                          f"{want:.0%})")
    return misses


def plot(rows, memcpy, path, where="on one host (2 cores)", limits=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = ["all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast"]
    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(len(ops), len(worlds), figsize=(6 * len(worlds), 4.2 * len(ops)),
                             squeeze=False)
    styles = {"fsdp_ext": ("fsdp_ext", "C0", "o-"),
              "fsdp_ext+alloc": ("fsdp_ext, buffers from the group", "C2", "s-"),
              "gloo": ("gloo", "C3", "^-")}
    for i, op in enumerate(ops):
        for j, world in enumerate(worlds):
            ax = axes[i][j]
            mine = [r for r in rows if r["op"] == op and r["world_size"] == world]
            sizes = [r["bytes"] for r in mine]
            across = bool(mine) and "link_limit_GBps" in mine[0]
            for name, (label, color, style) in styles.items():
                key = f"{name}_link_GBps" if across else f"{name}_busbw_GBps"
                if mine and key in mine[0]:
                    ax.plot(sizes, [r[key] for r in mine], style, color=color, label=label, ms=4)
            if across:
                ax.axhline(mine[0]["link_limit_GBps"], color="k", ls="--", lw=1,
                           label="plain TCP between the hosts (best round)")
            else:
                ax.plot(sorted(memcpy), [memcpy[s] for s in sorted(memcpy)], "k--",
                        label="single-core memcpy", lw=1)
            if limits is not None and world in limits["copy_GBps"]:
                copy = limits["copy_GBps"][world]
                ax.plot(sorted(copy), [copy[s] for s in sorted(copy)], "k:", lw=1.5,
                        label=f"copy limit: {world} ranks reading peers at once")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, {world} ranks")
            ax.set_xlabel("message size (bytes)")
            ax.set_ylabel("bytes across the link per second (GB/s)" if across
                          else "bus bandwidth (GB/s)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"fsdp_ext vs gloo {where}: bus bandwidth against message size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--min-bytes", type=parse_size, default=4)
    parser.add_argument("--max-bytes", type=parse_size, default=64 << 20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    parser.add_argument("--output", default=None)
    parser.add_argument("--pin-ranks", action="store_true",
                        help="bind each rank (and the threads it starts) to one core, rank "
                             "modulo the cores available, for every contender alike")
    parser.add_argument("--hosts", type=int, choices=[1, 2], default=1)
    parser.add_argument("--ranks-per-host", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--netem-rate-mbit", type=int, default=None)
    parser.add_argument("--netem-delay-ms", type=float, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: CUDA tensors, every rank on the one GPU (_cuda_collectives.py)")
    parser.add_argument("--torchrun-worker", metavar="RESULT_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = sizes_between(args.min_bytes, args.max_bytes)
    if not sizes:
        parser.error(f"no message size between --min-bytes {args.min_bytes} and --max-bytes "
                     f"{args.max_bytes}: the sizes measured are 4 B times powers of 4 "
                     f"(4 B, 16 B, 64 B, ... 64 MiB)")
    if args.torchrun_worker:
        return _torchrun_worker(args.ops, sizes, args.repeats, args.torchrun_worker)
    results_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    if args.device == "cuda":
        import _cuda_collectives

        output = args.output or os.path.join(results_dir, "collectives_cuda.json")
        os.makedirs(os.path.dirname(output), exist_ok=True)
        return _cuda_collectives.run(args.world_sizes, args.ops, sizes, args.repeats, output)
    if args.output is None:
        name = "collectives.json" if args.hosts == 1 else "collectives_2hosts.json"
        args.output = os.path.join(results_dir, name)
    memcpy = measure_memcpy(sizes)
    limits = None
    if args.hosts == 1:
        limits = measure_limits(sizes, args.world_sizes)
        print(f"hand-off round trip between two cores: {limits['handoff_round_trip_us']:.2f} us")
    rows = []
    if args.hosts == 2:
        netem = {"rate_mbit": args.netem_rate_mbit, "delay_ms": args.netem_delay_ms}
        for per_host in args.ranks_per_host:
            results = run_on_two_hosts(per_host, args.ops, sizes, args.repeats, netem)
            if args.netem_rate_mbit:
                for entry in results:
                    entry["shaped_rate_mbit"] = args.netem_rate_mbit
            rows.extend(summarize(entry, memcpy) for entry in results)
    for world in (args.world_sizes if args.hosts == 1 else []):
        results = run_ranks(world, _worker, args.ops, sizes, args.repeats, args.pin_ranks)
        rows.extend(summarize(entry, memcpy, limits) for entry in results)
    if args.hosts == 2:
        print_link_table(rows)
        misses = link_targets(rows)
        print("\ntargets (>= 50 % of the link at 1 MiB, >= 80 % from 16 MiB, never slower than "
              "gloo): " + ("all met" if not misses else f"{len(misses)} missed"))
        for line in misses:
            print("  missed: " + line)
    else:
        print_table(rows)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"rows": rows, "memcpy_GBps": memcpy, "repeats": args.repeats,
                   "limits": limits}, f, indent=1)
    png = os.path.splitext(args.output)[0] + ".png"
    where = "on one host (2 cores)" if args.hosts == 1 else \
        "across 2 emulated hosts (veth + TCP" + (", netem" if args.netem_rate_mbit or
                                                  args.netem_delay_ms else "") + ")"
    plot(rows, memcpy, png, where, limits)
    print(f"\nwrote {args.output} and {png}")


if __name__ == "__main__":
    main()
