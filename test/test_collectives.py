"""Every collective, on world sizes 1-4, against closed-form expected values.

Each test runs on all ranks of a worker pool and loops over dtypes, sizes
(0, 1, 3, 8191 elements) and reduce ops inside the workers, so one pytest
item covers a whole matrix without paying process start-up per case.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from conftest import get_pool
from reference import (
    DTYPES,
    SIZES,
    assert_equal,
    expected_reduction,
    make_input,
    ops_for,
    pattern,
    reduce_op,
)

ALGORITHM_VARIABLES = (
    "FSDP_EXT_ALLGATHER_ALGO",
    "FSDP_EXT_REDUCE_SCATTER_ALGO",
    "FSDP_EXT_ALLREDUCE_ALGO",
    "FSDP_EXT_BROADCAST_ALGO",
)


def forced_algorithms():
    """Run a body under each algorithm in turn (auto, direct, ring, shared memory).

    The workers are long-lived: the variables are restored as they were even
    when the body fails (or the loop is left early), so the next test in the
    same worker does not inherit a forced algorithm."""
    saved = {variable: os.environ.get(variable) for variable in ALGORITHM_VARIABLES}
    try:
        for choice in ("auto", "direct", "ring", "shm"):
            for variable in ALGORITHM_VARIABLES:
                os.environ[variable] = choice
            yield choice
    finally:
        for variable, value in saved.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value


def check_all_reduce(ctx):
    n = ctx.world_size
    for algorithm in forced_algorithms():
        for dtype in DTYPES:
            for numel in SIZES + [70000]:
                for op_name in ops_for(dtype):
                    label = f"all_reduce {algorithm} {dtype} n={numel} {op_name}"
                    tensor = make_input(ctx.rank, numel, dtype, op_name)
                    dist.all_reduce(tensor, op=reduce_op(op_name))
                    inputs = [make_input(r, numel, dtype, op_name) for r in range(n)]
                    assert_equal(tensor, expected_reduction(inputs, op_name, dtype, n), label)


def check_reduce(ctx):
    n = ctx.world_size
    for root in range(n):
        for dtype in DTYPES:
            for numel in SIZES:
                for op_name in ops_for(dtype):
                    tensor = make_input(ctx.rank, numel, dtype, op_name)
                    original = tensor.clone()
                    dist.reduce(tensor, dst=root, op=reduce_op(op_name))
                    label = f"reduce root={root} {dtype} n={numel} {op_name}"
                    if ctx.rank == root:
                        inputs = [make_input(r, numel, dtype, op_name) for r in range(n)]
                        assert_equal(tensor, expected_reduction(inputs, op_name, dtype, n), label)
                    else:
                        assert_equal(tensor, original, label + " (non-root unchanged)")


# The large reduce-scatter size crosses the chunking and process-read
# thresholds. What an op adds there is its pre-multiply (PREMUL_SUM) or
# post-divide (AVG) step, so that size runs those, SUM and a comparison and a
# bitwise op; every op's arithmetic runs at the small sizes (8191 crosses the
# kernels' vector widths). Those steps differ by element kind, not by width,
# so that size runs one dtype of each kind: float32, a half type converted
# through float (bfloat16) and an integer. The full product cost minutes at
# 4 ranks on 2 cores; with every dtype it was 42 s of make test's time.
LARGE_REDUCE_SCATTER = 300000
LARGE_SIZE_OPS = ("SUM", "AVG", "PREMUL_SUM", "MAX", "BXOR")
LARGE_SIZE_DTYPES = (torch.float32, torch.bfloat16, torch.int32)


def check_reduce_scatter(ctx):
    n, rank = ctx.world_size, ctx.rank
    for algorithm in forced_algorithms():
        for dtype in DTYPES:
            large = [LARGE_REDUCE_SCATTER] if dtype in LARGE_SIZE_DTYPES else []
            for numel in SIZES + large:
                ops = ops_for(dtype)
                if numel == LARGE_REDUCE_SCATTER:
                    ops = [op for op in ops if op in LARGE_SIZE_OPS]
                for op_name in ops:
                    label = f"reduce_scatter_tensor {algorithm} {dtype} n={numel} {op_name}"
                    full = make_input(rank, numel * n, dtype, op_name)
                    out = torch.empty(numel, dtype=dtype)
                    dist.reduce_scatter_tensor(out, full, op=reduce_op(op_name))
                    # Every rank's input over this rank's slice only (the pattern
                    # depends on index + salt): the reference costs n, not n * n, blocks.
                    mine = [make_input(r, numel, dtype, op_name, salt=rank * numel)
                            for r in range(n)]
                    assert_equal(out, expected_reduction(mine, op_name, dtype, n), label)
                    # List form, with uneven per-rank sizes (rank r gets numel + r).
                    sizes = [numel + r for r in range(n)]
                    chunks = [make_input(rank, s, dtype, op_name, salt=100 * r) for r, s in enumerate(sizes)]
                    out = torch.empty(sizes[rank], dtype=dtype)
                    dist.reduce_scatter(out, chunks, op=reduce_op(op_name))
                    mine = [make_input(r, sizes[rank], dtype, op_name, salt=100 * rank) for r in range(n)]
                    assert_equal(out, expected_reduction(mine, op_name, dtype, n), label + " (list)")


def check_all_gather(ctx):
    n, rank = ctx.world_size, ctx.rank
    for algorithm in forced_algorithms():
        for dtype in DTYPES + [torch.complex64, torch.int16]:
            for numel in SIZES + [300000]:
                label = f"all_gather {algorithm} {dtype} n={numel}"
                out = torch.empty(numel * n, dtype=dtype)
                dist.all_gather_into_tensor(out, pattern(rank, numel, dtype))
                expected = torch.cat([pattern(r, numel, dtype) for r in range(n)])
                assert_equal(out, expected, label)
                # List form with uneven sizes: rank r contributes numel + 2r elements.
                outs = [torch.empty(numel + 2 * r, dtype=dtype) for r in range(n)]
                dist.all_gather(outs, pattern(rank, numel + 2 * rank, dtype))
                for r in range(n):
                    assert_equal(outs[r], pattern(r, numel + 2 * r, dtype), f"{label} list from {r}")


def check_broadcast(ctx):
    """Flat and binomial-tree broadcast (the tree is the default above 8 ranks)."""
    n, rank = ctx.world_size, ctx.rank
    for algorithm in forced_algorithms():
        for root in range(n):
            for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.int64):
                for numel in SIZES + [100000]:
                    t = pattern(rank, numel, dtype)
                    dist.broadcast(t, src=root)
                    assert_equal(t, pattern(root, numel, dtype),
                                 f"broadcast {algorithm} root={root} {dtype} n={numel}")


def check_gather_scatter(ctx):
    n, rank = ctx.world_size, ctx.rank
    for root in range(n):
        for dtype in DTYPES:
            for numel in SIZES + [100000]:
                label = f"root={root} {dtype} n={numel}"
                gather_list = [torch.empty(numel, dtype=dtype) for _ in range(n)] if rank == root else None
                dist.gather(pattern(rank, numel, dtype), gather_list, dst=root)
                if rank == root:
                    for r in range(n):
                        assert_equal(gather_list[r], pattern(r, numel, dtype), f"gather {label} from {r}")

                scatter_list = [pattern(r + 7, numel, dtype) for r in range(n)] if rank == root else None
                out = torch.empty(numel, dtype=dtype)
                dist.scatter(out, scatter_list, src=root)
                assert_equal(out, pattern(rank + 7, numel, dtype), "scatter " + label)


def check_all_to_all(ctx):
    n, rank = ctx.world_size, ctx.rank
    for dtype in DTYPES:
        for rows in SIZES:
            # Equal splits: block for rank j holds value 1000*sender + j.
            inp = torch.cat([torch.full((rows, 2), 1000 * rank + j) for j in range(n)]).to(dtype)
            out = torch.empty(rows * n, 2, dtype=dtype)
            dist.all_to_all_single(out, inp)
            expected = torch.cat([torch.full((rows, 2), 1000 * s + rank) for s in range(n)]).to(dtype)
            assert_equal(out, expected, f"all_to_all_single equal {dtype} rows={rows}")
            # Uneven: sender s sends (s + j + rows) % 3 rows to rank j.
            in_splits = [(rank + j + rows) % 3 for j in range(n)]
            out_splits = [(s + rank + rows) % 3 for s in range(n)]
            inp = torch.cat([torch.full((k, 3), 100 * rank + j) for j, k in enumerate(in_splits)]).to(dtype)
            out = torch.empty(sum(out_splits), 3, dtype=dtype)
            dist.all_to_all_single(out, inp, out_splits, in_splits)
            expected = torch.cat([torch.full((k, 3), 100 * s + rank) for s, k in enumerate(out_splits)]).to(dtype)
            assert_equal(out, expected, f"all_to_all_single uneven {dtype} rows={rows}")
            # List form.
            outs = [torch.empty(rows + s, dtype=dtype) for s in range(n)]
            dist.all_to_all(outs, [pattern(10 * rank + j, rows + rank, dtype) for j in range(n)])
            for s in range(n):
                assert_equal(outs[s], pattern(10 * s + rank, rows + s, dtype), f"all_to_all {dtype} from {s}")


def check_point_to_point(ctx):
    n, rank = ctx.world_size, ctx.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    for dtype in DTYPES:
        for numel in SIZES + [200000]:
            # A ring of isend/irecv pairs, posted sends-first on every rank.
            ops = [
                dist.P2POp(dist.isend, pattern(rank, numel, dtype), right, tag=3),
                dist.P2POp(dist.irecv, incoming := torch.empty(numel, dtype=dtype), left, tag=3),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            assert_equal(incoming, pattern(left, numel, dtype), f"batch_isend_irecv {dtype} n={numel}")
            if n > 1:
                # Blocking send/recv in an order that cannot deadlock.
                buf = torch.empty(numel, dtype=dtype)
                if rank % 2 == 0:
                    dist.send(pattern(rank, numel, dtype), dst=right)
                    dist.recv(buf, src=left)
                else:
                    dist.recv(buf, src=left)
                    dist.send(pattern(rank, numel, dtype), dst=right)
                assert_equal(buf, pattern(left, numel, dtype), f"send/recv {dtype} n={numel}")
    # Receive from any source: rank 0 collects one message from every other rank.
    if n > 1:
        if rank == 0:
            senders = set()
            for _ in range(n - 1):
                buf = torch.empty(4, dtype=torch.int64)
                sender = dist.recv(buf)
                assert buf.tolist() == [sender] * 4, (sender, buf)
                senders.add(sender)
            assert senders == set(range(1, n))
        else:
            dist.send(torch.full((4,), rank, dtype=torch.int64), dst=0)


def check_async_work_and_futures(ctx):
    n, rank = ctx.world_size, ctx.rank
    tensors = [torch.full((1000,), float(rank + i)) for i in range(5)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    futures = [w.get_future() for w in works]
    for i, (work, future) in enumerate(zip(works, futures)):
        value = future.wait()
        assert isinstance(value, list) and value[0] is not None
        assert torch.equal(value[0], tensors[i])
        assert work.wait() is True
        assert work.is_completed()
        assert torch.all(tensors[i] == sum(r + i for r in range(n)))
    # Results stay correct when the Work object is dropped before completion.
    t = torch.ones(50000)
    dist.all_reduce(t, async_op=True)
    dist.barrier()
    assert torch.all(t == n)
    # then() chains on the future, like DDP comm hooks.
    t = torch.ones(10)
    doubled = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert torch.all(doubled.wait() == 2 * n)
    # A Python callback runs on the progress thread (it takes the GIL) while
    # the caller waits for that thread to let go of the op (Note [wait()
    # returns once the engine let go]); Work.wait releases the GIL, so both
    # go on. Large enough for the progress thread; the callback slow enough
    # to be waited for.
    for _ in range(5):
        big = torch.ones(65536)
        work = dist.all_reduce(big, async_op=True)
        summed = work.get_future().then(lambda f: (time.sleep(0.002), f.value()[0].sum())[1])
        assert work.wait() is True
        assert summed.wait().item() == 65536 * n


def check_coalescing(ctx):
    n, rank = ctx.world_size, ctx.rank
    # Fast-path coalescing: one allreduce_coalesced / *_coalesced call, mixed dtypes.
    tensors = [torch.full((k,), rank + 1, dtype=dt) for k, dt in [(3, torch.float32), (8191, torch.int64), (1, torch.bfloat16)]]
    with dist._coalescing_manager():
        for t in tensors:
            dist.all_reduce(t)
    for t in tensors:
        assert torch.all(t == n * (n + 1) // 2), t
    outs = [torch.empty(k * n, dtype=dt) for k, dt in [(5, torch.float16), (0, torch.float32), (4096, torch.int32)]]
    ins = [pattern(rank, o.numel() // n, o.dtype) for o in outs]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for o in outs:
        k = o.numel() // n
        assert_equal(o, torch.cat([pattern(r, k, o.dtype) for r in range(n)]), "coalesced all_gather")
    rs_in = [make_input(rank, k * n, torch.float32, "SUM") for k in (1, 3, 1000)]
    rs_out = [torch.empty(k) for k in (1, 3, 1000)]
    with dist._coalescing_manager():
        for o, i in zip(rs_out, rs_in):
            dist.reduce_scatter_tensor(o, i)
    for o, k in zip(rs_out, (1, 3, 1000)):
        full = expected_reduction([make_input(r, k * n, torch.float32, "SUM") for r in range(n)], "SUM", torch.float32, n)
        assert_equal(o, full[rank * k:(rank + 1) * k], "coalesced reduce_scatter")
    # Device-style coalescing (startCoalescing/endCoalescing) around p2p.
    right, left = (rank + 1) % n, (rank - 1) % n
    incoming = torch.empty(7)
    with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.isend(torch.full((7,), float(rank)), right)
        dist.irecv(incoming, left)
    cm.wait()
    assert torch.all(incoming == left)
    # The deprecated list API still reaches allreduce_coalesced.
    tensors = [torch.ones(3), torch.ones(5)]
    dist.all_reduce_coalesced(tensors)
    assert all(torch.all(t == n) for t in tensors)


def check_object_collectives(ctx):
    n, rank = ctx.world_size, ctx.rank
    gathered = [None] * n
    dist.all_gather_object(gathered, {"rank": rank, "payload": "x" * (rank * 1000)})
    assert [g["rank"] for g in gathered] == list(range(n))
    assert [len(g["payload"]) for g in gathered] == [r * 1000 for r in range(n)]
    objects = [("hello", rank), list(range(rank + 3))]
    dist.broadcast_object_list(objects, src=n - 1)
    assert objects == [("hello", n - 1), list(range(n + 2))]


def check_groups_in_flight(ctx):
    """Ops on several groups at once (subgroups, a 2-D mesh) never cross."""
    n, rank = ctx.world_size, ctx.rank
    member_lists = [[r for r in range(n) if r % 2 == parity] for parity in (0, 1)]
    groups = [dist.new_group(ranks) for ranks in member_lists if ranks]
    mine = groups[rank % 2]
    members = member_lists[rank % 2]
    world_t = torch.full((20000,), float(rank))
    sub_t = torch.full((20000,), float(rank) * 10)
    works = []
    for _ in range(3):
        works.append(dist.all_reduce(world_t, async_op=True))
        works.append(dist.all_reduce(sub_t, group=mine, async_op=True))
    for w in works:
        w.wait()
    assert torch.all(world_t == sum(range(n)) * n ** 2), world_t[0]
    assert torch.all(sub_t == sum(10 * m for m in members) * len(members) ** 2), sub_t[0]
    for group in groups:
        dist.destroy_process_group(group)
    if n == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for dim in ("dp", "tp"):
            group = mesh.get_group(dim)
            assert group._get_backend(torch.device("cpu")).name() == "fsdp_ext"
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)
            peers = dist.get_process_group_ranks(group)
            assert t.item() == sum(peers), (dim, peers, t)
    from torch.distributed.device_mesh import init_device_mesh

    mesh1d = init_device_mesh("cpu", (n,))
    t = torch.ones(3)
    dist.all_reduce(t, group=mesh1d.get_group())
    assert torch.all(t == n)


def check_threads_per_group(ctx):
    """Each group runs one progress thread of its own; what posts the groups'
    activity for timeout reports is one thread for the whole process."""
    def threads():
        return len(os.listdir("/proc/self/task"))

    def group_with_an_op():
        group = dist.new_group(backend="fsdp_ext")
        dist.all_reduce(torch.ones(3), group=group)  # backends are made on first use
        return group

    dist.destroy_process_group(group_with_an_op())  # anything started once per process
    before = threads()
    groups = [group_with_an_op() for _ in range(3)]
    added = threads() - before
    for group in groups:
        dist.destroy_process_group(group)
    assert added == 3, f"3 groups added {added} threads"


def check_barrier_orders_ops(ctx):
    # A barrier after async ops completes only after them (FIFO per group).
    t = torch.ones(100000)
    work = dist.all_reduce(t, async_op=True)
    dist.barrier()
    assert work.is_completed()
    assert torch.all(t == ctx.world_size)


@pytest.mark.parametrize(
    "check",
    [
        check_all_reduce,
        check_reduce,
        check_reduce_scatter,
        check_all_gather,
        check_broadcast,
        check_gather_scatter,
        check_all_to_all,
        check_point_to_point,
        check_async_work_and_futures,
        check_coalescing,
        check_object_collectives,
        check_groups_in_flight,
        check_threads_per_group,
        check_barrier_orders_ops,
    ],
    ids=lambda f: f.__name__.removeprefix("check_"),
)
def test_collective(pool, check):
    pool.run(check)


def check_wait_holding_the_gil(ctx):
    """Note [wait() returns once the engine let go]: a wait() whose caller
    holds the GIL returns at completion instead of waiting for the progress
    thread's release, because that thread first runs the future's Python
    callback, which needs the GIL. Waiting for the release there deadlocks
    (the call's time limit fails the test)."""
    from torch_fsdp_ext import _C

    n = ctx.world_size
    for attempt in range(3):
        big = torch.ones(65536)  # large enough to complete on the progress thread
        # An op waited for with the GIL released: the progress thread has then
        # let go of everything earlier (the last attempt's callback, whose
        # disposal takes the GIL too). Otherwise it may still be waiting for
        # the GIL to do so while this thread holds it waiting for the next
        # op, which the progress thread never gets to: the hazard the Note
        # leaves to the caller, not the one tested here. (A barrier runs on
        # the small-op channel without the progress thread.)
        dist.all_reduce(torch.ones(65536))
        if ctx.rank != 0:
            time.sleep(0.2)  # rank 0's op is still in flight when it waits
        work = dist.all_reduce(big, async_op=True)
        ran = []
        chained = work.get_future().then(lambda f: (ran.append(attempt), f.value()[0].sum())[1])
        assert _C._wait_holding_gil_for_tests(work) is True
        assert chained.wait().item() == 65536 * n
        assert ran == [attempt], ran


def test_wait_holding_the_gil_returns_at_completion(pool2):
    pool2.run(check_wait_holding_the_gil, timeout=30)


def check_average_is_sum_then_divide(ctx):
    """AVG is SUM followed by torch's div_ by the group size, bit for bit (a
    multiply by the reciprocal rounds differently in a group of 3), so an FSDP
    runtime that sums then divides and one that asks for AVG agree exactly."""
    n = ctx.world_size
    for algorithm in forced_algorithms():
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            for numel in (1, 3, 8191, 100003):
                g = torch.Generator().manual_seed(1000 * ctx.rank + numel)
                data = torch.randn(n * numel, generator=g).to(dtype)
                label = f"{algorithm} {dtype} n={numel}"
                summed, averaged = data.clone(), data.clone()
                dist.all_reduce(summed, op=dist.ReduceOp.SUM)
                dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
                assert torch.equal(averaged, summed.div_(n)), f"all_reduce {label}"
                summed, averaged = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
                dist.reduce_scatter_tensor(summed, data, op=dist.ReduceOp.SUM)
                dist.reduce_scatter_tensor(averaged, data, op=dist.ReduceOp.AVG)
                assert torch.equal(averaged, summed.div_(n)), f"reduce_scatter_tensor {label}"


def test_average_is_sum_then_divide_ws3():
    get_pool(3).run(check_average_is_sum_then_divide)


def test_algorithm_selection_by_size_and_override(monkeypatch):
    """Sizes pick the algorithm; the environment variables force one."""
    from torch_fsdp_ext import _C

    for variable in ALGORITHM_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    mib = 1 << 20
    # Groups on one host: shared memory from 32 KiB, UCX messages below.
    assert _C._selected_algorithm("all_gather_into_tensor", 32 << 10, 2) == "shm"
    assert _C._selected_algorithm("all_gather_into_tensor", (32 << 10) - 4, 4) == "direct"
    for op in ("reduce_scatter_tensor", "all_reduce", "broadcast"):
        assert _C._selected_algorithm(op, mib, 4) == "shm"
    # Groups without shared memory: UCX messages only.
    assert _C._selected_algorithm("all_gather_into_tensor", mib, 4, False) == "ring"
    assert _C._selected_algorithm("all_gather_into_tensor", mib - 4, 4, False) == "direct"
    assert _C._selected_algorithm("reduce_scatter_tensor", mib, 2, False) == "direct"
    assert _C._selected_algorithm("all_reduce", 64 << 10, 4, False) == "direct"
    assert _C._selected_algorithm("all_reduce", (64 << 10) + 4, 2, False) == "ring"
    assert _C._selected_algorithm("broadcast", mib, 8, False) == "direct"
    assert _C._selected_algorithm("broadcast", 8, 9, False) == "ring"
    monkeypatch.setenv("FSDP_EXT_ALLREDUCE_ALGO", "shm")
    assert _C._selected_algorithm("all_reduce", 8, 2) == "shm"
    assert _C._selected_algorithm("all_reduce", 8, 2, False) == "direct"
    monkeypatch.setenv("FSDP_EXT_BROADCAST_ALGO", "ring")
    assert _C._selected_algorithm("broadcast", 8, 2) == "ring"
    monkeypatch.setenv("FSDP_EXT_ALLGATHER_ALGO", "ring")
    assert _C._selected_algorithm("all_gather_into_tensor", 8, 2) == "ring"
    monkeypatch.setenv("FSDP_EXT_REDUCE_SCATTER_ALGO", "direct")
    assert _C._selected_algorithm("reduce_scatter_tensor", 64 * mib, 8) == "direct"
    with pytest.raises(ValueError, match="unknown op"):
        _C._selected_algorithm("all_to_all", 8, 2)
