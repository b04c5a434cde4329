"""`collectives.py --device cuda`: collectives on CUDA tensors, every rank on
the one GPU of the machine (the lent GPU machine has one), fsdp_ext against
gloo with the same CUDA tensors (where gloo has the op) in the same processes,
next to the card's device-to-device copy rate measured in the same run.

The copy limit of an op is the time a device-to-device copy would take to
move the memory traffic the op must cause on the GPU, all ranks together
(they share it; _gpu_bytes). %lim is that time over the op's median.
"""

import json
import statistics
import time

OPS = ["all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast"]


def _gpu_bytes(op, nbytes, world):
    """What the op costs the GPU's memory, as the bytes a copy would move in
    the same time (a copy of B bytes reads B and writes B): all ranks
    together, since they share the GPU."""
    if op == "all_gather_into_tensor":  # each rank writes its whole output
        return world * nbytes
    if op == "reduce_scatter_tensor":   # reads every input once, writes 1/world of it each
        return (world + 1) * nbytes / 2
    if op == "all_reduce":              # reduce the shares (world + 1), copy them out (2 (world - 1))
        return (3 * world - 1) * nbytes / 2
    return (world - 1) * nbytes         # broadcast: every other rank copies it


def measure_copy_rate():
    """Bytes a large device-to-device copy moves per second (counted once)."""
    import torch

    src = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 10 * src.numel() / (start.elapsed_time(end) / 1e3)


def _iterations(nbytes):
    return 200 if nbytes <= 1 << 20 else 50 if nbytes <= 16 << 20 else 10


def worker(rank, world, init_file, queue, ops, sizes, repeats):
    from _workers import init_rank

    gloo = init_rank(rank, world, init_file)
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    rows = []
    for op in ops:
        for nbytes in sizes:
            numel = max(world, nbytes // 4) // world * world
            full = torch.ones(numel, device=dev)
            part = torch.ones(numel // world, device=dev)

            def runner(group):
                if op == "all_gather_into_tensor":
                    return lambda: dist.all_gather_into_tensor(full, part, group=group)
                if op == "reduce_scatter_tensor":
                    return lambda: dist.reduce_scatter_tensor(part, full, group=group)
                if op == "all_reduce":
                    return lambda: dist.all_reduce(full, group=group)
                return lambda: dist.broadcast(full, src=0, group=group)

            samples = {}
            for name, group in (("fsdp_ext", dist.group.WORLD), ("gloo", gloo)):
                run = runner(group)
                try:
                    run()
                    torch.cuda.synchronize()
                except Exception as error:  # noqa: BLE001  (gloo lacks some CUDA ops)
                    samples[name] = f"{type(error).__name__}: {str(error)[:80]}"
                    continue
                iters = _iterations(nbytes) if name == "fsdp_ext" else max(3, _iterations(nbytes) // 10)
                times = []
                for _ in range(repeats):
                    dist.barrier(group=gloo)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(iters):
                        run()
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - start) / iters)
                t = torch.tensor(times, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
                samples[name] = t.tolist()
            if rank == 0:
                rows.append({"op": op, "world_size": world, "bytes": numel * 4, "seconds": samples})
    route = dist.group.WORLD._get_backend(dev).cuda_route
    if rank == 0:
        queue.put({"rows": rows, "route": route})
    dist.destroy_process_group()


def run(world_sizes, ops, sizes, repeats, output):
    import torch

    from _workers import run_ranks

    copy_rate = measure_copy_rate()
    print(f"device-to-device copy: {copy_rate / 1e9:.0f} GB/s (bytes copied, counted once), "
          f"{torch.cuda.get_device_name(0)}")
    rows = []
    for world in world_sizes:
        result = run_ranks(world, worker, [op for op in ops if op in OPS], sizes, repeats)
        print(f"world size {world}: {result['route']}")
        rows.extend(result["rows"])
    header = f"{'op':<24}{'ws':>3}{'size':>10}{'ours us':>11}{'gloo us':>11}{'x gloo':>8}{'%lim':>7}"
    print(header + "\n" + "-" * len(header))
    for row in rows:
        ours = statistics.median(row["seconds"]["fsdp_ext"])
        gloo = row["seconds"].get("gloo")
        gloo_us = statistics.median(gloo) * 1e6 if isinstance(gloo, list) else None
        limit = _gpu_bytes(row["op"], row["bytes"], row["world_size"]) / copy_rate
        row["limit_fraction"] = limit / ours
        size = row["bytes"]
        human = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB" if size >= 1 << 10 else f"{size} B"
        print(f"{row['op']:<24}{row['world_size']:>3}{human:>10}{ours * 1e6:>11.1f}"
              + (f"{gloo_us:>11.1f}{gloo_us / (ours * 1e6):>7.1f}x" if gloo_us else f"{'-':>11}{'-':>8}")
              + f"{100 * limit / ours:>6.0f}%")
    with open(output, "w") as f:
        json.dump({"rows": rows, "copy_Bps": copy_rate}, f, indent=1)
    print(f"wrote {output}")
