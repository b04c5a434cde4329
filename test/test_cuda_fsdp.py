"""fully_shard on CUDA meshes (issue 35): ours against upstream's, bit for bit.

Both run in the same worker process from the same weights and batches, 10
steps with Adam, and their losses and final parameters must be equal:
- over NCCL at world size 1 (NCCL refuses two ranks on one GPU);
- over fsdp_ext at world size 2, the two ranks sharing the one GPU (the CUDA
  path's IPC route); fp32, bf16 mixed precision, gradient accumulation
  without sync, reshard_after_forward=False, set_post_optim_event, HSDP
  (also at world size 4, a 2 x 2 mesh), and with the side streams switched
  off (FSDP_EXT_FSDP_STREAMS=0, the debugging lever), and with the
  communication buffers from the process group (fsdp_ext's device buffers);
- the next group's all-gather overlapping the current group's compute, from
  a profiler trace (and not overlapping with the side streams off);
- the errors a CUDA mesh adds (a process group without a CUDA backend,
  parameters moved off the mesh's device, CPU offload, not supported yet).

The model avoids ops whose CUDA kernels are not deterministic (attention's
backward, embedding's): two runs of the same thing must be bitwise equal for
the comparison to mean anything, and deterministic algorithms are on.

Needs a CUDA GPU and a build with the CUDA parts; without either every test
here skips, saying which (test/gpu/run.sh runs them on the lent GPU machine).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conftest import REQUIRES_CUDA, get_pool

pytestmark = REQUIRES_CUDA

STEPS = 10
DIM = 64
# Deterministic cuBLAS (required by torch.use_deterministic_algorithms).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# Each call's limit, well inside the GPU script's step limit: a hang then
# ends in the harness, which prints every rank's stacks, not in the script's
# kill, which leaves only the log's last lines. A call takes a few seconds; a
# failure on one rank leaves its peers in a collective until this limit,
# which must not use up the step's share of the short GPU budget (the later
# tests would not run).
CALL_TIMEOUT = 30.0


def pool_of(world_size):
    """One pool per world size for the whole file (each start costs seconds
    of the GPU run): the side-streams lever is set per task (streams_off),
    since a root reads it at its lazy init."""
    return get_pool(world_size, **DETERMINISTIC_ENV)


def streams_off():
    """FSDP_EXT_FSDP_STREAMS=0 for the rest of this task (the harness
    restores the worker's environment after it)."""
    import os

    os.environ["FSDP_EXT_FSDP_STREAMS"] = "0"


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim + 1)  # 3 * 64 + 1 rows: uneven shards
        self.down = nn.Linear(3 * dim + 1, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """A root with parameters of its own, then blocks: each block one group."""

    def __init__(self, n_blocks=4, dim=DIM):
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.proj_in(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batch(rank, step, micro):
    """Host tensors: the root's pre-forward moves the input to the device."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(8, 16, DIM, generator=g)
    return x, torch.sin(x)


def cuda_mesh(ctx, kind):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if kind == "nccl":
        return DeviceMesh.from_group(dist.new_group(backend="nccl"), "cuda")
    if kind == "fsdp_ext":
        return init_device_mesh("cuda", (ctx.world_size,))
    if kind == "hsdp":
        return init_device_mesh("cuda", (2, ctx.world_size // 2),
                                mesh_dim_names=("replicate", "shard"))
    raise ValueError(kind)


def train(ctx, impl, mesh_kind, mixed_precision=False, accumulate=False, reshard=True,
          post_optim_event=False, from_group=False):
    """(losses, final full parameters on the host) of one implementation."""
    from fsdp_testing import fsdp_api

    torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True)
    api = fsdp_api(impl)
    mesh = cuda_mesh(ctx, mesh_kind)
    torch.manual_seed(0)
    model = Net().cuda()
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard}
    if mixed_precision:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32)
    for block in model.blocks:
        api.fully_shard(block, **kwargs)
    api.fully_shard(model, **kwargs)
    if from_group:
        # Each FSDP module's own groups (upstream's setter does not recurse).
        for module in model.modules():
            if isinstance(module, api.FSDPModule):
                module.set_allocate_memory_from_process_group_for_comm(True)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    micros = 2 if accumulate else 1
    for step in range(STEPS):
        for micro in range(micros):
            if accumulate:
                model.set_requires_gradient_sync(micro == micros - 1)
            x, y = batch(ctx.rank, step, micro)
            loss = F.mse_loss(model(x).float(), y.cuda())
            loss.backward()
            losses.append(loss.item())
        optim.step()
        if post_optim_event:
            # The next forward's all-gathers wait for this event, not for
            # the whole compute stream (FSDPModule.set_post_optim_event).
            event = torch.cuda.Event()
            event.record()
            model.set_post_optim_event(event)
        optim.zero_grad()
    torch.cuda.synchronize()
    params = [p.full_tensor().cpu() for p in model.parameters()]
    return losses, params


def differences(upstream, ours):
    """What differs between two train() results: empty if nothing."""
    problems = []
    if upstream[0] != ours[0]:
        problems.append(f"losses differ: upstream {upstream[0]} ours {ours[0]}")
    for i, (theirs, mine) in enumerate(zip(upstream[1], ours[1])):
        if not torch.equal(theirs, mine):
            problems.append(f"parameter {i} differs: max |diff| "
                            f"{(theirs.double() - mine.double()).abs().max().item():.3e}")
    return problems


def compare(ctx, mesh_kind, options=None, side_streams=True):
    """Upstream then ours in this worker: the differences, empty if none.
    `options`: train's keyword arguments; `side_streams` False: ours with
    FSDP_EXT_FSDP_STREAMS=0."""
    options = options or {}
    if not side_streams:
        streams_off()
    upstream = train(ctx, "upstream", mesh_kind, **options)
    ours = train(ctx, "ours", mesh_kind, **options)
    return differences(upstream, ours)


@pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch has no NCCL")
@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16"])
def test_nccl_world_size_one_matches_upstream(mixed_precision):
    (problems,) = pool_of(1).run(compare, "nccl", {"mixed_precision": mixed_precision},
                                 timeout=CALL_TIMEOUT)
    assert not problems, problems


# The matrix's corners at world size 2 over fsdp_ext (both ranks on the GPU).
@pytest.mark.parametrize("options", [
    {},
    {"mixed_precision": True},
    {"accumulate": True, "reshard": False, "post_optim_event": True},
], ids=["fp32", "bf16", "accumulate-no-reshard-post-optim-event"])
def test_fsdp_ext_world_size_two_matches_upstream(options):
    for rank, problems in enumerate(pool_of(2).run(compare, "fsdp_ext", options,
                                                   timeout=CALL_TIMEOUT)):
        assert not problems, (rank, problems)


# (2, 1): replicas of one rank each, only the all-reduce; (2, 2): the
# reduce-scatter, then the all-reduce on its own stream after it.
@pytest.mark.parametrize("world", [2, 4], ids=["mesh2x1", "mesh2x2"])
def test_hsdp_matches_upstream(world):
    for rank, problems in enumerate(pool_of(world).run(
            compare, "hsdp", {"mixed_precision": True}, timeout=CALL_TIMEOUT)):
        assert not problems, (rank, problems)


def test_without_side_streams_matches_upstream():
    """FSDP_EXT_FSDP_STREAMS=0 (everything on the compute stream) gives the
    same bits: the streams change when work runs, never what it computes."""
    for rank, problems in enumerate(pool_of(2).run(compare, "fsdp_ext", None, False,
                                                   timeout=CALL_TIMEOUT)):
        assert not problems, (rank, problems)


def check_buffers_from_the_group(ctx):
    """Upstream then ours with every group's communication buffers from the
    process group: the differences, and per implementation how many buffers
    it took from the group (its CUDA buffer counters) and how many ops were
    staged through host memory."""
    backend = dist.group.WORLD._get_backend(torch.device("cuda", 0))
    results, taken = [], []
    for impl in ("upstream", "ours"):
        before = backend._cuda_counters()
        results.append(train(ctx, impl, "fsdp_ext", from_group=True))
        after = backend._cuda_counters()
        taken.append((after["allocations"] - before["allocations"],
                      after["staged_ops"] - before["staged_ops"]))
    return differences(*results), taken


def test_buffers_from_the_group_match_upstream():
    """Both implementations take the all-gather outputs and reduce-scatter
    buffers from fsdp_ext (its device buffers, which the peer reads in
    place, none staged) and still agree bit for bit."""
    for rank, (problems, taken) in enumerate(pool_of(2).run(check_buffers_from_the_group,
                                                              timeout=CALL_TIMEOUT)):
        assert not problems, (rank, problems)
        for impl, (allocations, staged) in zip(("upstream", "ours"), taken):
            # Per step at least the 5 groups' forward all-gather outputs and
            # their reduce-scatter inputs.
            assert allocations >= STEPS * 10, (rank, impl, allocations)
            assert staged == 0, (rank, impl, staged)


def check_errors(ctx):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    from torch_fsdp_ext import fully_shard

    torch.cuda.set_device(0)
    messages = {}
    host_only = DeviceMesh.from_group(dist.new_group(backend="cpu:gloo"), "cuda")
    try:
        fully_shard(nn.Linear(4, 4), mesh=host_only)
    except ValueError as error:
        messages["no cuda backend"] = str(error)
    mesh = init_device_mesh("cuda", (ctx.world_size,))
    try:
        fully_shard(nn.Linear(4, 4), mesh=mesh, offload_policy=CPUOffloadPolicy())
    except NotImplementedError as error:
        messages["offload"] = str(error)
    # Sharded on the meta device, then materialised on the host instead of
    # the mesh's device.
    with torch.device("meta"):
        model = Net(n_blocks=1)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    try:
        model(torch.randn(2, DIM))
    except ValueError as error:
        messages["moved"] = str(error)
    return messages


def test_errors_name_the_module_and_what_was_wrong():
    for messages in pool_of(2).run(check_errors, timeout=CALL_TIMEOUT):
        assert "Linear" in messages["no cuda backend"], messages
        assert "no backend for cuda tensors" in messages["no cuda backend"], messages
        assert "CPUOffloadPolicy on a cuda mesh" in messages["offload"], messages
        assert "head.weight" in messages["moved"] and "'cpu'" in messages["moved"], messages


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_intervals(trace_file):
    """(category, name, stream, start us, end us) of every kernel and device
    copy in a profiler chrome trace."""
    import json

    with open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    return [(e["cat"], e["name"], e["args"].get("stream"), e["ts"], e["ts"] + e["dur"])
            for e in events if e.get("cat") in GPU_WORK and "dur" in e]


def overlap_with_compute(ctx, impl, trace_dir, side_streams=True):
    """One forward with a long kernel queued right after block 0's compute:
    the GPU work, as (category, name), that starts on another stream while
    it runs (block 1's copy-in and all-gather, if they overlap compute as
    upstream's do)."""
    import os

    from fsdp_testing import fsdp_api
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    if not side_streams:
        streams_off()
    torch.cuda.set_device(0)
    # The pool's earlier tasks (train) turned deterministic algorithms on;
    # timing wants none of their extra fills of fresh memory.
    torch.use_deterministic_algorithms(False)
    api = fsdp_api(impl)
    mesh = init_device_mesh("cuda", (ctx.world_size,))
    torch.manual_seed(0)
    model = Net(n_blocks=3).cuda()
    for block in model.blocks:
        api.fully_shard(block, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    x, _ = batch(ctx.rank, 0, 0)
    model(x).sum().backward()  # warm-up: lazy init, NCCL/IPC set-up
    torch.cuda.synchronize()
    # After FSDP's own post-forward hook of block 0: about 60 ms on an H100.
    model.blocks[0].register_forward_hook(lambda *_: torch.cuda._sleep(100_000_000))
    dist.barrier(group=ctx.gloo_group)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(x)
        torch.cuda.synchronize()
    trace = os.path.join(trace_dir, f"{impl}-{os.environ.get('FSDP_EXT_FSDP_STREAMS', '1')}-"
                                    f"rank{ctx.rank}.json")
    prof.export_chrome_trace(trace)
    intervals = gpu_intervals(trace)
    sleeps = [i for i in intervals if "sleep" in i[1].lower() or "spin" in i[1].lower()]
    assert len(sleeps) == 1, [i[1] for i in intervals]
    _, _, sleep_stream, start, end = sleeps[0]
    return sorted({(cat, name) for cat, name, stream, s, _ in intervals
                   if stream != sleep_stream and start < s < end})


@pytest.mark.parametrize("impl", ["upstream", "ours"])
def test_next_all_gather_overlaps_compute(impl, tmp_path):
    """Block 1's unshard runs on the all-gather streams while block 0's
    compute (a long kernel) still runs, for ours as for upstream's: its
    all-gather's copies among that work (device copies: the IPC route's
    reads of the peer, or the staged route's), not only its copy-in; with
    the side streams off nothing can, which shows the check can fail."""
    pool = pool_of(2)
    for rank, overlapped in enumerate(pool.run(overlap_with_compute, impl, str(tmp_path),
                                               timeout=CALL_TIMEOUT)):
        assert any(cat == "gpu_memcpy" for cat, _ in overlapped), (
            rank, "no all-gather copy ran beside the compute stream's long kernel; beside it:",
            overlapped)
    if impl == "ours":
        for rank, overlapped in enumerate(pool.run(overlap_with_compute, impl, str(tmp_path),
                                                   False, timeout=CALL_TIMEOUT)):
            assert not overlapped, (rank, "streams off, yet work overlapped", overlapped)
