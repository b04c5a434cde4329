"""`fsdp_step.py --device cuda`: our fully_shard against upstream's on a CUDA
mesh, over the same backend and in the same processes (issue 35):

  world size 1: over NCCL (NCCL refuses two ranks on one GPU);
  world size 2: over fsdp_ext, both ranks on the one GPU (its IPC route).

Models:
  transformer    pre-norm blocks (SDPA attention, 4x MLP), dim 2048, 6 blocks,
                 about 300M parameters, batch 4 x 512 tokens
  small-blocks   48 blocks of two 512x512 Linears, batch 64: the runtime's
                 host time per group dominates the step

Contenders, one step each in turn: local (the model unsharded, no FSDP),
upstream, ours. Per contender, over the steps after the first third:
  step ms        median wall time of forward, backward and SGD step, the GPU
                 synchronised at its end;
  host ms        median wall time the host spends issuing forward and
                 backward (no synchronisation inside: what the host could
                 not hide if the GPU were faster);
  host us/group  (host ms - local's host ms) / FSDP groups, the host time the
                 runtime adds per group and step, ours and upstream's measured
                 the same way;
  peak MiB       torch.cuda.max_memory_allocated over the timed steps, each
                 contender alone (the others' models deleted first).
Losses of ours and upstream's are compared too (max difference).
"""

import gc
import json
import statistics
import time

MODELS = {
    "transformer": {"dim": 2048, "heads": 16, "blocks": 6, "batch": (4, 512)},
    "small-blocks": {"dim": 512, "blocks": 48, "batch": (64,)},
}


def _build(name, contender, mesh):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard as upstream_fully_shard

    import torch_fsdp_ext

    spec = MODELS[name]
    torch.manual_seed(0)

    class Attention(nn.Module):
        def __init__(self, dim, heads):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.proj = nn.Linear(dim, dim)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, s, d))

    class Block(nn.Module):
        def __init__(self, dim, heads):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.attn = Attention(dim, heads)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    dim = spec["dim"]
    if name == "transformer":
        blocks = [Block(dim, spec["heads"]) for _ in range(spec["blocks"])]
    else:
        blocks = [nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
                  for _ in range(spec["blocks"])]
    model = nn.Sequential(nn.Linear(dim, dim), *blocks).cuda()
    groups = 0
    if contender != "local":
        shard = torch_fsdp_ext.fully_shard if contender == "ours" else upstream_fully_shard
        for block in blocks + [model]:
            shard(block, mesh=mesh)
        groups = len(blocks) + 1
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    return model, groups, optim


def _worker(rank, world, init_file, queue, models, steps):
    # A failing rank reports at once (the parent stops the others), so that a
    # broken run costs seconds of the GPU machine's budget, not the step's limit.
    try:
        _measure(rank, world, init_file, queue, models, steps)
    except BaseException:
        import traceback

        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def _measure(rank, world, init_file, queue, models, steps):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _workers import init_rank

    gloo = init_rank(rank, world, init_file)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    torch.cuda.set_device(0)
    if world == 1:
        backend, mesh = "nccl", DeviceMesh.from_group(dist.new_group(backend="nccl"), "cuda")
    else:
        backend, mesh = "fsdp_ext", init_device_mesh("cuda", (world,))
    results = {}
    for name in models:
        spec = MODELS[name]
        row = {"backend": backend, "world_size": world}
        for contender in ("local", "upstream", "ours"):
            model, groups, optim = _build(name, contender, mesh)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step_s, host_s, losses = [], [], []
            for step in range(steps):
                g = torch.Generator().manual_seed(1000 * step + rank)
                x = torch.randn(*spec["batch"], spec["dim"], generator=g).cuda()
                dist.barrier(group=gloo)
                torch.cuda.synchronize()
                start = time.perf_counter()
                loss = model(x).float().pow(2).mean()
                loss.backward()
                issued = time.perf_counter()
                optim.step()
                optim.zero_grad()
                torch.cuda.synchronize()
                end = time.perf_counter()
                step_s.append(end - start)
                host_s.append(issued - start)
                losses.append(loss.item())
            steady = steps // 3
            row[contender] = {
                "step_ms": statistics.median(step_s[steady:]) * 1e3,
                "host_ms": statistics.median(host_s[steady:]) * 1e3,
                "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
                "groups": groups, "losses": losses,
                "params": sum(p.numel() for p in model.parameters()),
            }
            # An FSDP state and its module refer to each other: only the
            # collector frees them, and memory still held here would count in
            # the next contender's peak.
            del model, optim
            gc.collect()
            torch.cuda.empty_cache()
        results[name] = row
    if rank == 0:
        queue.put(("ok", results))
    dist.destroy_process_group()


def markdown(results):
    out = []
    for name, row in results.items():
        local = row["local"]
        out.append(f"\n{name}: {local['params'] / 1e6:.1f}M parameters, {row['ours']['groups']} "
                   f"FSDP groups, world size {row['world_size']} over {row['backend']}\n")
        out.append("| contender | step ms | host ms (fwd+bwd issue) | host us/group over local "
                   "| peak MiB | max loss diff vs upstream |")
        out.append("|---|---:|---:|---:|---:|---:|")
        for contender in ("local", "upstream", "ours"):
            r = row[contender]
            per_group = ""
            if r["groups"]:
                per_group = f"{(r['host_ms'] - local['host_ms']) / r['groups'] * 1e3:.1f}"
            diff = ""
            if contender == "ours":
                diff = f"{max(abs(a - b) for a, b in zip(r['losses'], row['upstream']['losses'])):.1e}"
            out.append(f"| {contender} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | {per_group} "
                       f"| {r['peak_mib']:.0f} | {diff} |")
        ours, up = row["ours"], row["upstream"]
        out.append(f"\nours / upstream: step {ours['step_ms'] / up['step_ms']:.2f}x, "
                   f"peak memory {ours['peak_mib'] / up['peak_mib']:.3f}x, host time per group "
                   f"{(ours['host_ms'] - local['host_ms']) / max(up['host_ms'] - local['host_ms'], 1e-9):.2f}x")
    return "\n".join(out)


def _run_ranks(world, models, steps):
    """Rank 0's results; the first rank's failure stops every rank."""
    import multiprocessing as mp
    import os
    import tempfile

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, world, init_file, queue, models, steps))
                 for r in range(world)]
        for p in procs:
            p.start()
        status, payload = queue.get(timeout=3600)
        if status != "ok":
            for p in procs:
                p.kill()
            raise SystemExit(f"the CUDA FSDP step benchmark failed on {payload}")
        for p in procs:
            p.join()
    return payload


def run(world_sizes, models, steps, output):
    runs = {}
    for world in world_sizes:
        runs[str(world)] = _run_ranks(world, models, steps)
        print(markdown(runs[str(world)]), flush=True)
    with open(output, "w") as f:
        json.dump(runs, f, indent=1)
    print(f"\nwrote {output}")
