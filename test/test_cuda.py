"""CUDA tensors through fsdp_ext (csrc/backend/cuda, csrc/device).

Ranks share the one GPU of the machine (as on the lent GPU machine: NCCL
refuses two ranks on one GPU, so this is how several ranks run there), on each
route of the group's CUDA path forced in turn (FSDP_EXT_CUDA_PATH): ``ipc``
(peers' buffers read in place), ``staged`` (through host memory), and
``auto``; NCCL at world size 1. Every op is checked against a reference
computed on the CPU from closed-form inputs (value = f(rank, index)), at
awkward sizes (0, 1, 3, 8191 and a few MiB), for every dtype the op takes.
Then the stream contract (an op waits for the caller's stream; ``wait()``
orders the caller's stream, not the host), coalesced ops, buffers from the
group (read in place, reused in stream order), and bad input.

Needs a CUDA GPU and a build with the CUDA parts; without either every test
here skips, saying which (test/gpu/run.sh runs them on the lent GPU machine).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import torch_fsdp_ext

from conftest import REQUIRES_CUDA, get_pool

pytestmark = REQUIRES_CUDA

# Each call's limit, well inside the GPU script's step limit: a hang then
# ends in the harness, which prints every rank's stacks, not in the script's
# kill, which leaves only the log's last lines.
CALL_TIMEOUT = 60.0
SIZES = [0, 1, 3, 8191, 3 << 18]  # the last: 786432 elements, 3 MiB of fp32
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.bool]


def values(rank, n, dtype, device="cpu"):
    """Rank `rank`'s input: small integers, exact in every dtype's sums of 4."""
    i = torch.arange(n, dtype=torch.int64)
    v = (i * 7 + rank * 3) % 17 - 8
    if dtype == torch.bool:
        return ((i + rank) % 3 == 0).to(device)
    if dtype == torch.uint8:
        v = v + 8
    return v.to(dtype).to(device)


def reference(op, inputs, dtype, world):
    """The expected result from every rank's CPU input, in float64 (or int64)."""
    wide = [t.to(torch.float64 if dtype.is_floating_point else torch.int64) for t in inputs]
    stacked = torch.stack(wide)
    if dtype == torch.bool:
        return {"sum": stacked.amax(0), "max": stacked.amax(0), "min": stacked.amin(0),
                "product": stacked.amin(0)}[op].to(torch.bool)
    out = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0),
           "product": stacked.prod(0), "avg": stacked.sum(0) / world}[op]
    return out.to(dtype)


def close(actual, expected, op):
    if op in ("avg", "premul") and actual.dtype.is_floating_point:
        tolerance = 1e-2 if actual.dtype in (torch.float16, torch.bfloat16) else 1e-6
        return torch.allclose(actual.double(), expected.double(), rtol=tolerance, atol=tolerance)
    return torch.equal(actual, expected)


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
              "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.AVG}


def reductions(dtype):
    """The reduce ops each dtype gets checked with (every dtype: SUM)."""
    if dtype == torch.bool:
        return ["sum", "min"]
    ops = ["sum", "max"]
    if dtype.is_floating_point:
        ops.append("avg")
    if dtype == torch.int64:
        ops.append("product")
    return ops


def check_every_op(ctx):
    """Each op x dtype x size against the CPU reference; returns the
    failures (empty when all is right) and the group's CUDA route."""
    torch.cuda.set_device(0)
    rank, world = ctx.rank, ctx.world_size
    dev = torch.device("cuda", 0)
    failures = []

    def expect(what, ok):
        if not ok:
            failures.append(what)

    for dtype in DTYPES:
        for n in SIZES:
            mine = values(rank, n, dtype, dev)
            everyone = [values(r, n, dtype) for r in range(world)]
            # all_gather_into_tensor
            out = torch.full((world * n,), 1, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(out, mine)
            expect(f"all_gather_into_tensor {dtype} n={n}", torch.equal(out.cpu(), torch.cat(everyone)))
            # broadcast from the last rank
            t = mine.clone()
            dist.broadcast(t, src=world - 1)
            expect(f"broadcast {dtype} n={n}", torch.equal(t.cpu(), everyone[-1]))
            for op in reductions(dtype):
                # all_reduce (in place)
                t = mine.clone()
                dist.all_reduce(t, op=REDUCE_OPS[op])
                expect(f"all_reduce {op} {dtype} n={n}",
                       close(t.cpu(), reference(op, everyone, dtype, world), op))
                # reduce_scatter_tensor: every rank's input is world x n
                big = torch.cat([values(rank + 10 * k, n, dtype) for k in range(world)]).to(dev)
                out = torch.full((n,), 1, dtype=dtype, device=dev)
                dist.reduce_scatter_tensor(out, big, op=REDUCE_OPS[op])
                blocks = [values(r + 10 * rank, n, dtype) for r in range(world)]
                expect(f"reduce_scatter_tensor {op} {dtype} n={n}",
                       close(out.cpu(), reference(op, blocks, dtype, world), op))
    # PREMUL_SUM (what FSDP's reduce-scatter uses for its gradient divide).
    for dtype in (torch.float32, torch.bfloat16):
        n = 8191
        big = torch.cat([values(rank + 10 * k, n, dtype) for k in range(world)]).to(dev)
        out = torch.empty((n,), dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(out, big, op=dist._make_nccl_premul_sum(0.5))
        blocks = [values(r + 10 * rank, n, dtype).double() * 0.5 for r in range(world)]
        expect(f"reduce_scatter_tensor premul {dtype}",
               close(out.cpu(), torch.stack(blocks).sum(0).to(dtype), "premul"))
    backend = dist.group.WORLD._get_backend(dev)
    return failures, backend.cuda_route


def check_other_ops(ctx):
    """The ops the fast routes stage (all_to_all_single, the list forms,
    reduce), FSDP's in-place forms on views, send/recv refused off the NCCL
    route, and the coalesced ops."""
    torch.cuda.set_device(0)
    rank, world = ctx.rank, ctx.world_size
    dev = torch.device("cuda", 0)
    failures = []

    def expect(what, ok):
        if not ok:
            failures.append(what)

    n = 8191
    everyone = [values(r, n * world, torch.float32) for r in range(world)]
    out = torch.empty(n * world, device=dev)
    dist.all_to_all_single(out, everyone[rank].to(dev))
    expected = torch.cat([everyone[r][rank * n:(rank + 1) * n] for r in range(world)])
    expect("all_to_all_single", torch.equal(out.cpu(), expected))

    outs = [torch.empty(n, device=dev) for _ in range(world)]
    dist.all_gather(outs, values(rank, n, torch.float32, dev))
    expect("all_gather (list)", all(torch.equal(o.cpu(), values(r, n, torch.float32))
                                    for r, o in enumerate(outs)))

    out = torch.empty(n, device=dev)
    dist.reduce_scatter(out, [values(rank + 10 * k, n, torch.float32, dev) for k in range(world)])
    expect("reduce_scatter (list)",
           torch.equal(out.cpu(), reference("sum", [values(r + 10 * rank, n, torch.float32)
                                                    for r in range(world)], torch.float32, world)))

    t = values(rank, n, torch.int64, dev)
    dist.reduce(t, dst=0)
    if rank == 0:
        expect("reduce", torch.equal(t.cpu(), reference(
            "sum", [values(r, n, torch.int64) for r in range(world)], torch.int64, world)))

    # In place, as FSDP calls them: the input a view into the output (its
    # data pointer past its allocation's start), and an all-reduce on a view.
    out = torch.empty(n * world, device=dev)
    own = out.narrow(0, rank * n, n)
    own.copy_(values(rank, n, torch.float32, dev))
    dist.all_gather_into_tensor(out, own)
    expect("all_gather_into_tensor in place",
           torch.equal(out.cpu(), torch.cat([values(r, n, torch.float32) for r in range(world)])))
    padded = torch.zeros(n + 5, device=dev)
    view = padded.narrow(0, 5, n)
    view.copy_(values(rank, n, torch.float32, dev))
    dist.all_reduce(view)
    expect("all_reduce on a view", torch.equal(view.cpu(), reference(
        "sum", [values(r, n, torch.float32) for r in range(world)], torch.float32, world))
        and not padded[:5].any().item())

    # Point-to-point on ipc and staged routes: refused, clearly, on both ends
    # (only the NCCL route runs it), and the group goes on.
    if world > 1 and rank in (0, world - 1):
        try:
            if rank == 0:
                dist.send(values(7, n, torch.float32, dev), dst=world - 1)
            else:
                dist.recv(torch.empty(n, device=dev), src=0)
            expect("send/recv refused", False)
        except NotImplementedError as error:
            expect(f"send/recv refusal names the NCCL route: {error}", "NCCL route" in str(error))
    dist.all_reduce(torch.ones(1, device=dev))

    # Coalesced: the fast path of _coalescing_manager (one call for the batch).
    sizes = [1, 3, 8191]
    ins = [values(rank + s, s, torch.float32, dev) for s in sizes]
    outs = [torch.empty(world * s, device=dev) for s in sizes]
    with dist._coalescing_manager(device=dev, async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    expect("all_gather_into_tensor coalesced",
           all(torch.equal(o.cpu(), torch.cat([values(r + s, s, torch.float32) for r in range(world)]))
               for o, s in zip(outs, sizes)))
    tensors = [values(rank, s, torch.float32, dev) for s in sizes]
    with dist._coalescing_manager(device=dev, async_ops=True) as cm:
        for t in tensors:
            dist.all_reduce(t)
    cm.wait()
    expect("all_reduce coalesced",
           all(torch.equal(t.cpu(), reference("sum", [values(r, s, torch.float32) for r in range(world)],
                                              torch.float32, world)) for t, s in zip(tensors, sizes)))
    bigs = [torch.cat([values(rank + 10 * k, s, torch.float32) for k in range(world)]).to(dev)
            for s in sizes]
    outs = [torch.empty(s, device=dev) for s in sizes]
    with dist._coalescing_manager(device=dev, async_ops=True) as cm:
        for o, b in zip(outs, bigs):
            dist.reduce_scatter_tensor(o, b)
    cm.wait()
    expect("reduce_scatter_tensor coalesced",
           all(torch.equal(o.cpu(), reference("sum", [values(r + 10 * rank, s, torch.float32)
                                                      for r in range(world)], torch.float32, world))
               for o, s in zip(outs, sizes)))
    return failures


def check_stream_contract(ctx):
    """The op runs after what the caller's stream enqueued before it (a long
    sleep, then the fill), and wait() orders the caller's stream after the
    op with no host synchronisation: the result read on that stream is right."""
    torch.cuda.set_device(0)
    rank, world = ctx.rank, ctx.world_size
    dev = torch.device("cuda", 0)
    side = torch.cuda.Stream(dev)
    results = []
    with torch.cuda.stream(side):
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            x = torch.zeros(1 << 20, device=dev)
            torch.cuda._sleep(20_000_000)  # ~10 ms of device time before the fill
            x.fill_(rank + 1)
            if op == "all_reduce":
                work = dist.all_reduce(x, async_op=True)
                out, expected = x, world * (world + 1) / 2
            elif op == "all_gather":
                out = torch.empty(world * x.numel(), device=dev)
                work = dist.all_gather_into_tensor(out, x, async_op=True)
                expected = None
            else:
                out = torch.empty(x.numel() // world, device=dev)
                work = dist.reduce_scatter_tensor(out, x, async_op=True)
                expected = world * (world + 1) / 2
            work.wait()
            # Read on the side stream: ordered after the op by wait() alone.
            if expected is None:
                check = torch.stack([out[r * x.numel():(r + 1) * x.numel()].mean() for r in range(world)])
                results.append(torch.equal(check.cpu(), torch.arange(1, world + 1, dtype=torch.float32)))
            else:
                results.append(bool((out == expected).all().item()))
    return results


# The matrix's corners: each route at an even and an odd world size, the
# largest on IPC (the route with the most protocol), auto at both ends.
@pytest.mark.parametrize("world,route", [(1, "auto"), (2, "ipc"), (3, "ipc"), (4, "ipc"),
                                         (2, "staged"), (3, "staged"), (4, "auto")],
                         ids=lambda v: f"ws{v}" if isinstance(v, int) else v)
def test_every_op_against_cpu_reference(world, route):
    results = get_pool(world, FSDP_EXT_CUDA_PATH=route).run(check_every_op,
                                                              timeout=CALL_TIMEOUT)
    for rank, (failures, description) in enumerate(results):
        assert not failures, (rank, description, failures)
        if route != "auto":
            assert description.startswith(route), description
        elif world > 1:
            # Ranks sharing the one GPU: never NCCL.
            assert not description.startswith("nccl"), description


def reduce_scatter_bits(ctx):
    """Reduce-scatters of random fp32, bf16 and fp64 data (SUM, AVG and
    PREMUL_SUM) at awkward block sizes; the results on the host."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    results = []
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for block in (1, 3, 8191, 65536):
            g = torch.Generator().manual_seed(100 * ctx.rank + block)
            data = torch.randn(ctx.world_size * block, generator=g).to(dtype).to(dev)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist._make_nccl_premul_sum(0.37)):
                out = torch.empty(block, dtype=dtype, device=dev)
                dist.reduce_scatter_tensor(out, data, op=op)
                results.append(out.cpu())
    return results


def test_reduce_scatter_rounds_the_same_on_both_routes():
    """The IPC route's kernel sums a block as comm's CPU kernels on the
    staged route do (its owner's contribution first, then the others in rank
    order; PREMUL_SUM's scaling rounded before the add, not fused with it),
    so the two routes agree bit for bit, at 3 ranks where the order shows."""
    ipc = get_pool(3, FSDP_EXT_CUDA_PATH="ipc").run(reduce_scatter_bits, timeout=CALL_TIMEOUT)
    staged = get_pool(3, FSDP_EXT_CUDA_PATH="staged").run(reduce_scatter_bits,
                                                            timeout=CALL_TIMEOUT)
    for rank in range(3):
        for i, (a, b) in enumerate(zip(ipc[rank], staged[rank])):
            assert torch.equal(a, b), (rank, i, a.dtype, a.numel(), (a - b).abs().max().item())


@pytest.mark.parametrize("world", [2, 3], ids=lambda n: f"ws{n}")
@pytest.mark.parametrize("route", ["ipc", "staged"])
def test_other_and_coalesced_ops(world, route):
    pool = get_pool(world, FSDP_EXT_CUDA_PATH=route)
    for rank, failures in enumerate(pool.run(check_other_ops, timeout=CALL_TIMEOUT)):
        assert not failures, (rank, failures)


@pytest.mark.parametrize("route", ["ipc", "staged"])
def test_stream_contract(route):
    pool = get_pool(2, FSDP_EXT_CUDA_PATH=route)
    for rank, results in enumerate(pool.run(check_stream_contract, timeout=CALL_TIMEOUT)):
        assert results == [True, True, True], (rank, results)


# Buffers from the group (allocate_tensor on CUDA): peers open each once and
# read it in place, also under expandable segments, where torch's own memory
# has no IPC handle and an op on it is staged through host memory.
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def check_group_buffers_in_place(ctx):
    """20 rounds of all-gather (also in place, FSDP's form), reduce-scatter
    and all-reduce on buffers from the group, checked against the CPU
    reference; then one all-reduce on torch's memory. Returns the failures
    and the group's counters after round 1, after round 20, and after the
    op on torch's memory."""
    torch.cuda.set_device(0)
    rank, world = ctx.rank, ctx.world_size
    dev = torch.device("cuda", 0)
    backend = dist.group.WORLD._get_backend(dev)
    failures = []

    def expect(what, ok):
        if not ok:
            failures.append(what)

    # Offered before the group's first CUDA op (which chooses its route).
    expect("supports_tensor_alloc before the first op", backend.supports_tensor_alloc(dev))
    counters = []
    for round_ in range(20):
        for dtype in (torch.float32, torch.bfloat16):
            for n in (1, 3, 8191, 3 << 18):
                where = f"round {round_} {dtype} n={n}"
                inp = backend.allocate_tensor(n, dtype=dtype, device=dev)
                inp.copy_(values(rank, n, dtype, dev))
                out = backend.allocate_tensor(world * n, dtype=dtype, device=dev)
                dist.all_gather_into_tensor(out, inp)
                everyone = [values(r, n, dtype) for r in range(world)]
                expect(f"all_gather {where}", torch.equal(out.cpu(), torch.cat(everyone)))
                # In place: the input a view into the output, as FSDP calls it.
                out.zero_()
                own = out.narrow(0, rank * n, n)
                own.copy_(values(rank, n, dtype, dev))
                dist.all_gather_into_tensor(out, own)
                expect(f"all_gather in place {where}", torch.equal(out.cpu(), torch.cat(everyone)))
                big = backend.allocate_tensor(world * n, dtype=dtype, device=dev)
                big.copy_(torch.cat([values(rank + 10 * k, n, dtype) for k in range(world)]))
                shard = backend.allocate_tensor(n, dtype=dtype, device=dev)
                dist.reduce_scatter_tensor(shard, big)
                blocks = [values(r + 10 * rank, n, dtype) for r in range(world)]
                expect(f"reduce_scatter {where}",
                       torch.equal(shard.cpu(), reference("sum", blocks, dtype, world)))
                dist.all_reduce(inp)
                expect(f"all_reduce {where}",
                       torch.equal(inp.cpu(), reference("sum", everyone, dtype, world)))
                del inp, out, own, big, shard
                # The release fences pass before the next allocation (sizes
                # 1 and 3 share a size class): each class then holds the four
                # buffers live at once, made in round 0, whatever the timing.
                torch.cuda.synchronize()
        if round_ == 0:
            counters.append(backend._cuda_counters())
    counters.append(dict(backend._cuda_counters(), route=backend.cuda_route))
    expect(f"route reads in place: {backend.cuda_route}", backend.cuda_route.startswith("ipc"))
    expect("supports_tensor_alloc on the IPC route", backend.supports_tensor_alloc(dev))
    # torch's memory under expandable segments: no handle, the op is staged.
    t = values(rank, 8191, torch.float32, dev)
    dist.all_reduce(t)
    expect("all_reduce on torch's memory", torch.equal(
        t.cpu(), reference("sum", [values(r, 8191, torch.float32) for r in range(world)],
                           torch.float32, world)))
    counters.append(backend._cuda_counters())
    return failures, counters


# How the group's buffers are shared (FSDP_EXT_CUDA_IPC_HANDLES): legacy IPC
# handles, or file descriptors of cuMemCreate memory (where a machine refuses
# legacy handles; forced here, so that both run wherever one GPU is).
SHARING = {"legacy": "buffers shared by legacy IPC handles",
           "descriptors": "the group's own buffers shared as file descriptors"}


@pytest.mark.parametrize("handles", sorted(SHARING))
def test_group_buffers_are_read_in_place(handles):
    pool = get_pool(2, FSDP_EXT_CUDA_PATH="ipc", FSDP_EXT_CUDA_IPC_HANDLES=handles, **EXPANDABLE)
    for rank, (failures, (first, last, staged)) in enumerate(
            pool.run(check_group_buffers_in_place, timeout=CALL_TIMEOUT)):
        assert not failures, (rank, failures)
        assert SHARING[handles] in last["route"], (rank, last["route"])
        # Nothing staged, each peer buffer opened once: round 1 opened all
        # there are, the next 19 reused the same buffers.
        assert last["staged_ops"] == 0, (rank, last)
        assert last["peer_buffers_opened"] == first["peer_buffers_opened"] > 0, (rank, first, last)
        assert last["buffers"] == first["buffers"], (rank, first, last)
        assert last["buffers_exported"] == last["buffers"], (rank, last)
        assert last["reuses"] >= 19 * 2 * 4 * 4, (rank, last)  # rounds x dtypes x sizes x buffers
        assert last["buffers_in_use"] == 0, (rank, last)
        assert staged["staged_ops"] == 1, (rank, staged)


def check_fallback_to_descriptors(ctx):
    """A group whose ranks cannot make legacy IPC handles (refused here by the
    test hook, as some virtual machines refuse them) falls back to file
    descriptors: an all-reduce on torch's memory (set-up, then staged), then
    all-reduces on buffers from the group, one of them in the size class of
    the legacy probe's buffer, which must not be handed out again."""
    torch.cuda.set_device(0)
    rank, world = ctx.rank, ctx.world_size
    dev = torch.device("cuda", 0)
    torch_fsdp_ext._C._refuse_legacy_cuda_ipc_for_tests(True)
    try:
        group = dist.new_group()
        backend = group._get_backend(dev)
        first = torch.ones(4, device=dev)
        dist.all_reduce(first, group=group)
        right = [torch.equal(first.cpu(), torch.full((4,), float(world)))]
        for n in (1, 64, 8191):  # 64 floats: 256 bytes, the probe's size class
            buffer = backend.allocate_tensor(n, dtype=torch.float32, device=dev)
            buffer.copy_(values(rank, n, torch.float32, dev))
            dist.all_reduce(buffer, group=group)
            expected = reference("sum", [values(r, n, torch.float32) for r in range(world)],
                                 torch.float32, world)
            right.append(torch.equal(buffer.cpu(), expected))
        found = (backend.cuda_route, right, backend._cuda_counters())
        dist.destroy_process_group(group)
        return found
    finally:
        torch_fsdp_ext._C._refuse_legacy_cuda_ipc_for_tests(False)


def test_refused_legacy_handles_fall_back_to_descriptors():
    for rank, (route, right, counters) in enumerate(get_pool(2, FSDP_EXT_CUDA_PATH="auto").run(
            check_fallback_to_descriptors, timeout=CALL_TIMEOUT)):
        assert route.startswith("ipc") and SHARING["descriptors"] in route, (rank, route)
        assert "legacy IPC handles: rank 0: cudaIpcGetMemHandle refused a buffer of the group" \
            in route, (rank, route)
        assert all(right), (rank, right)
        # Only the op on torch's memory staged: the group's buffers were read
        # in place, also the one of the probe's size class.
        assert counters["staged_ops"] == 1, (rank, counters)
        assert counters["buffers_exported"] == counters["buffers"] - 1, (rank, counters)


def check_stream_ordered_reuse(ctx):
    """A freed buffer is handed out again at once on the stream it was used
    on, not on another while that stream's work on it is pending, and not
    while the group's stream still reads it (an op in flight)."""
    torch.cuda.set_device(0)
    rank, world = ctx.rank, ctx.world_size
    dev = torch.device("cuda", 0)
    backend = dist.group.WORLD._get_backend(dev)
    dist.all_reduce(torch.ones(1, device=dev))  # the route is chosen
    found = {}
    other = torch.cuda.Stream(dev)
    # 1. Freed with work pending on the current stream.
    x = backend.allocate_tensor(1 << 16, dtype=torch.float32, device=dev)
    address = x.data_ptr()
    torch.cuda._sleep(50_000_000)  # tens of ms of device time
    x.fill_(1.0)
    del x
    with torch.cuda.stream(other):
        y = backend.allocate_tensor(1 << 16, dtype=torch.float32, device=dev)
        found["another stream while pending"] = y.data_ptr() != address
    z = backend.allocate_tensor(1 << 16, dtype=torch.float32, device=dev)
    found["same stream at once"] = z.data_ptr() == address
    del y, z
    torch.cuda.synchronize()
    # 2. An op in flight on the group's stream reads the buffer after the
    # caller freed it: not handed out, on any stream, until it is done; the
    # op's result is right although the new buffer is written meanwhile.
    inp = backend.allocate_tensor(1 << 18, dtype=torch.float32, device=dev)
    address = inp.data_ptr()
    inp.fill_(rank + 1)
    out = torch.empty(world << 18, device=dev)
    torch.cuda._sleep(50_000_000)  # the op starts after this
    work = dist.all_gather_into_tensor(out, inp, async_op=True)
    del inp
    again = backend.allocate_tensor(1 << 18, dtype=torch.float32, device=dev)
    found["not while an op reads it"] = again.data_ptr() != address
    again.fill_(-1.0)
    work.wait()
    expected = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(1 << 18)
    found["the op's result"] = torch.equal(out.cpu(), expected)
    del again
    torch.cuda.synchronize()
    first = backend.allocate_tensor(1 << 18, dtype=torch.float32, device=dev)
    found["once the op is done"] = first.data_ptr() == address
    return found


def test_freed_buffers_are_reused_in_stream_order():
    for rank, found in enumerate(get_pool(2, FSDP_EXT_CUDA_PATH="ipc").run(
            check_stream_ordered_reuse, timeout=CALL_TIMEOUT)):
        assert all(found.values()), (rank, found)


def allocation_refusal(backend, dev):
    """What allocate_tensor raises on `dev` ("no error" when it allocates)."""
    try:
        backend.allocate_tensor(16, dtype=torch.float32, device=dev)
        return "no error"
    except RuntimeError as error:
        return str(error)


def check_no_buffers_on_staged_route(ctx):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    backend = dist.group.WORLD._get_backend(dev)
    return backend.supports_tensor_alloc(dev), allocation_refusal(backend, dev)


def test_no_buffers_where_peers_cannot_read_them():
    for rank, (offered, message) in enumerate(get_pool(2, FSDP_EXT_CUDA_PATH="staged").run(
            check_no_buffers_on_staged_route, timeout=CALL_TIMEOUT)):
        assert not offered, rank
        assert f"rank {rank}/2" in message and "FSDP_EXT_CUDA_PATH=staged" in message, message
        assert "supports_tensor_alloc" in message, message


def check_offered_once_the_route_is_chosen(ctx):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    group = dist.new_group()  # no CUDA op on it yet (WORLD may have had some)
    backend = group._get_backend(dev)
    before = backend.supports_tensor_alloc(dev)
    message = allocation_refusal(backend, dev)
    dist.all_reduce(torch.ones(1, device=dev), group=group)  # two ranks, one GPU: IPC
    found = before, message, backend.cuda_route, backend.supports_tensor_alloc(dev)
    dist.destroy_process_group(group)
    return found


def test_buffers_offered_once_the_route_is_chosen():
    """Without FSDP_EXT_CUDA_PATH the first CUDA op chooses the route (NCCL
    for ranks with GPUs of their own, which does not read buffers in place):
    no buffers before it, and on the IPC route after."""
    for rank, (before, message, route, after) in enumerate(get_pool(2).run(
            check_offered_once_the_route_is_chosen, timeout=CALL_TIMEOUT)):
        assert not before, rank
        assert f"rank {rank}/2" in message and "not chosen yet" in message, message
        assert route.startswith("ipc") and after, (rank, route, after)


@pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch has no NCCL")
def test_nccl_at_world_size_one():
    pool = get_pool(1, FSDP_EXT_CUDA_PATH="nccl")
    (failures, description), = pool.run(check_every_op, timeout=CALL_TIMEOUT)
    assert not failures and description.startswith("nccl"), (description, failures)
    (failures,) = pool.run(check_other_ops, timeout=CALL_TIMEOUT)
    assert not failures, failures


def check_bad_input(ctx):
    torch.cuda.set_device(0)
    messages = []
    for call in (
        lambda: dist.all_gather_into_tensor(torch.empty(2 * ctx.world_size), torch.ones(2, device="cuda")),
        lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16, device="cuda")),
        lambda: dist.all_reduce(torch.ones(3, device="cuda"), op=dist.ReduceOp.BAND),
    ):
        try:
            call()
            messages.append("no error")
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as error:
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def test_bad_input_is_a_clear_error():
    pool = get_pool(2, FSDP_EXT_CUDA_PATH="ipc")
    for rank, messages in enumerate(pool.run(check_bad_input, timeout=CALL_TIMEOUT)):
        mixed, int16, bitwise = messages
        assert "ValueError" in mixed and "tensors on two devices" in mixed and "cuda:0" in mixed, mixed
        assert f"rank {rank}/2" in mixed, mixed
        assert "TypeError" in int16 and "int16" in int16, int16
        assert "BAND" in bitwise or "bitwise" in bitwise, bitwise


def check_edges_of_a_new_group(ctx):
    """A new group whose first CUDA op is a coalesced batch's first (the route
    is chosen by host rounds that must not wait in that batch), tensors whose
    sizes differ between ranks (refused on every rank before any rank reads a
    peer's memory), and the group destroyed with an op not waited for."""
    torch.cuda.set_device(0)
    rank, world = ctx.rank, ctx.world_size
    dev = torch.device("cuda", 0)
    found = {}
    group = dist.new_group()
    sizes = [1, 3, 8191]
    ins = [values(rank + s, s, torch.float32, dev) for s in sizes]
    outs = [torch.empty(world * s, device=dev) for s in sizes]
    with dist._coalescing_manager(group=group, device=dev, async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i, group=group)
    cm.wait()
    found["first op coalesced"] = all(
        torch.equal(o.cpu(), torch.cat([values(r + s, s, torch.float32) for r in range(world)]))
        for o, s in zip(outs, sizes))
    found["route"] = group._get_backend(dev).cuda_route
    try:
        dist.all_reduce(torch.ones(8 + rank, device=dev), group=group)
        found["sizes differ"] = "no error"
    except ValueError as error:
        found["sizes differ"] = str(error)
    t = torch.ones(3, device=dev)
    dist.all_reduce(t, group=group)
    found["goes on"] = torch.equal(t.cpu(), torch.full((3,), float(world)))
    big = torch.ones(1 << 24, device=dev)
    torch.cuda._sleep(20_000_000)
    dist.all_reduce(big, group=group, async_op=True)
    dist.destroy_process_group(group)
    t = torch.ones(3, device=dev)
    dist.all_reduce(t)
    found["after destroy"] = torch.equal(t.cpu(), torch.full((3,), float(world)))
    return found


def test_edges_of_a_new_group():
    for rank, found in enumerate(get_pool(2, FSDP_EXT_CUDA_PATH="ipc").run(
            check_edges_of_a_new_group, timeout=CALL_TIMEOUT)):
        assert found["first op coalesced"] and found["route"].startswith("ipc"), (rank, found)
        message = found["sizes differ"]
        assert "differ between ranks" in message and f"rank {rank}/2" in message, message
        assert f"rank {1 - rank} passed {4 * (9 - rank)} bytes" in message, message
        assert found["goes on"] and found["after destroy"], (rank, found)


def check_broadcast_reads_only_the_root(ctx):
    """Under expandable segments torch's memory has no IPC handle: a
    broadcast from a group buffer to torch's memory is not staged, since
    only the root's buffer is read."""
    torch.cuda.set_device(0)
    rank = ctx.rank
    dev = torch.device("cuda", 0)
    backend = dist.group.WORLD._get_backend(dev)
    n = 8191
    if rank == 0:
        t = backend.allocate_tensor(n, dtype=torch.float32, device=dev)
        t.copy_(values(0, n, torch.float32, dev))
    else:
        t = torch.zeros(n, device=dev)
    before = backend._cuda_counters()["staged_ops"]
    dist.broadcast(t, src=0)
    staged = backend._cuda_counters()["staged_ops"] - before
    return torch.equal(t.cpu(), values(0, n, torch.float32)), staged


def test_broadcast_reads_only_the_root():
    for rank, (right, staged) in enumerate(get_pool(2, FSDP_EXT_CUDA_PATH="ipc", **EXPANDABLE).run(
            check_broadcast_reads_only_the_root, timeout=CALL_TIMEOUT)):
        assert right and staged == 0, (rank, right, staged)


def check_point_to_point_first(ctx):
    """A send/recv as a new group's first CUDA op: refused at once on both
    ends (two ranks cannot choose the group's route for all), no hang."""
    torch.cuda.set_device(0)
    group = dist.new_group(list(range(ctx.world_size)))
    try:
        if ctx.rank == 0:
            dist.send(torch.ones(3, device="cuda"), dst=1, group=group)
        elif ctx.rank == 1:
            dist.recv(torch.empty(3, device="cuda"), src=0, group=group)
        else:
            return "not in the pair"
        return "no error"
    except NotImplementedError as error:
        return f"NotImplementedError: {error}"


def test_point_to_point_cannot_be_a_groups_first_cuda_op():
    for rank, message in enumerate(get_pool(3, FSDP_EXT_CUDA_PATH="auto").run(
            check_point_to_point_first, timeout=CALL_TIMEOUT)):
        if rank < 2:
            assert message.startswith("NotImplementedError") and "first CUDA op" in message, message


def check_staging_failure_on_one_rank(ctx, numel):
    """Rank 1's staging fails (the test hook; as where pinned memory runs
    out) while rank 0 enters the host collective: both raise, rank 0 within
    seconds of a 60-second timeout, naming rank 1's reason."""
    import datetime
    import time

    torch.cuda.set_device(0)
    group = dist.new_group(timeout=datetime.timedelta(seconds=60))
    x = torch.ones(numel, device="cuda")
    dist.all_reduce(x, group=group)  # the route chosen, staged
    torch.cuda.synchronize()
    if ctx.rank == 1:
        torch_fsdp_ext._C._fail_next_cuda_staging_for_tests()
    start = time.monotonic()
    try:
        dist.all_reduce(x, group=group)
        torch.cuda.synchronize()
        outcome = "no error"
    except Exception as error:  # noqa: BLE001
        outcome = f"{type(error).__name__}: {error}"
    seconds = time.monotonic() - start
    dist.destroy_process_group(group)
    return outcome, seconds


# 1024 floats: the host collective on the small-op channel; 1 Mi: messages.
@pytest.mark.parametrize("numel", [1024, 1 << 20], ids=["small-op-channel", "messages"])
def test_a_staging_failure_on_one_rank_fails_every_rank_at_once(numel):
    found = get_pool(2, FSDP_EXT_CUDA_PATH="staged").run(
        check_staging_failure_on_one_rank, numel, timeout=CALL_TIMEOUT)
    for rank, (outcome, seconds) in enumerate(found):
        assert outcome.startswith("DistBackendError"), (rank, outcome)
        assert "rank 1" in outcome or rank == 1, (rank, outcome)
        assert seconds < 15, (rank, seconds, outcome)
    assert "staging the op's tensors in host memory failed: injected" in found[1][0], found[1]


DEAD_PEER = textwrap.dedent("""
    import os, sys, time, datetime, torch, torch.distributed as dist, torch_fsdp_ext
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(0)
    dist.init_process_group("fsdp_ext", timeout=datetime.timedelta(seconds=120))
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    if rank == 1:
        os._exit(0)  # gone, without a word
    start = time.monotonic()
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()
        print("no error", flush=True)
    except Exception as error:  # noqa: BLE001
        print(f"{type(error).__name__} after {time.monotonic() - start:.1f} s: {error}", flush=True)
    os._exit(0)  # drops unflushed output: the prints flush
""")


@pytest.mark.parametrize("route", ["ipc", "staged"])
def test_dead_peer_is_an_error_within_seconds(tmp_path, route):
    script = tmp_path / "dead_peer.py"
    script.write_text(DEAD_PEER)
    env = dict(os.environ, FSDP_EXT_CUDA_PATH=route, MASTER_ADDR="127.0.0.1", WORLD_SIZE="2",
               MASTER_PORT=str(29700 + (hash(route) % 200)))
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        # Start-up and the first all-reduce take seconds; the error must
        # come within 10 s of the second: 45 s in all is a hang.
        out = procs[0].communicate(timeout=45)[0]
        procs[1].communicate(timeout=15)
    finally:
        for proc in procs:  # never left holding the GPU for the next test
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    line = out.strip().splitlines()[-1]
    assert line.startswith("DistBackendError"), out[-2000:]
    assert float(line.split(" after ")[1].split(" s")[0]) < 10, line
    assert "rank 1" in line or "peer 1" in line, line
