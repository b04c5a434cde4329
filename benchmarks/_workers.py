"""Process plumbing shared by the benchmarks: one spawned process per rank,
an fsdp_ext default group plus a gloo group over the same ranks, and rank 0's
result handed back to the parent."""

import datetime
import multiprocessing as mp
import os
import tempfile


def pin_to_core(rank):
    """Binds this process to one core, rank modulo the cores it may use: the
    threads it starts later (fsdp_ext's progress thread, gloo's workers)
    inherit the binding, so a rank's threads share its core."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def init_rank(rank, world, init_file, pin=False):
    """Sets up one rank; returns the gloo group (fsdp_ext is the default group).
    `pin`: bind the rank to one core first (pin_to_core)."""
    if pin:
        pin_to_core(rank)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_TLS", "self,sm,tcp")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    import torch
    import torch.distributed as dist

    import torch_fsdp_ext  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group("fsdp_ext", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=10))
    return dist.new_group(backend="gloo")


def run_ranks(world, target, *args):
    """Runs target(rank, world, init_file, queue, *args) on every rank and
    returns what rank 0 put on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=target, args=(r, world, init_file, queue, *args))
                 for r in range(world)]
        for p in procs:
            p.start()
        result = queue.get(timeout=3600)
        for p in procs:
            p.join()
    return result


def init_torchrun_rank():
    """Sets up one rank started by torchrun (a --hosts 2 run); returns the gloo
    group (fsdp_ext is the default group)."""
    import torch
    import torch.distributed as dist

    import torch_fsdp_ext  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group("fsdp_ext", timeout=datetime.timedelta(minutes=10))
    return dist.new_group(backend="gloo")


def run_on_two_hosts(script, argv, ranks_per_host=1, rate_mbit=None, delay_ms=None):
    """Runs `script argv --torchrun-worker FILE` under torchrun on two emulated
    hosts (test/multihost.py), with the link shaped to `rate_mbit` / `delay_ms`
    if given; returns (what rank 0 wrote to FILE as JSON, the link's limits measured
    around the job: _tcp_link.measure_link_limits)."""
    import json
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "test"))
    import multihost
    from _tcp_link import measure_link_limits

    with tempfile.TemporaryDirectory() as tmp, multihost.TwoHosts(rate_mbit=rate_mbit,
                                                                    delay_ms=delay_ms) as hosts:
        result_file = os.path.join(tmp, "result.json")
        before = measure_link_limits(hosts, ranks_per_host)
        out = hosts.torchrun(os.path.abspath(script), [*argv, "--torchrun-worker", result_file],
                             ranks_per_host, timeout=3600)
        if not os.path.exists(result_file):
            raise SystemExit("the two-host run failed:\n" + "\n".join(h.output[-4000:]
                                                                       for h in out))
        after = measure_link_limits(hosts, ranks_per_host)
        with open(result_file) as f:
            return json.load(f), {key: max(before[key], after[key]) for key in before}
