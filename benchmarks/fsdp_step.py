"""FSDP2 training step: our fully_shard against upstream's, over gloo and
over fsdp_ext, in the same processes.

    python benchmarks/fsdp_step.py [--world-size 2] [--steps 40] [--models small-blocks,transformer]
                                   [--configs fp32,bf16] [--no-memory]
    python benchmarks/fsdp_step.py --world-size 4 --configs hsdp
    python benchmarks/fsdp_step.py --hosts 2 [--ranks-per-host 1] [--netem-rate-mbit 10000]
    python benchmarks/fsdp_step.py --device cuda [--world-sizes 1,2] [--steps 12]
    python benchmarks/fsdp_step.py --host-time [--world-sizes 1,2] [--models small-blocks]

Contenders (each trains its own copy of the same model, same seeds and data;
one step each in turn, so host noise hits all alike; --order blocked runs all
steps of one contender before the next):

  upstream/gloo, ours/gloo, upstream/fsdp_ext, ours/fsdp_ext
  .../fsdp_ext+alloc  with set_allocate_memory_from_process_group_for_comm(True):
            communication buffers from the group's shared-memory pool
  ours/fsdp_ext+alloc+per-param  and set_per_parameter_collectives(True): a
            coalesced all-gather into the parameters' own storage and a
            reduce-scatter reading the gradients in place (ours only)
  ours/fsdp_ext+alloc+per-param+host-shared  and set_host_shared_parameters():
            one copy of the unsharded parameters per host, no all-gather
  local     the same model unsharded, no FSDP and no communication: the
            compute every contender also does

Models:
  small-blocks   many small blocks (48 x two 64x64 Linears, batch 8), each its
                 own FSDP group: runtime overhead dominates the step
  transformer    examples/tiny_transformer.py, dim 512, 4 layers (12.9M params)

Configurations (--configs):
  fp32   full precision, 1-D mesh (FSDP)
  bf16   MixedPrecisionPolicy(param_dtype=bfloat16): all-gathers and
         reduce-scatters in bf16 (half the bytes), fp32 sharded parameters
  hsdp   fp32 on a 2-D mesh (2 replicas x world/2 shards): reduce-scatter
         within a replica, all-reduce across (world size 4 or more, even)

Reported per contender: the median step time (forward, backward, SGD step;
each step the slowest rank, steps after the first third); "FSDP ms per group"
= (step - local step) / groups, the time FSDP adds per group per step
(runtime plus communication; at world size 1 only runtime); and the peak
memory training adds to the built, sharded model (VmHWM over the first 4 steps
minus VmRSS before them; each contender alone in fresh processes; rank 0): what
the process really holds, allocator caching included; and per rank, RSS and
PSS (proportional set size: shared pages divided among the processes that map
them) sampled at the start of every FSDP module's forward, parameters
unsharded, over the same steps, minus their values before: the host's sum of
PSS is what the host holds, counted once. "max loss diff": over
all steps, ours against upstream on the same backend, upstream against
upstream/gloo.

--hosts 2 runs the ranks on two emulated hosts (test/multihost.py, root),
so every collective crosses TCP, with the contenders that make sense across
hosts (upstream/gloo, ours/gloo, upstream/fsdp_ext, ours/fsdp_ext,
ours/fsdp_ext+per-param+host-shared) and no memory runs. It also measures the link in the same run (plain TCP both ways
at once, best of 3 rounds, before and after) and reports the link's lower
bound for the step: the bytes an FSDP step must move across it in each
direction (the other host's share of every all-gather and reduce-scatter
upstream/gloo issues) over what TCP carried, or the local step if that is
longer, since a step can overlap its communication with compute but not
beat either. Each contender's own bytes across the link are reported too:
host-shared parameters send the other host only what changed, so their
backward sends no parameters and can beat that bound.
"""

import argparse
import json
import os
import statistics
import sys
import time

from _workers import init_rank, init_torchrun_rank, run_on_two_hosts, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

CONTENDERS = ["upstream/gloo", "ours/gloo", "upstream/fsdp_ext", "ours/fsdp_ext",
              "upstream/fsdp_ext+alloc", "ours/fsdp_ext+alloc", "ours/fsdp_ext+alloc+per-param",
              "ours/fsdp_ext+alloc+per-param+host-shared"]


def _upstream_of(name):
    """The upstream contender an "ours/..." one is compared with (per-param
    is ours only: upstream with the same buffers)."""
    return "upstream/" + name.split("/")[1].replace("+per-param", "").replace("+host-shared", "")


# Across hosts: group buffers need shared memory, which one rank per host
# does not have. Host-shared parameters work across hosts (a copy per host,
# the other host's shards received straight into it).
CONTENDERS_ACROSS_HOSTS = ["upstream/gloo", "ours/gloo", "upstream/fsdp_ext", "ours/fsdp_ext",
                           "ours/fsdp_ext+per-param+host-shared"]

CONFIGS = ("fp32", "bf16", "hsdp")


def _mesh(contender_backend, config, gloo):
    """The contender's mesh: its backend's world (1-D) or a 2x(world/2) HSDP mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if config != "hsdp":
        group = gloo if contender_backend == "gloo" else dist.group.WORLD
        return DeviceMesh.from_group(group, "cpu")
    world = dist.get_world_size()
    override = {0: "gloo", 1: "gloo"} if contender_backend == "gloo" else None
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"),
                            backend_override=override)


def build(model_name, contender, gloo, config="fp32", optimizer=True):
    """(model, number of FSDP groups, step function(step, rank) -> loss).
    optimizer=False: the step is forward and backward only (gradients are
    dropped after it), the host-time view's step."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as upstream_fully_shard

    import torch_fsdp_ext
    from tiny_transformer import TinyTransformer, batch_for

    torch.manual_seed(0)
    if model_name == "small-blocks":
        model = nn.Sequential(*[
            nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)) for _ in range(48)
        ])
        blocks = list(model)

        def data(step, rank):
            g = torch.Generator().manual_seed(1000 * step + rank)
            return torch.randn(8, 64, generator=g), None

        def loss_fn(out, _):
            return out.float().pow(2).mean()
    else:
        model = TinyTransformer(dim=512, heads=8, layers=4)
        blocks = list(model.blocks)

        def data(step, rank):
            return batch_for(rank, step, batch=1, seq=16)

        def loss_fn(out, targets):
            return F.cross_entropy(out.float().flatten(0, 1), targets.flatten())

    groups = 0
    if contender != "local":
        impl, backend = contender.split("/")
        fully_shard = torch_fsdp_ext.fully_shard if impl == "ours" else upstream_fully_shard
        mesh = _mesh(backend.split("+")[0], config, gloo)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if config == "bf16" else None)
        for block in blocks + [model]:
            fully_shard(block, mesh=mesh, mp_policy=mp)
            if "+alloc" in backend:
                block.set_allocate_memory_from_process_group_for_comm(True)
            if "+per-param" in backend:
                block.set_per_parameter_collectives(True, recurse=False)
        if "+host-shared" in backend:
            model.set_host_shared_parameters()
        groups = len(blocks) + 1
    optim = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(index, rank):
        inputs, targets = data(index, rank)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        start = time.perf_counter()
        if optimizer:
            optim.step()
        optim.zero_grad()
        # The optimizer's share of the step (DTensor parameters for FSDP).
        step.optimizer_seconds.append(time.perf_counter() - start)
        return loss.item()

    step.optimizer_seconds = []

    return model, groups, step


HOST_TIME_CONTENDERS = ["upstream/fsdp_ext", "ours/fsdp_ext"]


def _host_time_worker(rank, world, init_file, queue, args):
    """--host-time: forward and backward only, local against ours and
    upstream's over fsdp_ext, one step each in turn."""
    gloo = init_rank(rank, world, init_file, args.pin_ranks)
    _quiet_upstream_view_warning()
    import torch
    import torch.distributed as dist

    results = {}
    for model_name in args.models:
        names = ["local"] + HOST_TIME_CONTENDERS
        built = {n: build(model_name, n, gloo, "fp32", optimizer=False) for n in names}
        times = {n: [] for n in names}
        for index in range(args.steps):
            for name in names:
                dist.barrier(group=gloo)
                start = time.perf_counter()
                built[name][2](index, rank)
                times[name].append(time.perf_counter() - start)
        for name in names:
            t = torch.tensor(times[name], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
            times[name] = t.tolist()
        results[model_name] = {"times": times,
                               "groups": {n: built[n][1] for n in names}}
        del built
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def host_time_table(results, world, steps):
    """The host-time view: per group and step, the time each runtime adds to
    the local step (forward and backward; at world size 1 nothing is
    communicated, so all of it is host time)."""
    steady = steps // 3
    out = [f"\nHost time per FSDP group, forward + backward, world size {world} over fsdp_ext "
           f"(median of steps {steady}..{steps - 1}):\n",
           "| model | groups | local ms | upstream ms | ours ms | ours / local | "
           "upstream us/group | ours us/group | ours / upstream per group |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model_name, result in results.items():
        med = {n: statistics.median(t[steady:]) for n, t in result["times"].items()}
        groups = result["groups"]["ours/fsdp_ext"]
        per_group = {n: (med[n] - med["local"]) / groups * 1e6 for n in HOST_TIME_CONTENDERS}
        up, ours = per_group["upstream/fsdp_ext"], per_group["ours/fsdp_ext"]
        out.append(f"| {model_name} | {groups} | {med['local'] * 1e3:.2f} | "
                   f"{med['upstream/fsdp_ext'] * 1e3:.2f} | {med['ours/fsdp_ext'] * 1e3:.2f} | "
                   f"{med['ours/fsdp_ext'] / med['local']:.2f}x | {up:.0f} | {ours:.0f} | "
                   f"{ours / up:.2f} |")
    return "\n".join(out)


def _quiet_upstream_view_warning():
    import warnings

    # Upstream warns on every step that the transformer returns a view.
    warnings.filterwarnings("ignore", message=".*returned a view tensor")


def _timing_worker(rank, world, init_file, queue, args):
    gloo = init_rank(rank, world, init_file, args.pin_ranks)
    results = _time_contenders(rank, world, gloo, args, CONTENDERS)
    if rank == 0:
        queue.put(results)
    import torch.distributed as dist

    dist.destroy_process_group()


def _torchrun_worker(args):
    """One rank of a --hosts 2 run; rank 0 writes the results to the file."""
    import torch.distributed as dist

    gloo = init_torchrun_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = _time_contenders(rank, world, gloo, args, CONTENDERS_ACROSS_HOSTS)
    if rank == 0:
        with open(args.torchrun_worker, "w") as f:
            json.dump({"results": results, "world_size": world}, f)
    dist.destroy_process_group()


def _time_contenders(rank, world, gloo, args, contenders):
    _quiet_upstream_view_warning()
    import torch
    import torch.distributed as dist

    results = {}
    for model_name, config in [(m, c) for c in args.configs for m in args.models]:
        names = ["local"] + contenders
        built = {name: build(model_name, name, gloo, config) for name in names}
        times = {name: [] for name in names}
        losses = {name: [] for name in names}
        if args.order == "alternate":  # one step of each contender in turn
            schedule = [(index, name) for index in range(args.steps) for name in names]
        else:  # "blocked": every step of one contender, then the next
            schedule = [(index, name) for name in names for index in range(args.steps)]
        for index, name in schedule:
            _, _, step = built[name]
            dist.barrier(group=gloo)
            start = time.perf_counter()
            losses[name].append(step(index, rank))
            times[name].append(time.perf_counter() - start)
        optimizer_times = {}
        for name in names:
            t = torch.tensor(times[name], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
            times[name] = t.tolist()
            t = torch.tensor(built[name][2].optimizer_seconds, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
            optimizer_times[name] = t.tolist()
        # One more, untimed step per contender, counting the bytes its
        # collectives move (bf16 halves them).
        comm_mib, crossing_mib = {}, {}
        for name in names:
            _, _, step = built[name]
            with _CollectiveBytes() as counted:
                step(args.steps, rank)
            comm_mib[name] = counted.bytes / 2**20
            crossing_mib[name] = counted.crossing_bytes / 2**20
        results[f"{model_name} {config}"] = {
            "model": model_name, "config": config, "times": times,
            "optimizer_times": optimizer_times, "losses": losses,
            "comm_mib": comm_mib, "crossing_mib": crossing_mib,
            "groups": {name: built[name][1] for name in names},
            "params": sum(p.numel() for p in built["local"][0].parameters()),
        }
        del built
    return results


class _CollectiveBytes:
    """Sums, over the c10d ops dispatched inside the block, the bytes of each
    one's largest tensor (the gathered output, the reduce-scatter input, the
    all-reduced buffer, a point-to-point message): what one rank's
    collectives carry. And what crosses the link per direction between two
    hosts: the other host's half of each collective's tensor, every message
    a rank sends (host-shared parameters' column exchange), nothing for
    what it receives (the sender counts it)."""

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self
        counter.bytes = 0
        counter.crossing_bytes = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "c10d":
                    # A coalesced op's tensor lists count as their sums.
                    sizes = [sum(t.numel() * t.element_size() for t in tree_leaves(arg)
                                 if isinstance(t, torch.Tensor))
                             for arg in list(args) + list((kwargs or {}).values())]
                    size = max(sizes, default=0)
                    counter.bytes += size
                    op = func.__name__.split(".")[0]
                    if op.startswith("send"):
                        counter.crossing_bytes += size
                    elif not op.startswith("recv"):
                        counter.crossing_bytes += size / 2
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_worker(rank, world, init_file, queue, model_name, contender, config, pin):
    gloo = init_rank(rank, world, init_file, pin)
    _quiet_upstream_view_warning()
    import torch.distributed as dist

    model, _, step = build(model_name, contender, gloo, config)
    from torch.distributed.fsdp import FSDPModule

    samples = {"rss": 0, "pss": 0}

    def sample(*_):
        rss, pss = _rss_pss_kib()
        samples["rss"] = max(samples["rss"], rss)
        samples["pss"] = max(samples["pss"], pss)

    for module in model.modules():
        if isinstance(module, FSDPModule) or contender == "local" and module is model:
            module.register_forward_pre_hook(sample)  # after FSDP's: unsharded
    dist.barrier(group=gloo)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (peak RSS) to the current RSS
    base = _rss_kib("VmRSS")
    base_rss, base_pss = _rss_pss_kib()
    for index in range(4):
        step(index, rank)
    peak = _rss_kib("VmHWM")
    per_rank = [None] * world
    dist.all_gather_object(per_rank, ((samples["rss"] - base_rss) / 1024.0,
                                      (samples["pss"] - base_pss) / 1024.0), group=gloo)
    if rank == 0:
        queue.put({"peak_rss": (peak - base) / 1024.0, "rss_pss_by_rank": per_rank})
    dist.destroy_process_group()


def _rss_pss_kib():
    """(RSS, PSS) of this process now, KiB."""
    values = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("Rss", "Pss"):
                values[key] = int(line.split()[1])
    return values["Rss"], values["Pss"]


def markdown_tables(run):
    """The markdown tables of one run (its JSON), as docs/benchmarks.md shows them."""
    args = run["args"]
    steady = args["steps"] // 3
    out = []
    for key, result in run["results"].items():
        med = result["median_seconds"]
        # Runs before the per-rank samples stored the peak alone.
        memory = {name: m["peak_rss"] if isinstance(m, dict) else m
                  for name, m in result["peak_step_memory_mib"].items()}
        out.append(f"{key}: {result['params'] / 1e6:.2f}M parameters, "
                   f"{result['groups']['ours/gloo']} FSDP groups, {args['world_size']} ranks, "
                   f"median of steps {steady}..{args['steps'] - 1}\n")
        # The optimizer step (and zero_grad) of each contender, and the rest of
        # its step against local's rest (runs before this was timed have none).
        optimizer = {n: statistics.median(t[steady:])
                     for n, t in result.get("optimizer_times", {}).items()}
        out.append("| contender | step ms | ours vs upstream (same backend) | FSDP ms per group "
                   "| collective MiB/step | training peak MiB | max loss diff | optimizer ms "
                   "| without optimizer / local's |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name in med:
            speedup = ""
            if name.startswith("ours/"):
                other = _upstream_of(name)
                speedup = f"{med[other] / med[name]:.2f}x faster"
            per_group = ""
            if result["groups"][name]:
                per_group = f"{(med[name] - med['local']) / result['groups'][name] * 1e3:.3f}"
            mem = f"{memory[name]:.1f}" if name in memory else ""
            loss = "n/a"
            if name != "local":
                losses = result["losses"]
                other = _upstream_of(name) if name.startswith("ours/") else "upstream/gloo"
                loss = f"{max(abs(a - b) for a, b in zip(losses[name], losses[other])):.1e}"
            comm = result.get("comm_mib", {}).get(name)
            comm = "" if comm is None or name == "local" else f"{comm:.2f}"
            optim_ms = without = ""
            if name in optimizer and "local" in optimizer:
                optim_ms = f"{optimizer[name] * 1e3:.2f}"
                without = (f"{(med[name] - optimizer[name]) / (med['local'] - optimizer['local']):.2f}x")
            out.append(f"| {name} | {med[name] * 1e3:.2f} | {speedup} | {per_group} | {comm} "
                       f"| {mem} | {loss} | {optim_ms} | {without} |")
        out.append("")
        by_rank = {name: m["rss_pss_by_rank"] for name, m in result["peak_step_memory_mib"].items()
                   if isinstance(m, dict)}
        if by_rank:
            out.append("Per rank, MiB added at the start of an FSDP module's forward (largest "
                       "sample): RSS / PSS; the host's PSS is the sum over ranks.\n")
            out.append("| contender | " + " | ".join(f"rank {r} RSS / PSS" for r in
                                                   range(args["world_size"])) + " | host PSS |")
            out.append("|---|" + "---:|" * (args["world_size"] + 1))
            for name, ranks in by_rank.items():
                cells = " | ".join(f"{rss:.1f} / {pss:.1f}" for rss, pss in ranks)
                out.append(f"| {name} | {cells} | {sum(p for _, p in ranks):.1f} |")
            out.append("")
    return "\n".join(out)


def link_bound_table(results, link, rate_mbit):
    """Each contender's step against the link's lower bound for the step
    (--hosts 2): the bytes an FSDP step must move across the link (as
    upstream's over gloo moves them) at what TCP carried, or the local step
    if longer. A contender that moves fewer bytes (host-shared parameters
    send nothing twice) can beat it."""
    from _tcp_link import best

    both_ways = best(link, both_ways=True)
    out = [f"\nThe link ({'shaped to ' + str(rate_mbit) + ' Mbit/s' if rate_mbit else 'unshaped'})"
           f": plain TCP carried {both_ways:.2f} GB/s per direction with both directions busy "
           f"(best of the rounds before and after).\n",
           "| model | contender | step ms | MiB each rank's collectives carry | MiB it sends "
           "across the link | its link time ms | local step ms | the step's bound ms | "
           "step / bound |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def link_ms(mib):
        return mib * 2**20 / (both_ways * 1e9) * 1e3

    for key, result in results.items():
        med = result["median_seconds"]
        bound = max(link_ms(result["crossing_mib"]["upstream/gloo"]), med["local"] * 1e3)
        for name in med:
            if name == "local":
                continue
            crossing = result["crossing_mib"][name]
            out.append(f"| {key} | {name} | {med[name] * 1e3:.1f} | {result['comm_mib'][name]:.1f} "
                       f"| {crossing:.1f} | {link_ms(crossing):.1f} | {med['local'] * 1e3:.1f} | "
                       f"{bound:.1f} | {med[name] * 1e3 / bound:.2f}x |")
    return "\n".join(out)


def _default_output(args):
    name = "fsdp_step.json" if args.hosts == 1 else "fsdp_step_2hosts.json"
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--models", default="small-blocks,transformer")
    parser.add_argument("--configs", default="fp32",
                        help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--order", choices=["alternate", "blocked"], default="alternate",
                        help="alternate: one step per contender in turn (default; noise hits all "
                        "alike); blocked: all steps of a contender, then the next")
    parser.add_argument("--pin-ranks", action="store_true",
                        help="bind each rank (and its threads) to one core, every contender alike")
    parser.add_argument("--output", default=None)
    parser.add_argument("--hosts", type=int, choices=[1, 2], default=1)
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--netem-rate-mbit", type=int, default=None,
                        help="--hosts 2: shape the link between the hosts to this rate")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: ours vs upstream on a CUDA mesh, NCCL at world size 1 and "
                        "fsdp_ext at 2 on the one GPU (_cuda_fsdp_step.py; --world-sizes, "
                        "--models and --steps apply)")
    parser.add_argument("--world-sizes", default="1,2",
                        help="--device cuda and --host-time: comma-separated")
    parser.add_argument("--host-time", action="store_true",
                        help="the host-time view: forward + backward only, local, upstream and "
                        "ours over fsdp_ext, at each of --world-sizes")
    parser.add_argument("--torchrun-worker", metavar="RESULT_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda":
        import _cuda_fsdp_step

        output = args.output or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                             "results", "fsdp_step_cuda.json")
        os.makedirs(os.path.dirname(output), exist_ok=True)
        return _cuda_fsdp_step.run([int(w) for w in args.world_sizes.split(",")],
                                   args.models.split(","), args.steps, output)
    if args.output is None:
        args.output = _default_output(args)
    args.models = args.models.split(",")
    args.configs = args.configs.split(",")
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown --configs {unknown}; choose from {', '.join(CONFIGS)}")
    if args.hosts == 2 and "hsdp" in args.configs:
        parser.error("--hosts 2 measures the 1-D configurations (fp32, bf16); the link bound "
                     "it reports assumes all-gathers and reduce-scatters only")
    if args.hosts == 1 and "hsdp" in args.configs and (args.world_size < 4 or
                                                       args.world_size % 2):
        parser.error(f"--configs hsdp needs an even --world-size of at least 4, "
                     f"not {args.world_size}")
    if args.torchrun_worker:
        return _torchrun_worker(args)
    if args.host_time:
        runs = {}
        for world in (int(w) for w in args.world_sizes.split(",")):
            runs[world] = run_ranks(world, _host_time_worker, args)
            print(host_time_table(runs[world], world, args.steps), flush=True)
        output = args.output if args.output != _default_output(args) else os.path.join(
            os.path.dirname(args.output), "fsdp_step_host_time.json")
        os.makedirs(os.path.dirname(output), exist_ok=True)
        with open(output, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
        print(f"\nwrote {output}")
        return
    link = None
    if args.hosts == 2:
        ran, link = run_on_two_hosts(__file__, sys.argv[1:], args.ranks_per_host,
                                     args.netem_rate_mbit)
        results, args.world_size, args.no_memory = ran["results"], ran["world_size"], True
    else:
        results = run_ranks(args.world_size, _timing_worker, args)
    steady = args.steps // 3
    for result in results.values():
        result["median_seconds"] = {
            n: statistics.median(t[steady:]) for n, t in result["times"].items()
        }
        memory = {}
        if not args.no_memory:
            for name in ["local"] + CONTENDERS:
                memory[name] = run_ranks(args.world_size, _memory_worker, result["model"], name,
                                         result["config"], args.pin_ranks)
        result["peak_step_memory_mib"] = memory
    print(markdown_tables({"args": vars(args), "results": results}))
    if link is not None:
        print(link_bound_table(results, link, args.netem_rate_mbit))
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "results": results, "link_GBps": link}, f, indent=1)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
