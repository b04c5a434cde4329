"""Fused buckets (coalesced collectives) and buffers allocated from the group.

Coalesced all-gathers, reduce-scatters and all-reduces are checked against
closed-form values with mixed sizes and dtypes under every algorithm, and the
engine's counters show each bucket ran as one op with one sequence number.
Group-allocated buffers are checked for the path taken (read in place by
peers, no staging copy), data, lifetime while an op is in flight, and leaks
over 1000 allocate/collective/free iterations.
"""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from reference import assert_equal, expected_reduction, make_input, pattern
from test_collectives import forced_algorithms

CPU = torch.device("cpu")
# (elements per rank, dtype): awkward sizes, an empty member, mixed dtypes.
MEMBERS = [(1, torch.float32), (0, torch.bfloat16), (3, torch.int64), (8191, torch.float16),
           (70000, torch.float32), (5, torch.uint8)]


@contextlib.contextmanager
def forced(**variables):
    """Forces algorithms (FSDP_EXT_*_ALGO) for the ops inside the block."""
    os.environ.update(variables)
    try:
        yield
    finally:
        for name in variables:
            os.environ.pop(name, None)


def backend():
    return dist.group.WORLD._get_backend(CPU)


def counters():
    return backend()._op_counters()


def run_fused(body):
    """Runs `body` and returns (engine ops, sequence numbers) it used."""
    before = counters()
    body()
    after = counters()
    return (after["ops"] - before["ops"],
            after["collective_sequences"] - before["collective_sequences"])


def verify_gathered_bucket(n, rank, algorithm, device):
    """A bucket of all_gather_into_tensor inside _coalescing_manager: without a
    device, its fast path calls allgather_into_tensor_coalesced once; with
    one, the ops queue between startCoalescing and endCoalescing. Either way
    one fused op."""
    outs = [torch.empty(k * n, dtype=dt) for k, dt in MEMBERS]
    ins = [pattern(rank, k, dt) for k, dt in MEMBERS]

    def gather():
        with dist._coalescing_manager(device=device, async_ops=True) as cm:
            for o, i in zip(outs, ins):
                dist.all_gather_into_tensor(o, i)
        cm.wait()

    ops, sequences = run_fused(gather)
    assert (ops, sequences) == (1, 1), (algorithm, device, ops, sequences)
    for o, (k, dt) in zip(outs, MEMBERS):
        expected = torch.cat([pattern(r, k, dt) for r in range(n)])
        assert_equal(o, expected, f"coalesced all_gather {algorithm} device={device} {dt} k={k}")


def check_coalesced_buckets(ctx):
    n, rank = ctx.world_size, ctx.rank
    for algorithm in forced_algorithms():
        verify_gathered_bucket(n, rank, algorithm, device=None)
        verify_gathered_bucket(n, rank, algorithm, device=CPU)

        # reduce_scatter_tensor, mixed float dtypes, SUM and AVG.
        for op_name in ("SUM", "AVG"):
            members = [(k, dt) for k, dt in MEMBERS if dt.is_floating_point]
            rs_in = [make_input(rank, k * n, dt, op_name) for k, dt in members]
            rs_out = [torch.empty(k, dtype=dt) for k, dt in members]
            op = dist.ReduceOp.SUM if op_name == "SUM" else dist.ReduceOp.AVG

            def scatter():
                with dist._coalescing_manager():
                    for o, i in zip(rs_out, rs_in):
                        dist.reduce_scatter_tensor(o, i, op=op)

            ops, sequences = run_fused(scatter)
            assert (ops, sequences) == (1, 1), (algorithm, ops, sequences)
            for o, (k, dt) in zip(rs_out, members):
                full = expected_reduction([make_input(r, k * n, dt, op_name) for r in range(n)],
                                          op_name, dt, n)
                assert_equal(o, full[rank * k:(rank + 1) * k],
                             f"coalesced reduce_scatter {algorithm} {op_name} {dt} k={k}")

        # all_reduce: allreduce_coalesced over mixed dtypes, MAX for the ints.
        tensors = [make_input(rank, k, dt, "MAX") for k, dt in MEMBERS]

        def reduce_all():
            with dist._coalescing_manager():
                for t in tensors:
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)

        ops, sequences = run_fused(reduce_all)
        # The ring all-reduce is a reduce-scatter pass then an all-gather pass.
        assert ops == 1 and 1 <= sequences <= 2, (algorithm, ops, sequences)
        for t, (k, dt) in zip(tensors, MEMBERS):
            expected = expected_reduction([make_input(r, k, dt, "MAX") for r in range(n)],
                                          "MAX", dt, n)
            assert_equal(t, expected, f"coalesced all_reduce {algorithm} {dt} k={k}")


def check_group_allocation(ctx):
    n, rank = ctx.world_size, ctx.rank
    be = backend()
    assert be.supports_tensor_alloc(CPU)
    assert be.shared_memory_enabled
    for numel in (0, 1, 3, 8191, 300000):
        for dt in (torch.float32, torch.bfloat16, torch.int64):
            out = be.allocate_tensor(numel * n, dtype=dt, device=CPU)
            assert out.dtype == dt and out.shape == (numel * n,) and out.device == CPU
            # FSDP's layout: the input is this rank's slice of the output.
            inp = out.narrow(0, rank * numel, numel)
            inp.copy_(pattern(rank, numel, dt))
            before = be._pool_stats()
            with forced(FSDP_EXT_ALLGATHER_ALGO="shm"):
                dist.all_gather_into_tensor(out, inp)
            after = be._pool_stats()
            expected = torch.cat([pattern(r, numel, dt) for r in range(n)])
            assert_equal(out, expected, f"all_gather from group buffer {dt} n={numel}")
            if n > 1 and numel > 0:
                # Peers read the input where it is: no staging copy.
                assert after["pieces_staged"] == before["pieces_staged"], (before, after)
                assert after["pieces_in_place"] > before["pieces_in_place"], (before, after)
            # reduce_scatter with a group-allocated input, ordinary output.
            full = be.allocate_tensor(numel * n, dtype=dt, device=CPU)
            full.copy_(make_input(rank, numel * n, dt, "SUM"))
            shard = torch.empty(numel, dtype=dt)
            before = be._pool_stats()
            with forced(FSDP_EXT_REDUCE_SCATTER_ALGO="shm"):
                dist.reduce_scatter_tensor(shard, full)
            after = be._pool_stats()
            whole = expected_reduction([make_input(r, numel * n, dt, "SUM") for r in range(n)],
                                       "SUM", dt, n)
            assert_equal(shard, whole[rank * numel:(rank + 1) * numel],
                         f"reduce_scatter from group buffer {dt} n={numel}")
            if n > 1 and numel > 0:
                assert after["pieces_staged"] == before["pieces_staged"], (before, after)
    # Ordinary tensors on the same path are staged (one copy) and still correct.
    before = be._pool_stats()
    out = torch.empty(1000 * n)
    with forced(FSDP_EXT_ALLGATHER_ALGO="shm"):
        dist.all_gather_into_tensor(out, torch.full((1000,), float(rank)))
    assert torch.equal(out, torch.arange(n, dtype=torch.float32).repeat_interleave(1000))
    if n > 1:
        assert be._pool_stats()["pieces_staged"] > before["pieces_staged"]
    # Large ordinary inputs are read by peers with process_vm_readv where the
    # host allows it (one copy), else staged.
    numel = 300000  # 1.2 MB per rank
    before = be._pool_stats()
    out = torch.empty(numel * n)
    data = pattern(rank, numel, torch.float32)
    with forced(FSDP_EXT_ALLGATHER_ALGO="shm", FSDP_EXT_BROADCAST_ALGO="shm"):
        dist.all_gather_into_tensor(out, pattern(rank, numel, torch.float32))
        dist.broadcast(data, src=n - 1)
    assert_equal(out, torch.cat([pattern(r, numel, torch.float32) for r in range(n)]),
                 "all_gather of a large ordinary tensor")
    assert_equal(data, pattern(n - 1, numel, torch.float32), "broadcast of a large ordinary tensor")
    after = be._pool_stats()
    if n > 1:
        path = "pieces_process_reads" if after["process_reads_enabled"] else "pieces_staged"
        assert after[path] > before[path], (before, after)
    # A reduce-scatter's large ordinary blocks too: the owner reads them a
    # chunk at a time and reduces them from cache.
    before = after
    whole = [pattern(r, numel * n, torch.float32) for r in range(n)]
    shard = torch.empty(numel)
    with forced(FSDP_EXT_REDUCE_SCATTER_ALGO="shm"):
        dist.reduce_scatter_tensor(shard, whole[rank].clone())
    expected = expected_reduction(whole, "SUM", torch.float32, n)
    assert_equal(shard, expected[rank * numel:(rank + 1) * numel],
                 "reduce_scatter of a large ordinary tensor")
    after = be._pool_stats()
    if n > 1:
        path = "pieces_process_reads" if after["process_reads_enabled"] else "pieces_staged"
        assert after[path] >= before[path] + (n - 1), (before, after)


def check_allocation_errors(ctx):
    be = backend()
    with pytest.raises(ValueError, match=r"fsdp_ext allocate_tensor .*rank \d+/\d+\): size must be >= 0"):
        be.allocate_tensor(-1, dtype=torch.float32, device=CPU)
    with pytest.raises(NotImplementedError, match="only CPU tensors"):
        be.allocate_tensor(4, dtype=torch.float32, device=torch.device("meta"))


def check_buffer_outlives_its_python_reference(ctx):
    """A buffer freed while an op on it is in flight stays alive (and is not
    handed out again) until the op ends."""
    n, rank = ctx.world_size, ctx.rank
    be = backend()
    numel = 1 << 18
    with forced(FSDP_EXT_ALLGATHER_ALGO="shm"):
        for _ in range(20):
            out = torch.empty(numel * n)
            inp = be.allocate_tensor(numel, dtype=torch.float32, device=CPU)
            inp.fill_(rank + 1)
            address = inp.data_ptr()
            in_use = be._pool_stats()["in_use"]
            work = dist.all_gather_into_tensor(out, inp, async_op=True)
            del inp  # the op still holds the buffer
            other = be.allocate_tensor(numel, dtype=torch.float32, device=CPU)
            if not work.is_completed():
                assert other.data_ptr() != address
            other.fill_(-1.0)  # must not disturb the op's input
            work.wait()
            expected = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(numel)
            assert torch.equal(out, expected)
            del other
            assert be._pool_stats()["in_use"] == in_use - 1


def check_buffer_outlives_its_group(ctx):
    """A tensor from a group's pool stays valid after the group is destroyed
    (the pool and its UCX registrations live as long as any of its tensors)."""
    n, rank = ctx.world_size, ctx.rank
    group = dist.new_group(backend="fsdp_ext")
    be = group._get_backend(CPU)
    kept = be.allocate_tensor(100000, dtype=torch.float32, device=CPU)
    kept.fill_(float(rank))
    out = torch.empty(100000 * n)
    dist.all_gather_into_tensor(out, kept, group=group)
    dist.destroy_process_group(group)
    del be, group
    kept.add_(1.0)  # still mapped and writable
    assert torch.all(kept == rank + 1)
    assert torch.equal(out, torch.arange(n, dtype=torch.float32).repeat_interleave(100000))
    del kept  # returns to a pool whose group is gone: no crash


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def check_no_leaks_over_1000_iterations(ctx):
    n, rank = ctx.world_size, ctx.rank
    be = backend()
    sizes = (1, 3000, 70000)  # below and above the shared-memory threshold

    def iteration(i):
        numel = sizes[i % len(sizes)]
        out = be.allocate_tensor(numel * n, dtype=torch.float32, device=CPU)
        inp = out.narrow(0, rank * numel, numel)
        inp.fill_(float(rank + i))
        dist.all_gather_into_tensor(out, inp)
        grad = be.allocate_tensor(numel * n, dtype=torch.float32, device=CPU)
        grad.fill_(1.0)
        shard = be.allocate_tensor(numel, dtype=torch.float32, device=CPU)
        dist.reduce_scatter_tensor(shard, grad)
        assert out[-1].item() == float(n - 1 + i) and shard[0].item() == float(n)

    def settle():
        # The progress thread marks an op done, waking its caller, and drops
        # its reference to the op's Work (which holds the output buffer) just
        # after. A small-op barrier runs on this thread and may overtake that;
        # an all-reduce too large for the small-op channel runs on the progress
        # thread after it, so the counts below see every freed buffer back.
        dist.all_reduce(torch.ones(1 << 17))

    for i in range(30):  # warm up: pool classes, peer mappings, staging
        iteration(i)
    settle()
    stats, fds, rss = be._pool_stats(), _open_fds(), _rss_bytes()
    for i in range(1000):
        iteration(i)
    settle()
    after = be._pool_stats()
    for key in ("segments", "in_use", "reserved_bytes", "registrations", "mapped_peer_segments"):
        assert after[key] == stats[key], (key, stats, after)
    assert after["reuses"] - stats["reuses"] == 3000  # every allocation reused a buffer
    assert _open_fds() == fds  # segments are memfds: a leaked one is a leaked fd
    assert _rss_bytes() - rss < (8 << 20), (rss, _rss_bytes())


def check_without_shared_memory(ctx):
    """Groups that cannot share memory offer no allocation and use UCX only."""
    n, rank = ctx.world_size, ctx.rank
    be = backend()
    assert not be.shared_memory_enabled
    assert not be.supports_tensor_alloc(CPU)
    with pytest.raises(RuntimeError, match="does not share memory"):
        be.allocate_tensor(4, dtype=torch.float32, device=CPU)
    check_coalesced_buckets(ctx)
    assert be._pool_stats()["pieces_staged"] == 0
    assert be._pool_stats()["pieces_in_place"] == 0


def check_buffers_back_in_their_pool_when_wait_returns(ctx):
    """The progress thread lets go of an op's tensors before wait() returns:
    a buffer the caller drops right after is back in its pool (the host block
    cache) at once, so the caller's next allocation of that size reuses it.
    Large enough (256 KiB) that the op runs on the progress thread, not on the
    caller's; each way of waiting many times over, as the race was narrow."""
    from torch_fsdp_ext import _C

    n = ctx.world_size
    numel = 65536

    def cached(count=numel):
        return _C._fsdp_host_cache_empty(count, torch.float32).fill_(1.0)

    def all_reduce_sync():
        tensor = cached()
        dist.all_reduce(tensor)
        return [tensor]

    def all_reduce_async():
        tensor = cached()
        dist.all_reduce(tensor, async_op=True).wait()
        return [tensor]

    def all_gather():
        shard, whole = cached(numel // n), cached()
        dist.all_gather_into_tensor(whole, shard, async_op=True).wait()
        return [shard, whole]

    def reduce_scatter():
        shard, whole = cached(numel // n), cached()
        dist.reduce_scatter_tensor(shard, whole, async_op=True).wait()
        return [shard, whole]

    def coalesced():
        first, second = cached(), cached()
        with dist._coalescing_manager(async_ops=True) as manager:
            dist.all_reduce(first)
            dist.all_reduce(second)
        manager.wait()
        return [first, second]

    late = {}
    for way in (all_reduce_sync, all_reduce_async, all_gather, reduce_scatter, coalesced):
        for _ in range(200):
            _C._fsdp_host_cache_release_idle()
            tensors = way()
            expected = sum(t.numel() * t.element_size() for t in tensors)
            del tensors
            idle = _C._fsdp_host_cache_idle_bytes()
            # Fewer: a buffer still held. More: one of the previous op's came
            # back after the release_idle() above. Either way the ranks go on,
            # so that they keep issuing the same collectives.
            if idle != expected:
                late.setdefault(way.__name__, []).append((idle, expected))
    _C._fsdp_host_cache_release_idle()
    return late


def test_buffers_back_in_their_pool_when_wait_returns(pool2):
    for late in pool2.run(check_buffers_back_in_their_pool_when_wait_returns):
        # {way: [(idle bytes, bytes dropped)] for each op of its 200 whose
        # buffers came back late}
        assert late == {}, late


def test_coalesced_buckets(pool):
    pool.run(check_coalesced_buckets)


@pytest.mark.parametrize("check", [check_group_allocation, check_allocation_errors,
                                   check_buffer_outlives_its_python_reference,
                                   check_buffer_outlives_its_group],
                         ids=lambda f: f.__name__.removeprefix("check_"))
def test_allocation(pool, check):
    pool.run(check)


def test_no_leaks_over_1000_iterations(pool2):
    pool2.run(check_no_leaks_over_1000_iterations, timeout=300)


def check_large_ordinary_tensors_staged(ctx):
    """Without process_vm_readv, large ordinary tensors go through staging."""
    n, rank = ctx.world_size, ctx.rank
    be = backend()
    stats = be._pool_stats()
    assert be.shared_memory_enabled and not stats["process_reads_enabled"]
    numel = 300000
    out = torch.empty(numel * n)
    dist.all_gather_into_tensor(out, pattern(rank, numel, torch.float32))
    assert_equal(out, torch.cat([pattern(r, numel, torch.float32) for r in range(n)]),
                 "all_gather of a large ordinary tensor, staged")
    shard = torch.empty(numel)
    dist.reduce_scatter_tensor(shard, pattern(rank, numel * n, torch.float32))
    expected = expected_reduction([pattern(r, numel * n, torch.float32) for r in range(n)],
                                  "SUM", torch.float32, n)
    assert_equal(shard, expected[rank * numel:(rank + 1) * numel],
                 "reduce_scatter of a large ordinary tensor, staged")
    after = be._pool_stats()
    assert after["pieces_staged"] > stats["pieces_staged"]
    assert after["pieces_process_reads"] == stats["pieces_process_reads"] == 0


def test_large_ordinary_tensors_staged_without_process_reads(pool2_without_process_reads):
    pool2_without_process_reads.run(check_large_ordinary_tensors_staged)


def test_without_shared_memory(pool_without_shared_memory):
    pool_without_shared_memory.run(check_without_shared_memory)
