"""The small-op channel: collectives of at most 64 KiB per rank on one host
complete through shared-memory flags (csrc/comm/small_op_channel.h), on the
caller's thread when the engine is idle, handed to the engine when a peer is
late, or queued behind the engine's work. Each path is checked for results
(every dtype and reduce op, awkward sizes, the slot's exact limit and one
element past it), for the path it took (the backend's counters), and for
errors, timeouts, dead peers and leaks.
"""

import datetime
import os
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from conftest import get_pool
from harness import run_script_ranks
from reference import DTYPES, assert_equal, expected_reduction, make_input, ops_for, reduce_op

CPU = torch.device("cpu")
SLOT_BYTES = 64 << 10  # SmallOpChannel::kMaxBytes


def counters(group=None):
    group = group or dist.group.WORLD
    return group._get_backend(CPU)._op_counters()


def channel_ops(before, after):
    return sum(after[k] - before[k]
               for k in ("small_ops_on_caller", "small_ops_handed_over", "small_ops_queued"))


def limit_sizes(dtype):
    """Awkward sizes, the slot's exact limit, and one element past it."""
    at_limit = SLOT_BYTES // torch.empty(0, dtype=dtype).element_size()
    return [0, 1, 3, at_limit, at_limit + 1]


def check_all_reduce_every_dtype_and_op(ctx):
    n = ctx.world_size
    assert counters()["small_ops_enabled"] == (n > 1)
    for dtype in DTYPES:
        for numel in limit_sizes(dtype):
            for op_name in ops_for(dtype):
                label = f"all_reduce {dtype} n={numel} {op_name}"
                tensor = make_input(ctx.rank, numel, dtype, op_name)
                before = counters()
                dist.all_reduce(tensor, op=reduce_op(op_name))
                taken = channel_ops(before, counters())
                fits = tensor.nbytes <= SLOT_BYTES and n > 1
                assert taken == (1 if fits else 0), (label, taken)
                inputs = [make_input(r, numel, dtype, op_name) for r in range(n)]
                assert_equal(tensor, expected_reduction(inputs, op_name, dtype, n), label)


def check_reduce_scatter_every_dtype_and_op(ctx):
    n = ctx.world_size
    for dtype in DTYPES:
        at_limit = SLOT_BYTES // torch.empty(0, dtype=dtype).element_size() // n
        for block in (0, 1, 3, at_limit, at_limit + 1):
            for op_name in ops_for(dtype):
                label = f"reduce_scatter {dtype} block={block} {op_name}"
                inputs = [make_input(r, n * block, dtype, op_name) for r in range(n)]
                output = torch.empty(block, dtype=dtype)
                before = counters()
                dist.reduce_scatter_tensor(output, inputs[ctx.rank].clone(), op=reduce_op(op_name))
                fits = n * block * inputs[0].element_size() <= SLOT_BYTES and n > 1
                assert channel_ops(before, counters()) == (1 if fits else 0), label
                expected = expected_reduction(inputs, op_name, dtype, n)
                assert_equal(output, expected[ctx.rank * block:(ctx.rank + 1) * block], label)


def check_results_are_the_same_bytes_everywhere(ctx):
    """Float sums of arbitrary values: every rank holds bit-identical results."""
    generator = torch.Generator().manual_seed(1234 + ctx.rank)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        tensor = torch.randn(1000, generator=generator).to(dtype)
        dist.all_reduce(tensor)
        gathered = [torch.empty_like(tensor) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, tensor, group=ctx.gloo_group)
        for r in range(ctx.world_size):
            assert torch.equal(gathered[r].view(torch.uint8), tensor.view(torch.uint8)), (dtype, r)


def check_gather_broadcast_barrier(ctx):
    n, rank = ctx.world_size, ctx.rank
    for dtype in (torch.float32, torch.int8, torch.bfloat16, torch.bool):
        for numel in limit_sizes(dtype):
            fits = numel * torch.empty(0, dtype=dtype).element_size() <= SLOT_BYTES and n > 1
            mine = make_input(rank, numel, dtype, "SUM")
            expected = [make_input(r, numel, dtype, "SUM") for r in range(n)]
            before = counters()
            out = torch.empty(n * numel, dtype=dtype)
            dist.all_gather_into_tensor(out, mine)
            assert_equal(out, torch.cat(expected), f"all_gather_into_tensor {dtype} {numel}")
            listed = [torch.empty(numel, dtype=dtype) for _ in range(n)]
            dist.all_gather(listed, mine)
            for r in range(n):
                assert_equal(listed[r], expected[r], f"all_gather {dtype} {numel} from {r}")
            for root in range(n):
                data = mine.clone() if rank == root else torch.zeros(numel, dtype=dtype)
                dist.broadcast(data, root)
                assert_equal(data, expected[root], f"broadcast {dtype} {numel} root {root}")
            assert channel_ops(before, counters()) == ((2 + n) if fits else 0), (dtype, numel)
    before = counters()
    for _ in range(3):
        dist.barrier()
    assert channel_ops(before, counters()) == (3 if n > 1 else 0)


def check_uneven_list_all_gather_goes_to_the_engine(ctx):
    n, rank = ctx.world_size, ctx.rank
    outputs = [torch.empty(r + 1) for r in range(n)]
    before = counters()
    dist.all_gather(outputs, torch.full((rank + 1,), float(rank)))
    assert channel_ops(before, counters()) == 0
    for r in range(n):
        assert torch.equal(outputs[r], torch.full((r + 1,), float(r)))


def check_late_peer_hands_the_wait_to_the_engine(ctx):
    """Rank 0 arrives 50 ms late: the others give up polling after the spin
    and the engine finishes their op; results and order are unaffected."""
    rank, n = ctx.rank, ctx.world_size
    before = counters()
    for round_ in range(3):
        if rank == 0:
            time.sleep(0.05)
        tensor = torch.full((3,), float(rank + round_))
        work = dist.all_reduce(tensor, async_op=True)
        follow = torch.ones(2)
        dist.all_reduce(follow)  # queued behind (or run after) the first one
        work.wait()
        assert torch.equal(tensor, torch.full((3,), float(sum(range(n)) + n * round_)))
        assert torch.equal(follow, torch.full((2,), float(n)))
    after = counters()
    if rank != 0:
        assert after["small_ops_handed_over"] - before["small_ops_handed_over"] >= 1, after


def check_async_small_op_returns_at_once(ctx):
    """An async small op whose peer is late returns without waiting for it."""
    rank = ctx.rank
    dist.barrier(group=ctx.gloo_group)
    if rank == 1:
        time.sleep(0.5)
    tensor = torch.full((2,), float(rank))
    start = time.monotonic()
    work = dist.all_reduce(tensor, async_op=True)
    returned_after = time.monotonic() - start
    if rank == 0:
        assert returned_after < 0.25, returned_after
        assert not work.is_completed()
    work.wait()
    assert torch.equal(tensor, torch.full((2,), float(sum(range(ctx.world_size)))))


def check_queued_behind_engine_work(ctx):
    """Small ops issued while large ones are queued run in submission order;
    point-to-point transfers in flight keep moving meanwhile."""
    n, rank = ctx.world_size, ctx.rank
    before = counters()
    big = [torch.full((300000,), float(rank + i)) for i in range(3)]
    small = [torch.full((5,), float(rank * 10 + i)) for i in range(3)]
    works = []
    for i in range(3):
        works.append(dist.all_reduce(big[i], async_op=True))
        works.append(dist.all_reduce(small[i], async_op=True))
    peer = (rank + 1) % n
    source = (rank - 1) % n
    received = torch.empty(70000)
    p2p = [dist.isend(torch.full((70000,), float(rank)), peer),
           dist.irecv(received, source)]
    works.append(dist.all_reduce(small[0], async_op=True))
    for work in works + p2p:
        work.wait()
    total = float(sum(range(n)))
    for i in range(3):
        assert torch.equal(big[i], torch.full((300000,), total + n * i))
    assert torch.equal(small[0], torch.full((5,), n * (10 * total)))
    for i in (1, 2):
        assert torch.equal(small[i], torch.full((5,), 10 * total + n * i))
    assert torch.equal(received, torch.full((70000,), float(source)))
    assert counters()["small_ops_queued"] > before["small_ops_queued"]


def check_coalesced_small_ops_join_the_bucket(ctx):
    n = ctx.world_size
    tensors = [torch.full((4,), float(ctx.rank + i)) for i in range(3)]
    before = counters()
    with dist._coalescing_manager(async_ops=True) as manager:
        for tensor in tensors:
            dist.all_reduce(tensor)
    manager.wait()
    assert channel_ops(before, counters()) == 0
    for i, tensor in enumerate(tensors):
        assert torch.equal(tensor, torch.full((4,), float(sum(range(n)) + n * i)))


def check_coalesced_gathers_and_reduce_scatters_take_the_channel(ctx):
    """allgather_into_tensor_coalesced and reduce_scatter_tensor_coalesced
    (FSDP's per-parameter collectives) of at most a slot per rank are one
    channel op each; each reduce-scatter member rounds as the same single
    reduce-scatter does (both start a block with its owner's contribution)."""
    n, rank = ctx.world_size, ctx.rank
    group = dist.distributed_c10d._get_default_group()
    members = [(1, torch.float32), (3, torch.bfloat16), (1000, torch.float32), (0, torch.float32)]
    inputs = [(torch.arange(k) + 1000 * rank).to(dt) for k, dt in members]
    outputs = [torch.empty(k * n, dtype=dt) for k, dt in members]
    before = counters()
    group.allgather_into_tensor_coalesced(outputs, inputs).wait()
    assert channel_ops(before, counters()) == 1
    for (k, dt), out in zip(members, outputs):
        expected = torch.cat([(torch.arange(k) + 1000 * r).to(dt) for r in range(n)])
        assert torch.equal(out, expected), (k, dt)
    # Values of different magnitudes: their sum rounds differently in another order.
    g = torch.Generator().manual_seed(rank)
    sizes = (1, 3, 1000)
    inputs = [torch.randn(k * n, generator=g) * 10 ** rank for k in sizes]
    options = dist.ReduceScatterOptions()
    options.reduceOp = dist.ReduceOp.AVG
    outputs = [torch.empty(k) for k in sizes]
    before = counters()
    group.reduce_scatter_tensor_coalesced(outputs, inputs, options).wait()
    assert channel_ops(before, counters()) == 1
    for k, tensor, out in zip(sizes, inputs, outputs):
        single = torch.empty(k)
        dist.reduce_scatter_tensor(single, tensor, op=dist.ReduceOp.AVG)
        assert torch.equal(out, single), k


def check_different_ops_are_a_clear_error(ctx):
    group = dist.new_group(timeout=datetime.timedelta(seconds=20))
    tensor = torch.ones(8)
    with pytest.raises(dist.DistBackendError) as info:
        if ctx.rank == 0:
            dist.all_reduce(tensor, group=group)
        else:
            dist.broadcast(tensor, 0, group=group)
    message = str(info.value)
    with pytest.raises(dist.DistBackendError, match="unusable"):
        dist.all_reduce(torch.ones(2), group=group)
    dist.destroy_process_group(group)
    return message


def check_size_straddling_the_limit(ctx, op):
    """Rank 0's size fits the channel, rank 1's does not: a mismatch on both
    ranks within seconds (Note [a size that straddles the channel's limit]),
    not a wait for the 60 s timeout."""
    n, rank = ctx.world_size, ctx.rank
    group = dist.new_group(timeout=datetime.timedelta(seconds=60))
    numel = 16000 if rank == 0 else 17000  # 64000 bytes (the channel), 68000 bytes (UCX)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError) as info:
        if op == "all_gather":
            dist.all_gather_into_tensor(torch.empty(numel * n), torch.ones(numel), group=group)
        else:
            dist.all_reduce(torch.ones(numel), group=group)
    elapsed = time.monotonic() - start
    dist.destroy_process_group(group)
    return str(info.value), elapsed


def check_disabled(ctx):
    before = counters()
    tensor = torch.ones(3)
    dist.all_reduce(tensor)
    dist.barrier()
    assert torch.equal(tensor, torch.full((3,), float(ctx.world_size)))
    after = counters()
    assert not after["small_ops_enabled"]
    assert channel_ops(before, after) == 0


def resource_counts():
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for _ in maps)
    return len(os.listdir("/proc/self/fd")), mapped


def check_no_leaks(ctx):
    """1000 small ops of every kind, then groups created and destroyed: the
    channel's fds and mappings do not accumulate."""
    n = ctx.world_size

    def burst(group):
        t = torch.ones(3)
        out = torch.empty(3 * n)
        for _ in range(250):
            dist.all_reduce(t, group=group)
            dist.all_gather_into_tensor(out, torch.ones(3), group=group)
            dist.broadcast(t, 0, group=group)
            dist.barrier(group=group)

    def cycle_groups(count):
        for _ in range(count):
            group = dist.new_group()
            dist.all_reduce(torch.ones(2), group=group)
            dist.destroy_process_group(group)

    burst(None)
    cycle_groups(3)  # warm-up: allocator arenas, lazily created state
    start = resource_counts()
    burst(None)
    cycle_groups(10)
    end = resource_counts()
    assert end[0] <= start[0], (start, end)  # no fd kept per group or per op
    assert end[1] <= start[1] + 4, (start, end)  # mappings (malloc may add a few arenas)


def test_all_reduce_every_dtype_and_op(pool):
    pool.run(check_all_reduce_every_dtype_and_op)


def test_reduce_scatter_every_dtype_and_op(pool):
    pool.run(check_reduce_scatter_every_dtype_and_op)


def test_results_are_the_same_bytes_everywhere(pool):
    pool.run(check_results_are_the_same_bytes_everywhere)


def test_gather_broadcast_barrier(pool):
    pool.run(check_gather_broadcast_barrier)


def test_uneven_list_all_gather_goes_to_the_engine(pool):
    pool.run(check_uneven_list_all_gather_goes_to_the_engine)


@pytest.mark.parametrize("world", ["pool2", "pool4"])
def test_late_peer_hands_the_wait_to_the_engine(world, request):
    request.getfixturevalue(world).run(check_late_peer_hands_the_wait_to_the_engine)


def test_async_small_op_returns_at_once(pool2):
    pool2.run(check_async_small_op_returns_at_once)


@pytest.mark.parametrize("world", ["pool2", "pool4"])
def test_queued_behind_engine_work(world, request):
    request.getfixturevalue(world).run(check_queued_behind_engine_work)


def test_coalesced_small_ops_join_the_bucket(pool2):
    pool2.run(check_coalesced_small_ops_join_the_bucket)


def test_coalesced_gathers_and_reduce_scatters_take_the_channel():
    get_pool(3).run(check_coalesced_gathers_and_reduce_scatters_take_the_channel)


def test_different_ops_are_a_clear_error(pool2):
    messages = pool2.run(check_different_ops_are_a_clear_error)
    ops = {0: "all_reduce (float32 SUM) of 32 bytes", 1: "broadcast (root 0) of 32 bytes"}
    for rank, message in enumerate(messages):
        assert f"rank {rank}/2" in message, message
        assert f"rank {1 - rank} called {ops[1 - rank]} where rank {rank} called {ops[rank]}" \
            in message, message


@pytest.mark.parametrize("op", ["all_gather", "all_reduce"])
def test_size_straddling_the_limit_is_a_mismatch(pool2, op):
    results = pool2.run(check_size_straddling_the_limit, op)
    for rank, (message, elapsed) in enumerate(results):
        assert elapsed < 20, (rank, elapsed, message)
        assert f"rank {rank}/2" in message, message
        assert "the ranks' sizes differ" in message, message
    channel_side, ucx_side = results[0][0], results[1][0]
    assert "rank 1 runs this collective over UCX messages where rank 0 called" in channel_side
    assert "through the small-op channel" in channel_side
    assert "rank 0 called" in ucx_side and "where rank 1 runs this collective over UCX" in ucx_side


def test_disabled_by_environment(pool2_without_small_ops):
    pool2_without_small_ops.run(check_disabled)


@pytest.mark.parametrize("world", ["pool2", "pool4"])
def test_no_leaks(world, request):
    request.getfixturevalue(world).run(check_no_leaks)


DEAD_PEER_SCRIPT = textwrap.dedent("""
    import datetime, os, sys, time, torch, torch.distributed as dist
    import torch_fsdp_ext
    rank = int(os.environ["RANK"])
    dist.init_process_group("fsdp_ext", timeout=datetime.timedelta(seconds=60))
    t = torch.ones(2)
    for _ in range(100):
        dist.all_reduce(t)
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        for _ in range(1000000):
            dist.all_reduce(t)
    except dist.DistBackendError as error:
        print(f"ERROR after {time.monotonic() - start:.2f}s: {error}", flush=True)
        os._exit(0)
    os._exit(1)
""")


def test_dead_peer_is_an_error_within_seconds(tmp_path):
    script = tmp_path / "dead_peer.py"
    script.write_text(DEAD_PEER_SCRIPT)
    (code0, out0, err0), (code1, _, _) = run_script_ranks(
        script, 29500 + os.getpid() % 1000, first=0, timeout=50)
    assert code0 == 0, err0[-2000:]
    assert code1 == 3
    line = out0.strip().splitlines()[-1]
    seconds = float(line.split("ERROR after ")[1].split("s:")[0])
    assert seconds < 10, line
    assert "rank 1" in line and "exited" in line, line
