"""What torch's own tools expect of a c10d backend, checked against gloo.

gloo is the reference for a CPU backend: each test runs the same thing on an
fsdp_ext group and on a gloo group over the same ranks and compares.
Covered: debug mode (TORCH_DISTRIBUTED_DEBUG's sequence numbers and
collective checks), profiler records with input shapes, sparse all-reduce
(and DDP over a sparse embedding), allgather_coalesced, the group's options
and splits, collectives timing, and the monitored barrier.
"""

import datetime

import pytest
import torch
import torch.distributed as dist

import torch_fsdp_ext
from torch_fsdp_ext import _compat
from conftest import get_pool

CPU = torch.device("cpu")


def _backend(group=None):
    return (group or dist.group.WORLD)._get_backend(CPU)


# ------------------------------------------------------------ sequence numbers


def check_sequence_numbers(ctx):
    group = dist.new_group()
    backend = _backend(group)
    start = backend._get_sequence_number_for_group()
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    dist.broadcast(t, 0, group=group)
    dist.barrier(group=group)
    after = backend._get_sequence_number_for_group()
    # Point-to-point ops are not collectives: the number stays.
    if ctx.rank == 0:
        dist.send(t, 1, group=group)
    else:
        dist.recv(t, 0, group=group)
    unchanged = backend._get_sequence_number_for_group()
    numbers = [None] * ctx.world_size
    dist.all_gather_object(numbers, after)
    dist.destroy_process_group(group)
    return start, after, unchanged, numbers


def test_sequence_numbers_count_collectives_alike_on_every_rank(pool2):
    for start, after, unchanged, numbers in pool2.run(check_sequence_numbers):
        assert start == 0
        assert after == 3, f"3 collectives issued, sequence number {after}"
        assert unchanged == after
        assert numbers == [3, 3]


def check_debug_mode(ctx, level):
    """Under TORCH_DISTRIBUTED_DEBUG, as on gloo: groups are made, collectives
    run, and (DETAIL) ranks calling different ops or shapes get torch's
    collective-mismatch error instead of a hang or wrong data."""
    assert dist.get_debug_level() == getattr(dist.DebugLevel, level)
    results = {}
    for name, backend in (("fsdp_ext", "fsdp_ext"), ("gloo", "gloo")):
        group = dist.new_group(backend=backend)
        wrapped = type(_backend(group)).__name__
        t = torch.full((4,), float(ctx.rank + 1))
        dist.all_reduce(t, group=group)
        subgroup = dist.new_group(ranks=[0, 1], backend=backend)
        s = torch.ones(2)
        dist.all_reduce(s, group=subgroup)
        errors = []
        if level == "DETAIL":
            shape = (3,) if ctx.rank == 0 else (4,)
            try:
                dist.all_reduce(torch.ones(shape), group=group)
            except RuntimeError as error:
                errors.append(str(error))
            try:
                if ctx.rank == 0:
                    dist.all_reduce(torch.ones(3), group=group)
                else:
                    dist.broadcast(torch.ones(3), 0, group=group)
            except RuntimeError as error:
                errors.append(str(error))
            # After the caught mismatches the group still works.
            u = torch.ones(5)
            dist.all_reduce(u, group=group)
            errors.append(u.tolist())
        results[name] = (wrapped, t.tolist(), s.tolist(), errors)
    return results


@pytest.mark.parametrize("level", ["DETAIL", "INFO"])
def test_debug_mode_works_as_on_gloo(level):
    pool = get_pool(2, TORCH_DISTRIBUTED_DEBUG=level)
    for rank, results in enumerate(pool.run(check_debug_mode, level)):
        ours, gloo = results["fsdp_ext"], results["gloo"]
        assert ours[1] == gloo[1] == [3.0] * 4
        assert ours[2] == gloo[2] == [2.0, 2.0]
        if level == "DETAIL":
            assert ours[0] == gloo[0] == "_ProcessGroupWrapper"
            shape_error, op_error, after = ours[3]
            assert "Detected mismatch between collectives" in shape_error, shape_error
            assert "Tensor Tensor shapes" in shape_error or "shape" in shape_error.lower()
            assert "BROADCAST" in op_error and "ALLREDUCE" in op_error, op_error
            assert after == [2.0] * 5
            assert len(gloo[3]) == 3
        else:
            assert ours[0] == "FsdpExtBackend"


# ------------------------------------------------------------------- profiler


def _profiled(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        fn()
    return prof.events()


def check_profiler_shapes(ctx, group_name):
    ws, rank = ctx.world_size, ctx.rank
    group = None if group_name == "fsdp_ext" else ctx.gloo_group
    t = torch.ones(3, 2)
    outs = [torch.empty(3, 2) for _ in range(ws)]
    flat = torch.empty(3 * ws, 2)
    ops = {
        "all_reduce": lambda: dist.all_reduce(t, group=group),
        "broadcast": lambda: dist.broadcast(t, 0, group=group),
        "reduce": lambda: dist.reduce(t, 0, group=group),
        "all_gather": lambda: dist.all_gather(outs, t, group=group),
        "gather": lambda: dist.gather(t, outs if rank == 0 else None, 0, group=group),
        "scatter": lambda: dist.scatter(t, outs if rank == 0 else None, 0, group=group),
        "all_to_all": lambda: dist.all_to_all([o.clone() for o in outs],
                                              [o.clone() for o in outs], group=group),
        "all_to_all_single": lambda: dist.all_to_all_single(flat, flat.clone(), group=group),
        "barrier": lambda: dist.barrier(group=group),
        "send_recv": lambda: (dist.send(t, 1, group=group) if rank == 0
                              else dist.recv(t, 0, group=group) if rank == 1 else None),
        "all_gather_coalesced": lambda: dist.all_gather_coalesced(
            [[torch.empty(2), torch.empty(3, 1)] for _ in range(ws)],
            [torch.ones(2), torch.ones(3, 1)], group=group),
    }
    seen = {}
    for name, fn in ops.items():
        try:
            events = [e for e in _profiled(fn) if e.name.startswith(group_name + ":")]
        except RuntimeError as error:
            if group_name != "gloo" or "does not support" not in str(error):
                raise
            seen[name] = None  # this torch's gloo lacks the op (2.11's alltoall)
            continue
        seen[name] = [(e.input_shapes, e.input_dtypes if hasattr(e, "input_dtypes") else None)
                      for e in events]
    return seen


def test_profiler_records_carry_input_shapes_as_gloo_does(pool2):
    ours = pool2.run(check_profiler_shapes, "fsdp_ext")
    gloo = pool2.run(check_profiler_shapes, "gloo")
    for rank in range(2):
        for op, records in gloo[rank].items():
            if records is None:
                continue
            assert ours[rank][op] == records, (
                f"rank {rank} {op}: fsdp_ext {ours[rank][op]} vs gloo {records}")
        # Something is compared: shapes appear at all.
        assert ours[rank]["all_reduce"][0][0] == [[3, 2]]


# ------------------------------------------------------------ sparse all-reduce


def _sparse_input(rank, size, nnz, dense=()):
    """Rank-dependent COO tensor with repeated indices (not coalesced)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    indices = torch.randint(0, size, (1, nnz), generator=gen)
    values = torch.randn((nnz,) + tuple(dense), generator=gen)
    return torch.sparse_coo_tensor(indices, values, (size,) + tuple(dense))


def check_sparse_allreduce(ctx):
    cases = [(1, 1, ()), (3, 0, ()), (8191, 37, ()), (5, 4, (3,))]
    results = []
    for size, nnz, dense in cases:
        nnz_here = nnz + ctx.rank  # uneven across ranks
        ours = _sparse_input(ctx.rank, size, nnz_here, dense)
        gloo = _sparse_input(ctx.rank, size, nnz_here, dense)
        work = dist.all_reduce(ours, async_op=True)
        work.wait()
        dist.all_reduce(gloo, group=ctx.gloo_group)
        result = work.result()[0]
        results.append((
            torch.equal(ours._indices(), gloo._indices()),
            torch.equal(ours._values(), gloo._values()),
            ours.is_coalesced() == gloo.is_coalesced(),
            result is not None and torch.equal(result.to_dense(), gloo.to_dense()),
            ours._nnz(),
        ))
    errors = []
    try:
        dist.all_reduce(_sparse_input(ctx.rank, 4, 2), op=dist.ReduceOp.MAX)
    except ValueError as error:
        errors.append(str(error))
    return results, errors


def test_sparse_allreduce_matches_gloo_bitwise(pool2):
    for rank, (results, errors) in enumerate(pool2.run(check_sparse_allreduce)):
        for same_indices, same_values, same_coalesced, same_result, nnz in results:
            assert same_indices and same_values and same_coalesced and same_result
        assert any(nnz > 0 for *_, nnz in results)
        assert len(errors) == 1 and "fsdp_ext all_reduce" in errors[0]
        assert f"rank {rank}/2" in errors[0] and "ReduceOp.SUM" in errors[0]
        assert errors[0].endswith("got ReduceOp.MAX"), errors[0]


def check_sparse_shape_mismatch(ctx):
    # On a group of its own: the failed op leaves its group unusable, and the
    # pool's default group serves later tests.
    group = dist.new_group()
    size = 4 if ctx.rank == 0 else 5
    try:
        dist.all_reduce(_sparse_input(ctx.rank, size, 2), group=group)
    except dist.DistBackendError as error:
        return str(error)
    finally:
        dist.destroy_process_group(group)
    return None


def test_sparse_allreduce_names_a_rank_whose_shape_differs(pool2_without_small_ops):
    messages = pool2_without_small_ops.run(check_sparse_shape_mismatch)
    for rank, message in enumerate(messages):
        assert message is not None
        assert "sizes [4]" in message and "sizes [5]" in message, message


def train_sparse_embedding(ctx):
    """DDP over nn.Embedding(sparse=True), the same model and data over
    fsdp_ext and over gloo: the parameters after training, per backend."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    final = {}
    for name, group in (("fsdp_ext", None), ("gloo", ctx.gloo_group)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True),
                                    torch.nn.Linear(8, 1))
        ddp = DDP(model, process_group=group)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(ctx.rank)
        for _ in range(4):
            ids = torch.randint(0, 50, (6, 3), generator=gen)
            loss = ddp(ids).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        final[name] = [p.detach().clone() for p in model.parameters()]
    return [torch.equal(a, b) for a, b in zip(final["fsdp_ext"], final["gloo"])]


def test_ddp_with_sparse_embedding_trains_bitwise_as_over_gloo(pool2):
    for same in pool2.run(train_sparse_embedding):
        assert same == [True, True, True]


# --------------------------------------------------------- allgather_coalesced


def check_allgather_coalesced(ctx):
    ws = ctx.world_size
    # torch's Python wants one dtype across the list.
    inputs = [torch.arange(n, dtype=torch.int64) + 100 * ctx.rank for n in (1, 3, 8191)]
    outputs = [[torch.empty_like(t) for t in inputs] for _ in range(ws)]
    dist.all_gather_coalesced(outputs, inputs)
    ok = all(torch.equal(outputs[r][i], torch.arange(t.numel(), dtype=t.dtype) + 100 * r)
             for r in range(ws) for i, t in enumerate(inputs))
    try:
        dist.all_gather_coalesced([[torch.empty(2)] for _ in range(ws)], [torch.ones(3)])
    except ValueError as error:
        return ok, str(error)
    return ok, None


def test_allgather_coalesced(pool):
    for rank, (ok, error) in enumerate(pool.run(check_allgather_coalesced)):
        assert ok
        assert error is not None and "fsdp_ext all_gather_coalesced" in error, error
        assert "expected 3 elements but got 2" in error


# ------------------------------------------------------ options, split, timing


def check_options_and_split(ctx):
    world = dist.group.WORLD
    options = _backend().options
    facts = {"backend": options.backend, "timeout": options._timeout,
             "supports_splitting": _backend().supports_splitting}
    # Every rank in a group of its own, then the whole group again (as gloo).
    single = world.split_group([ctx.rank], group_name=f"single_{ctx.rank}")
    t = torch.full((2,), float(ctx.rank))
    dist.all_reduce(t, group=single)
    facts["single"] = (single.size(), t.tolist())
    pair = world.split_group(list(range(ctx.world_size)), group_name="pair_split",
                             timeout=datetime.timedelta(seconds=45))
    u = torch.full((2,), float(ctx.rank + 1))
    dist.all_reduce(u, group=pair)
    facts["pair"] = (pair.size(), pair.rank(), u.tolist(), _backend(pair).options._timeout,
                     type(_backend(pair)).__name__)
    return facts


def test_backend_options_and_split_group(pool2):
    for rank, facts in enumerate(pool2.run(check_options_and_split)):
        assert facts["backend"] == "fsdp_ext"
        assert facts["timeout"] == datetime.timedelta(seconds=120)
        assert facts["supports_splitting"] is True
        assert facts["single"] == (1, [float(rank)] * 2)
        assert facts["pair"] == (2, rank, [3.0, 3.0], datetime.timedelta(seconds=45),
                                 "FsdpExtBackend")


def check_collectives_timing(ctx):
    group = dist.new_group()
    untimed = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    untimed.wait()
    try:
        untimed._get_duration()
        untimed_error = None
    except RuntimeError as error:
        untimed_error = str(error)
    group._enable_collectives_timing()
    durations = []
    for numel in (1, 1 << 20):
        work = dist.all_reduce(torch.ones(numel), group=group, async_op=True)
        work.wait()
        durations.append(work._get_duration())
    dist.destroy_process_group(group)
    return untimed_error, durations


def test_collectives_timing(pool2):
    for error, durations in pool2.run(check_collectives_timing):
        assert error is not None and "enableCollectivesTiming" in error
        assert all(d > 0 for d in durations), durations
        assert durations[1] < 60_000


# ------------------------------------------------------------ monitored barrier


def check_monitored_barrier(ctx):
    group = dist.new_group()
    torch_fsdp_ext.monitored_barrier(group, timeout=datetime.timedelta(seconds=30))
    try:
        dist.monitored_barrier(group)
        torch_refuses = None
    except ValueError as error:
        torch_refuses = str(error)
    # Rank 1 stays away: rank 0 names it, within the timeout.
    failing = dist.new_group()
    error = None
    if ctx.rank != 1:
        try:
            torch_fsdp_ext.monitored_barrier(failing, timeout=datetime.timedelta(seconds=2),
                                             wait_all_ranks=True)
        except RuntimeError as caught:
            error = str(caught)
    dist.barrier()
    on_gloo = torch_fsdp_ext.monitored_barrier(ctx.gloo_group)
    return torch_refuses, error, on_gloo


def test_monitored_barrier_names_missing_ranks(pool):
    results = pool.run(check_monitored_barrier)
    world_size = len(results)
    for rank, (torch_refuses, error, on_gloo) in enumerate(results):
        if _compat.MONITORED_BARRIER_TAKES_ANY_CPU_BACKEND:
            assert torch_refuses is None, torch_refuses  # torch's reached ours, which passed
        else:
            assert torch_refuses is not None and "GLOO" in torch_refuses
        assert on_gloo is None
        if world_size == 1 or rank == 1:
            assert error is None
            continue
        assert error is not None and "fsdp_ext monitored_barrier" in error, error
        assert "Rank 1 failed to pass monitoredBarrier in 2000 ms" in error, error


# -------------------------------------------------------------- Flight Recorder


def check_flight_recorder(ctx):
    """A few ops, then rank 0 enters an all-reduce that rank 1 never calls:
    rank 0's times out and writes its dump; rank 1 writes its own on request."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    dist.all_gather_into_tensor(torch.empty(4 * ctx.world_size), t, group=group)
    if ctx.rank == 0:
        dist.send(t, 1, group=group)
    else:
        dist.recv(t, 0, group=group)
    recorded = torch_fsdp_ext.dump_flight_recorder(write=False)
    error = path = None
    if ctx.rank == 0:
        try:
            dist.all_reduce(torch.ones(8), group=group)
        except RuntimeError as caught:
            error = str(caught)
    else:
        # Before any later op, so that both dumps end at the same point.
        path = torch_fsdp_ext.dump_flight_recorder()
    dist.barrier()
    entries = [(e["profiling_name"], e["collective_seq_id"], e["state"], e["input_sizes"])
               for e in recorded["entries"]]
    return entries, recorded["version"], list(recorded["pg_config"].values()), error, path


def check_dump_to_a_missing_directory(ctx):
    dist.all_reduce(torch.ones(3))
    with pytest.raises(RuntimeError) as info:
        torch_fsdp_ext.dump_flight_recorder()
    return str(info.value)


def test_flight_recorder_dump_that_cannot_be_written_is_an_error(tmp_path):
    """torch's writer only logs a file it cannot open; the dump on request
    says so instead of returning a path where nothing is."""
    prefix = str(tmp_path / "no_such_directory" / "trace_")
    pool = get_pool(1, TORCH_FR_BUFFER_SIZE="100", TORCH_FR_DUMP_TEMP_FILE=prefix)
    message = pool.run(check_dump_to_a_missing_directory)[0]
    pool.kill()
    assert message.startswith("torch_fsdp_ext.dump_flight_recorder (rank 0): "), message
    assert f"could not be written to {prefix}0" in message, message


def test_flight_recorder_dumps_are_read_by_torchs_fr_trace(tmp_path):
    import subprocess
    import sys

    prefix = str(tmp_path / "fsdp_ext_trace_")
    pool = get_pool(2, TORCH_FR_BUFFER_SIZE="100", TORCH_FR_DUMP_TEMP_FILE=prefix)
    results = pool.run(check_flight_recorder)
    for rank, (entries, version, pg_config, error, path) in enumerate(results):
        assert version == "2.10"
        names = [name for name, *_ in entries]
        assert names[-3:] == ["gloo:all_reduce", "gloo:_all_gather_base",
                              "gloo:send 0->1" if rank == 0 else "gloo:recv 1<-0"], names
        assert all(state == "completed" for *_, state, _ in entries[-3:])
        assert entries[-3][3] == [[4]]
        assert {"name", "desc", "ranks"} <= set(pg_config[0])
        if rank == 0:
            assert error is not None and "timed out" in error.lower(), error
        else:
            assert path == prefix + "1"
    pool.kill()
    import inspect

    from torch.distributed.flight_recorder.components import types as fr_types

    # The libraries fr_trace accepts are a set inside its Op class (torch 2.11's
    # knows NCCL and XCCL only; 2.13's gloo too): read it where it is written.
    if '"gloo"' not in inspect.getsource(fr_types.Op):
        pytest.skip(f"the dumps are checked above; torch {torch.__version__}'s fr_trace reads "
                    "only NCCL and XCCL entries, not gloo's")
    analysis = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path),
         "--prefix", "fsdp_ext_trace_"],
        capture_output=True, text=True, timeout=120)
    report = analysis.stdout + analysis.stderr
    assert analysis.returncode == 0, report
    # fr_trace names the op where the ranks parted and the rank that is missing.
    assert "all_reduce" in report and "[8]" in report, report
    assert "Not all ranks joining collective" in report and "missing ranks: {1}" in report, report
    # Every group's ranks are in the dumps (no group reported with no ranks).
    assert report.count("Not all ranks joining") == 1 and "world size: 0" not in report, report
