"""Collective latency and bandwidth: fsdp_ext against gloo in the same run.

    python benchmarks/collectives.py [--world-sizes 2 4] [--max-bytes 64M] [--repeats 5]

For every op and message size, both backends run in the same processes
(fsdp_ext as the default group, gloo as a second group over the same ranks),
alternating, so host noise hits both alike. Reports the median of the
repeats, the algorithm bandwidth (bytes / time), the bus bandwidth (the
bytes each rank must move, nccl-tests' convention) and the ratio to gloo;
single-core memcpy bandwidth is the physical reference. Writes JSON to
benchmarks/results/collectives.json.
"""

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time

from torch_fsdp_ext import _C

OPS = ["all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast"]


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def human(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def sizes_up_to(max_bytes):
    sizes, size = [], 4
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def iterations_for(nbytes):
    if nbytes <= 64 << 10:
        return 200
    if nbytes <= 1 << 20:
        return 40
    if nbytes <= 16 << 20:
        return 8
    return 3


def bus_factor(op, n):
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return (n - 1) / n
    return 1.0


def _worker(rank, world, init_file, sizes, repeats, queue):
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_TLS", "self,sm,tcp")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    import torch
    import torch.distributed as dist

    import torch_fsdp_ext  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("fsdp_ext", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=10))
    groups = {"fsdp_ext": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    results = []
    for op in OPS:
        for nbytes in sizes:
            # nbytes is the message size: the gathered output of all_gather,
            # the input of reduce_scatter, the buffer of all_reduce/broadcast.
            numel = max(world, nbytes // 4) // world * world
            full = torch.ones(numel)
            part = torch.ones(numel // world)
            iters = iterations_for(nbytes)

            def run(group):
                if op == "all_gather_into_tensor":
                    dist.all_gather_into_tensor(full, part, group=group)
                elif op == "reduce_scatter_tensor":
                    dist.reduce_scatter_tensor(part, full, group=group)
                elif op == "all_reduce":
                    dist.all_reduce(full, group=group)
                else:
                    dist.broadcast(full, src=0, group=group)

            samples = {name: [] for name in groups}
            for name, group in groups.items():
                run(group)  # warm-up (connections, scratch memory)
            for _ in range(repeats):
                for name, group in groups.items():
                    dist.barrier(group=group)
                    start = time.perf_counter()
                    for _ in range(iters):
                        run(group)
                    samples[name].append((time.perf_counter() - start) / iters)
            # The op is as slow as its slowest rank: take the max over ranks.
            for name in groups:
                t = torch.tensor(samples[name], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups["gloo"])
                samples[name] = t.tolist()
            if rank == 0:
                results.append({"op": op, "bytes": numel * 4, "world_size": world,
                                "seconds": samples})
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-bytes", type=parse_size, default=64 << 20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results",
                                                           "collectives.json"))
    args = parser.parse_args()
    sizes = sizes_up_to(args.max_bytes)
    memcpy = measure_memcpy(sizes)
    rows = []
    for world in args.world_sizes:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "init"), sizes,
                                                       args.repeats, queue)) for r in range(world)]
            for p in procs:
                p.start()
            results = queue.get(timeout=3600)
            for p in procs:
                p.join()
        for entry in results:
            n, nbytes = entry["world_size"], entry["bytes"]
            med = {k: statistics.median(v) for k, v in entry["seconds"].items()}
            worst = max(entry["seconds"]["fsdp_ext"])
            row = {
                "op": entry["op"], "world_size": n, "bytes": nbytes,
                "algorithm": _C._selected_algorithm(entry["op"], nbytes, n),
                "fsdp_ext_us": med["fsdp_ext"] * 1e6, "gloo_us": med["gloo"] * 1e6,
                "fsdp_ext_worst_over_median": worst / med["fsdp_ext"],
                "fsdp_ext_busbw_GBps": nbytes * bus_factor(entry["op"], n) / med["fsdp_ext"] / 1e9,
                "gloo_busbw_GBps": nbytes * bus_factor(entry["op"], n) / med["gloo"] / 1e9,
                "speedup_vs_gloo": med["gloo"] / med["fsdp_ext"],
                "memcpy_GBps": memcpy[min(memcpy, key=lambda s: abs(s - nbytes))],
            }
            rows.append(row)
    header = (f"{'op':<24}{'ws':>3}{'size':>10}  {'algo':<7}{'fsdp_ext us':>12}{'gloo us':>11}"
              f"{'speedup':>9}{'busbw GB/s':>11}{'gloo busbw':>11}{'memcpy':>8}{'worst/med':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['op']:<24}{r['world_size']:>3}{human(r['bytes']):>10}  {r['algorithm']:<7}"
              f"{r['fsdp_ext_us']:>12.1f}{r['gloo_us']:>11.1f}{r['speedup_vs_gloo']:>8.1f}x"
              f"{r['fsdp_ext_busbw_GBps']:>11.2f}{r['gloo_busbw_GBps']:>11.2f}{r['memcpy_GBps']:>8.1f}"
              f"{r['fsdp_ext_worst_over_median']:>10.2f}")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"rows": rows, "memcpy_GBps": memcpy, "repeats": args.repeats}, f, indent=1)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
