"""Bad input raises a clear Python exception naming op, group and rank;
a missing peer becomes a timeout error; shutdown and exit are clean."""

import datetime
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_script_ranks


def expect_error(exc_type, fragments, fn):
    with pytest.raises(exc_type) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def check_bad_input(ctx):
    n, rank = ctx.world_size, ctx.rank
    where = [f"rank {rank}/{n}", "group '"]
    expect_error(ValueError, ["all_gather_into_tensor", "world_size"] + where,
                 lambda: dist.all_gather_into_tensor(torch.empty(n * 3 + 1), torch.empty(3)))
    expect_error(ValueError, ["reduce_scatter_tensor"] + where,
                 lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.empty(2 * n + 1)))
    expect_error(TypeError, ["all_gather_into_tensor", "dtype"] + where,
                 lambda: dist.all_gather_into_tensor(torch.empty(n, dtype=torch.float64), torch.empty(1)))
    expect_error(ValueError, ["all_gather", "one per rank"] + where,
                 lambda: dist.all_gather([torch.empty(1)] * (n + 1), torch.empty(1)))
    expect_error(TypeError, ["all_reduce", "BAND", "torch.float32"] + where,
                 lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND))
    expect_error(TypeError, ["all_reduce", "AVG", "torch.int64"] + where,
                 lambda: dist.all_reduce(torch.ones(4, dtype=torch.int64), op=dist.ReduceOp.AVG))
    expect_error(TypeError, ["all_reduce", "torch.int16", "not supported"] + where,
                 lambda: dist.all_reduce(torch.ones(4, dtype=torch.int16)))
    expect_error(ValueError, ["all_reduce", "not contiguous"] + where,
                 lambda: dist.all_reduce(torch.ones(4, 4).t()))
    expect_error(ValueError, ["broadcast", "root"] + where,
                 lambda: ctx_group_call(lambda: dist.broadcast(torch.ones(2), src=n + 3)))
    expect_error(ValueError, ["all_to_all_single", "split sizes"] + where,
                 lambda: dist.all_to_all_single(torch.empty(n), torch.empty(n), [1] * n, [2] * n))
    if n > 1:
        expect_error(ValueError, ["all_to_all_single", "does not divide"] + where,
                     lambda: dist.all_to_all_single(torch.empty(n * 2 + 1), torch.empty(n * 2 + 1)))
    # gather/scatter root lists, through the backend (dist.gather would leave
    # the other ranks waiting for the root that raised).
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    gather_opts, scatter_opts = dist.GatherOptions(), dist.ScatterOptions()
    gather_opts.rootRank = scatter_opts.rootRank = 0
    t = torch.ones(2)
    if rank == 0:
        expect_error(ValueError, ["gather", "one per rank"] + where,
                     lambda: backend.gather([[t] * (n + 1)], [t], gather_opts))
        expect_error(ValueError, ["scatter", "one per rank"] + where,
                     lambda: backend.scatter([t], [[t] * (n + 1)], scatter_opts))
        expect_error(ValueError, ["gather", "each output must match the input"] + where,
                     lambda: backend.gather([[torch.ones(3)] * n], [t], gather_opts))
    else:
        expect_error(ValueError, ["gather", "only the root (rank 0)"] + where,
                     lambda: backend.gather([[t] * n], [t], gather_opts))
        expect_error(ValueError, ["scatter", "only the root (rank 0)"] + where,
                     lambda: backend.scatter([t], [[t] * n], scatter_opts))
    # The group is still healthy after rejected calls: nothing reached the wire.
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.all(t == n)


def ctx_group_call(fn):
    """dist.broadcast checks src against the world first; call the backend
    directly so our own root check is exercised."""
    group = dist.group.WORLD
    backend = group._get_backend(torch.device("cpu"))
    opts = dist.BroadcastOptions()
    opts.rootRank = group.size() + 3
    return backend.broadcast([torch.ones(2)], opts)


def check_meta_tensor(ctx):
    """torch's own Meta kernel turns c10d ops on meta tensors into shape-only
    no-ops before any backend runs (gloo alike); a direct backend call must
    still be refused rather than dereferencing a data pointer that is not there."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    message = expect_error(ValueError, ["all_reduce", "meta tensor", f"rank {ctx.rank}"],
                           lambda: backend.allreduce([torch.empty(4, device="meta")], dist.AllreduceOptions()))
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.all(t == ctx.world_size)
    return message


def check_mismatched_sizes_across_ranks(ctx, base, op):
    """Ranks disagreeing on sizes get an error, not corrupted memory."""
    n, rank = ctx.world_size, ctx.rank
    group = dist.new_group(timeout=datetime.timedelta(seconds=10))
    numel = base + (1 if rank == 0 else 0)
    with pytest.raises(dist.DistBackendError) as info:
        if op == "all_gather":
            dist.all_gather_into_tensor(torch.empty(numel * n), torch.ones(numel), group=group)
        elif op == "all_reduce":
            dist.all_reduce(torch.ones(numel), group=group)
        else:
            dist.reduce_scatter_tensor(torch.empty(numel), torch.ones(numel * n), group=group)
    dist.destroy_process_group(group)
    return str(info.value)


def check_timeout(ctx, numel):
    """Only rank 0 enters the collective; it must fail within the timeout.
    Rank 0 checks what it saw only after both ranks are past the broken group,
    so a failed check is reported rather than leaving rank 1 waiting."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    # Three small ops both ranks run (on the small-op channel where the group
    # has one): what rank 1 was last doing is the third of them.
    for _ in range(3):
        dist.all_reduce(torch.ones(3), group=group)
    message = refusal = elapsed = None
    if ctx.rank == 0:
        start = datetime.datetime.now()
        try:
            dist.all_reduce(torch.ones(numel), group=group)
        except dist.DistBackendError as error:
            message = str(error)
        elapsed = (datetime.datetime.now() - start).total_seconds()
        # The broken group refuses further work instead of mismatching tags.
        try:
            dist.all_reduce(torch.ones(8), group=group)
        except dist.DistBackendError as error:
            refusal = str(error)
    dist.barrier(group=ctx.gloo_group)
    dist.destroy_process_group(group)
    # The default group is unaffected.
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.all(t == ctx.world_size)
    if ctx.rank == 0:
        assert message is not None, "all_reduce returned although rank 1 never entered it"
        assert "timed out" in message and "rank 1" in message and "all_reduce" in message, message
        # What the missing peer was doing, read from the store, not from it.
        assert "Peers not in this op: rank 1 (host " in message, message
        assert "not in any collective (the last one it began: all_reduce op #4)" in message, message
        assert 2.5 <= elapsed < 20, elapsed
        assert refusal is not None and "unusable" in refusal, refusal
    return message


def test_bad_input(pool):
    pool.run(check_bad_input)


def check_no_cuda_buffers_without_a_gpu(ctx):
    from torch_fsdp_ext import _build_info

    # Entering a FakeTensorMode (as torch.compile, DTensor and FSDP's memory
    # tools do) on a machine without a GPU swaps c10's CUDA device guard for
    # a fake one with eight devices, which must not make the group think
    # there is a cuda:0.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        pass
    be = dist.group.WORLD._get_backend(torch.device("cpu"))
    cuda0 = torch.device("cuda", 0)
    where = [f"rank {ctx.rank}/{ctx.world_size}", "allocate_tensor"]
    assert not be.supports_tensor_alloc(cuda0)
    if not _build_info.WITH_CUDA:
        expect_error(NotImplementedError, ["a CUDA device, but this build of torch_fsdp_ext has "
                                           "no CUDA path"] + where,
                     lambda: be.allocate_tensor(4, dtype=torch.float32, device=cuda0))
    else:
        expect_error(RuntimeError, ["no cuda:0", "supports_tensor_alloc"] + where,
                     lambda: be.allocate_tensor(4, dtype=torch.float32, device=cuda0))
    return True


@pytest.mark.skipif(torch.cuda.is_available(), reason="test_cuda.py checks buffers on a GPU")
def test_no_cuda_buffers_without_a_gpu(pool2):
    """A group that cannot hand out device buffers says so: not offered,
    and allocate_tensor names why (a build without the CUDA path, or a CUDA
    build on a machine without a GPU)."""
    assert pool2.run(check_no_cuda_buffers_without_a_gpu) == [True, True]


def test_meta_tensor_rejected(pool2):
    messages = pool2.run(check_meta_tensor)
    assert all(m for m in messages)


def test_size_mismatch_between_ranks(pool2_without_small_ops):
    messages = pool2_without_small_ops.run(check_mismatched_sizes_across_ranks, 4, "all_gather")
    # Every rank names the op, the group, itself and the peer whose size differs.
    for rank, message in enumerate(messages):
        assert message.startswith(f"fsdp_ext all_gather_into_tensor (group "), message
        assert f"rank {rank}/2" in message and f"rank {1 - rank} sent" in message, message
        assert "tensor sizes differ between ranks" in message, message


def test_size_mismatch_between_ranks_over_small_op_channel(pool2):
    """Small ops see every rank's op and size: each rank names the other's
    call and its own."""
    messages = pool2.run(check_mismatched_sizes_across_ranks, 4, "all_gather")
    sizes = {0: 20, 1: 16}  # bytes per rank: rank 0 has one more float
    for rank, message in enumerate(messages):
        other = 1 - rank
        assert message.startswith(f"fsdp_ext all_gather_into_tensor (group "), message
        assert f"rank {rank}/2" in message, message
        assert (f"rank {other} called all_gather of {sizes[other]} bytes where rank {rank} "
                f"called all_gather of {sizes[rank]} bytes") in message, message


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_size_mismatch_between_ranks_over_shared_memory(pool2, op):
    """Above the shared-memory threshold the headers carry the sizes: every
    rank names the peer whose size differs."""
    messages = pool2.run(check_mismatched_sizes_across_ranks, 20000, op)
    for rank, message in enumerate(messages):
        assert "differ between ranks" in message and f"rank {1 - rank} has" in message, messages


@pytest.mark.parametrize("numel", [20000, 1 << 19], ids=["staged", "process-reads"])
def test_all_reduce_size_mismatch_is_seen_by_every_rank(pool2, numel):
    """The all-reduce cuts each rank's tensor into blocks at its own
    boundaries, so rank 1's block from rank 0 has the size rank 1 expects
    although rank 0's tensor is one element longer: the headers carry the
    tensors' sizes too, and both ranks name them (rank 1 once read rank 0's
    buffer after rank 0 had given up on the op, and failed on its address)."""
    messages = pool2.run(check_mismatched_sizes_across_ranks, numel, "all_reduce")
    sizes = {0: 4 * (numel + 1), 1: 4 * numel}
    for rank, message in enumerate(messages):
        other = 1 - rank
        assert message.startswith(f"fsdp_ext all_reduce (group "), message
        assert f"rank {rank}/2" in message, message
        assert (f"rank {other}'s tensor 0 has {sizes[other]} bytes where this rank's has "
                f"{sizes[rank]} (tensor sizes differ between ranks)") in message, message


def check_mismatched_reductions(ctx, op):
    """Sizes that agree, reductions that do not: rank 0 reduces bfloat16
    where rank 1 reduces float16 (all_reduce), or averages where rank 1 sums
    (reduce_scatter); 1 MiB per rank, through shared memory."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=10))
    numel = 1 << 19
    with pytest.raises(dist.DistBackendError) as info:
        if op == "all_reduce":
            dtype = torch.bfloat16 if ctx.rank == 0 else torch.float16
            dist.all_reduce(torch.ones(numel, dtype=dtype), group=group)
        else:
            reduce_op = dist.ReduceOp.AVG if ctx.rank == 0 else dist.ReduceOp.SUM
            dist.reduce_scatter_tensor(torch.empty(numel), torch.ones(numel * ctx.world_size),
                                       op=reduce_op, group=group)
    dist.destroy_process_group(group)
    return str(info.value)


@pytest.mark.parametrize("op,reductions", [
    ("all_reduce", {0: "bfloat16 SUM", 1: "float16 SUM"}),
    ("reduce_scatter", {0: "float32 AVG", 1: "float32 SUM"}),
])
def test_reductions_that_differ_between_ranks_are_named(pool2, op, reductions):
    """Every size agrees, so only the reduction can tell: each rank names the
    other's dtype and op and its own, instead of combining the bytes each in
    its own way."""
    for rank, message in enumerate(pool2.run(check_mismatched_reductions, op)):
        other = 1 - rank
        assert f"rank {rank}/2" in message, message
        assert (f"rank {other} reduces tensor 0 as {reductions[other]} where this rank reduces "
                f"it as {reductions[rank]} (the ranks' dtypes or reduce ops differ)") in message, \
            message


def check_different_collectives(ctx):
    """Rank 0 all-reduces where rank 1 all-gathers, 1 MiB each (above the
    small-op channel: through shared memory)."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=10))
    numel = 1 << 18
    with pytest.raises(dist.DistBackendError) as info:
        if ctx.rank == 0:
            dist.all_reduce(torch.ones(numel), group=group)
        else:
            dist.all_gather_into_tensor(torch.empty(2 * numel), torch.ones(numel), group=group)
    dist.destroy_process_group(group)
    return str(info.value)


def test_different_collectives_over_shared_memory_are_named(pool2):
    """Ranks that called different collectives are told so, by name, rather
    than that their sizes differ."""
    messages = pool2.run(check_different_collectives)
    # The shared pieces' headers travel as UCX messages: whichever check sees
    # the other collective first reports it (the headers' own check adds the
    # all-reduce's phase).
    assert messages[0].startswith("fsdp_ext all_reduce (group "), messages
    assert re.search(r"rank 1 (\(host [^)]*\) )?is in an all-gather where this rank is in an "
                     r"all-reduce( \(its first phase\))? \(the ranks called different collectives",
                     messages[0]), messages
    assert messages[1].startswith("fsdp_ext all_gather_into_tensor (group "), messages
    assert re.search(r"rank 0 (\(host [^)]*\) )?is in an all-reduce( \(its first phase\))? where "
                     r"this rank is in an all-gather", messages[1]), messages


def check_different_collectives_of_one_size(ctx):
    """Rank 0 all-reduces 4 KiB where rank 1 receives a 4 KiB broadcast from
    rank 0, then rank 0 all-gathers where rank 1 reduce-scatters, 8 KiB each
    way: sizes that agree, so only the ops' kinds tell them apart."""
    messages = []
    for first, second in ((lambda: dist.all_reduce(torch.ones(1024), group=group),
                           lambda: dist.broadcast(torch.zeros(1024), 0, group=group)),
                          (lambda: dist.all_gather_into_tensor(torch.empty(4096), torch.ones(2048),
                                                               group=group),
                           lambda: dist.reduce_scatter_tensor(torch.empty(2048), torch.ones(4096),
                                                              group=group))):
        group = dist.new_group(timeout=datetime.timedelta(seconds=4))
        start = time.monotonic()
        try:
            (first if ctx.rank == 0 else second)()
            messages.append(None)
        except dist.DistBackendError as error:
            messages.append((str(error), time.monotonic() - start))
        dist.barrier(group=ctx.gloo_group)
        dist.destroy_process_group(group)
    return messages


def test_different_collectives_over_messages_are_named(pool2_without_shared_memory):
    """Over UCX messages (as between hosts) an all-reduce and a broadcast of
    the same size used to exchange their data and return wrong results:
    the receiving rank now names both collectives, within a second."""
    outcomes = pool2_without_shared_memory.run(check_different_collectives_of_one_size)
    # All-reduce against broadcast: the broadcast's receiver holds rank 0's
    # all-reduce message; rank 0 waits for a part rank 1 never sends.
    message, elapsed = outcomes[1][0]
    assert message.startswith("fsdp_ext broadcast (group "), message
    assert "rank 0 (host " in message and ("is in an all-reduce where this rank is in a "
                                          "broadcast (the ranks called different collectives") \
        in message, message
    assert elapsed < 2, elapsed
    # Rank 0 holds no message of rank 1's (a broadcast's receiver sends
    # nothing): it hears of the mismatch from rank 1's failure notice, also
    # within a second or two, not at the group's 4 s timeout.
    assert outcomes[0][0] is not None, "rank 0's all-reduce completed against a broadcast"
    message, elapsed = outcomes[0][0]
    assert message.startswith("fsdp_ext all_reduce (group "), message
    assert "rank 1 (host " in message and "stopped the group after its op #" in message, message
    assert "is in an all-reduce where this rank is in a broadcast" in message, message
    assert elapsed < 2, elapsed
    # All-gather against reduce-scatter: both ranks hold the other's message.
    kinds = ["an all-gather", "a reduce-scatter"]
    for rank in range(2):
        message, elapsed = outcomes[rank][1]
        assert f"is in {kinds[1 - rank]} where this rank is in {kinds[rank]}" in message, message
        assert elapsed < 2, elapsed


@pytest.mark.parametrize("numel", [8, 100000], ids=["small_op_channel", "shared_memory"])
def test_timeout_names_missing_peer(pool2, numel):
    pool2.run(check_timeout, numel)


def test_timeout_names_missing_peer_over_messages(pool2_without_small_ops):
    pool2_without_small_ops.run(check_timeout, 8)


def test_double_import_and_registration():
    code = textwrap.dedent("""
        import importlib, torch.distributed as dist
        import torch_fsdp_ext
        importlib.reload(torch_fsdp_ext)
        torch_fsdp_ext.register_backend()
        assert dist.Backend.backend_list.count("fsdp_ext") == 1
        assert dist.Backend.FSDP_EXT == "fsdp_ext"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


CLEAN_EXIT_SCRIPT = textwrap.dedent("""
    import os, sys, datetime, torch, torch.distributed as dist
    import torch_fsdp_ext
    rank, world, init, destroy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    dist.init_process_group("fsdp_ext", init_method=init, rank=rank, world_size=world)
    sub = dist.new_group()
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    dist.all_reduce(t, group=sub)
    pending = torch.empty(4)
    if rank == 0:
        dist.irecv(pending, src=1, tag=99)  # never matched: must not block exit
    dist.barrier()
    if destroy:
        dist.destroy_process_group()
    print("done", rank, flush=True)
""")


def _sysv_segments_created_by(pids):
    """SysV shared-memory segments (UCX's sysv transport) whose creator is one
    of `pids`: attributed to this test's processes, so other users of the host
    cannot make the check flaky. (Our own segments are memfds, which die with
    their process; nothing of ours appears in /dev/shm.)"""
    table = subprocess.run(["ipcs", "-m", "-p"], capture_output=True, text=True).stdout
    wanted = {str(pid) for pid in pids}
    rows = [line.split() for line in table.splitlines()]
    return [row[0] for row in rows if len(row) >= 4 and row[0].isdigit() and row[2] in wanted]


def _launch_two_ranks(script, tmp_path, init_method, destroy, extra_env=None, bind=False):
    """Runs the two-rank script to completion; (processes, [(returncode,
    stdout, stderr)] per rank). `bind`: each rank bound to one core.

    A rank that fails (rank 0 losing its store port to another process, say)
    leaves its peer retrying the store for minutes: 10 s after the first
    failure, and in any case after 120 s, the ranks still running are killed
    (returncode -9), so the caller sees every rank's output and may retry."""
    cores = sorted(os.sched_getaffinity(0))

    def bound_to_core(r):
        return (lambda: os.sched_setaffinity(0, {cores[r % len(cores)]})) if bind else None

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init = {"tcp": f"tcp://127.0.0.1:{port}", "file": f"file://{tmp_path}/store-{port}",
            "env": "env://"}[init_method]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(extra_env or {}))
    # Output to files, not pipes: the ranks are polled, not drained.
    logs = [(tmp_path / f"rank{r}-{port}.out", tmp_path / f"rank{r}-{port}.err") for r in range(2)]
    procs = []
    for r, (out_path, err_path) in enumerate(logs):
        with open(out_path, "w") as out, open(err_path, "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, str(script), str(r), "2", init, "1" if destroy else "0"],
                env=dict(env, RANK=str(r), WORLD_SIZE="2"), stdout=out, stderr=err,
                preexec_fn=bound_to_core(r)))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        # Every rank polled each pass (no short-circuit): rank 1 failing
        # while rank 0 waits must start the 10 s as rank 0 failing does.
        codes = [proc.poll() for proc in procs]
        if None not in codes:
            break
        if any(code not in (None, 0) for code in codes):
            deadline = min(deadline, time.monotonic() + 10)
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    results = [(proc.returncode, out_path.read_text(), err_path.read_text())
               for proc, (out_path, err_path) in zip(procs, logs)]
    return procs, results


# Every init method, and exit with and without destroy_process_group: the
# product's corners (11 s each, two fresh processes), env:// (torchrun's)
# both ways; make test runs two, make test-extended the others.
@pytest.mark.parametrize("init_method,destroy", [("tcp", True),
                                                 pytest.param("file", False,
                                                              marks=pytest.mark.extended),
                                                 pytest.param("env", True,
                                                              marks=pytest.mark.extended),
                                                 ("env", False)],
                         ids=["destroy-tcp", "no-destroy-file", "destroy-env", "no-destroy-env"])
def test_init_methods_and_clean_exit(tmp_path, init_method, destroy):
    """env://, tcp:// and file:// all work; exit is prompt with or without
    destroy_process_group and the ranks leave no SysV segments behind."""
    script = tmp_path / "run.py"
    script.write_text(CLEAN_EXIT_SCRIPT)
    # A port found free can be taken by another process before rank 0 binds
    # it: a launch that fails that way is retried on a fresh port.
    for attempt in range(3):
        procs, results = _launch_two_ranks(script, tmp_path, init_method, destroy)
        if not any("address already in use" in err.lower() for _, _, err in results):
            break
    for r, (returncode, out, err) in enumerate(results):
        assert returncode == 0, f"rank {r} exited {returncode}: {err[-2000:]}"
        assert f"done {r}" in out
    leaked = _sysv_segments_created_by(proc.pid for proc in procs)
    assert leaked == [], f"SysV segments left by the ranks: {leaked}"


# --------------------------------------------------------------------------
# Tuning variables: checked at group creation


def check_bad_environment(ctx, variable, value):
    """Every rank sets the same bad value: creating a group raises a
    ValueError on every rank (before any exchange, so none waits)."""
    os.environ[variable] = value  # the harness restores the environment
    with pytest.raises(ValueError) as info:
        dist.new_group()
    del os.environ[variable]
    # The default group still works.
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.all(t == ctx.world_size)
    return str(info.value)


def check_package_variables_the_backend_does_not_read(ctx):
    """fully_shard's FSDP_EXT_FSDP_STREAMS and the build's FSDP_EXT_UCX and
    FSDP_EXT_CUDA (left exported by a shell that built the package) are not
    typos: a group is created with them set."""
    names = ("FSDP_EXT_FSDP_STREAMS", "FSDP_EXT_UCX", "FSDP_EXT_CUDA")
    for name, value in zip(names, ("0", "wheel", "OFF")):
        os.environ[name] = value  # the harness restores the environment
    try:
        group = dist.new_group()
        t = torch.ones(2)
        dist.all_reduce(t, group=group)
    finally:
        for name in names:
            del os.environ[name]
    return t.tolist()


def test_package_variables_are_not_refused(pool2):
    for result in pool2.run(check_package_variables_the_backend_does_not_read):
        assert result == [2.0, 2.0], result


@pytest.mark.parametrize("variable,value,expected", [
    ("FSDP_EXT_ALLGATHER_ALGO", "rign", "FSDP_EXT_ALLGATHER_ALGO='rign' is not valid; expected "
     "auto, direct, ring or shm"),
    ("FSDP_EXT_SPIN_US", "10ms", "FSDP_EXT_SPIN_US='10ms' is not valid; expected a "
     "non-negative integer"),
    ("FSDP_EXT_WAIT_SPIN_US", "-5", "FSDP_EXT_WAIT_SPIN_US='-5' is not valid"),
    ("FSDP_EXT_SHARED_MEMORY", "no", "FSDP_EXT_SHARED_MEMORY='no' is not valid; expected 0 "
     "(off) or 1 (on)"),
    ("FSDP_EXT_CUDA_PATH", "nvlink", "FSDP_EXT_CUDA_PATH='nvlink' is not valid; expected one of "
     "auto, ipc, nccl, staged"),
    ("FSDP_EXT_CUDA_IPC_HANDLES", "vmm", "FSDP_EXT_CUDA_IPC_HANDLES='vmm' is not valid; expected "
     "one of auto, legacy, descriptors"),
    ("TORCH_FR_BUFFER_SIZE", "2k", "TORCH_FR_BUFFER_SIZE='2k' is not valid; expected a "
     "non-negative integer (the number of ops the Flight Recorder keeps; 0: off)"),
    ("FSDP_EXT_SHARED_MEMROY", "0", "unknown variable FSDP_EXT_SHARED_MEMROY in the "
     "environment; the backend reads FSDP_EXT_SPIN_US, FSDP_EXT_WAIT_SPIN_US, "
     "FSDP_EXT_SHARED_MEMORY"),
])
def test_bad_tuning_variable_is_a_clear_error(pool2, variable, value, expected):
    messages = pool2.run(check_bad_environment, variable, value)
    for rank, message in enumerate(messages):
        assert expected in message, message
        assert f"rank {rank}/2" in message and "init" in message, message


# Each a launch of its own (10 s): make test runs the default; the others are
# make test-extended's.
@pytest.mark.parametrize("shared_memory,bind", [("1", False),
                                                pytest.param("0", False, marks=pytest.mark.extended),
                                                pytest.param("1", True, marks=pytest.mark.extended)],
                         ids=["shared-memory", "no-shared-memory", "bound-to-a-core"])
def test_group_creation_logs_one_line(tmp_path, shared_memory, bind):
    """With TORCH_CPP_LOG_LEVEL=INFO every rank logs, per group, its rank,
    the hosts, whether shared memory and process reads are on, with the
    reason when off, the cores it may run on (and, sharing them unbound,
    that binding helps), which UCX it runs and the transports UCX chose."""
    script = tmp_path / "run.py"
    script.write_text(CLEAN_EXIT_SCRIPT)
    for attempt in range(3):
        _, results = _launch_two_ranks(
            script, tmp_path, "env", True,
            {"TORCH_CPP_LOG_LEVEL": "INFO", "FSDP_EXT_SHARED_MEMORY": shared_memory}, bind)
        if not any("address already in use" in err.lower() for _, _, err in results):
            break
    for rank, (returncode, _, err) in enumerate(results):
        assert returncode == 0, err[-2000:]
        lines = [line for line in err.splitlines() if "fsdp_ext group '0'" in line]
        assert len(lines) == 1, err[-2000:]
        expected = (f"rank {rank}/2, 1 host, shared memory on, process reads on, "
                    "small-op channel on"
                    if shared_memory == "1" else
                    f"rank {rank}/2, 1 host, shared memory off (FSDP_EXT_SHARED_MEMORY=0), "
                    "process reads off (no shared memory), small-op channel off (no shared memory)")
        # Where the rank may run (inherited from this process): with fewer
        # than two cores per rank and no binding, the line says to bind.
        cores = 1 if bind else len(os.sched_getaffinity(0))
        expected += f", may run on {cores} core{'s' if cores > 1 else ''}"
        if 1 < cores < 4:
            expected += (" shared with 1 other rank (bind each rank to its own cores for "
                         "steady collective times)")
        # Which UCX: the version the loader bound, what the build linked
        # (system or wheel), and the directory of that libucp.
        from torch_fsdp_ext import _build_info

        expected += f", UCX {_build_info.UCX_VERSION} ({_build_info.UCX_SOURCE}, "
        assert expected in lines[0], lines[0]
        ucx_directory = lines[0].split(expected)[1].split("), UCX transports: ")[0]
        assert os.path.exists(os.path.join(ucx_directory, "libucp.so.0")), lines[0]
        # What UCX chose to reach the peer on this host, e.g. "sysv/memory
        # cma/memory (this host)" (the tests allow UCX_TLS=self,sm,tcp).
        transports = lines[0].split("UCX transports: ")[1]
        assert transports.endswith(" (this host)"), lines[0]
        assert all("/" in name for name in transports[:-len(" (this host)")].split()), lines[0]


def check_device_mesh_checks(ctx):
    """The checks fully_shard runs for a CUDA mesh, which need no GPU to
    decide: a process group without a backend for the device's tensors, and
    parameters found elsewhere than the mesh's device at the first forward."""
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from torch_fsdp_ext import fully_shard
    from torch_fsdp_ext.fsdp import _init

    messages = {}
    host_only = DeviceMesh.from_group(dist.new_group(backend="cpu:gloo"), "cpu")
    info = _init.mesh_info(host_only)
    try:
        _init.check_device_backends(info, torch.device("cuda", 0), nn.Linear(2, 2))
    except ValueError as error:
        messages["backend"] = str(error)
    # The same group carries host tensors: nothing to refuse there.
    _init.check_device_backends(info, torch.device("cpu"), nn.Linear(2, 2))
    model = fully_shard(nn.Sequential(nn.Linear(4, 4)))
    model(torch.randn(2, 4))  # lazy init: parameters get their names in the model
    groups = model._get_fsdp_state()._fsdp_param_groups
    try:
        _init.check_params_on_device(groups, torch.device("cuda", 0), "Sequential")
    except ValueError as error:
        messages["params"] = str(error)
    _init.check_params_on_device(groups, torch.device("cpu"), "Sequential")
    return messages


def test_device_mesh_checks_name_the_module_group_and_parameters(pool2):
    for messages in pool2.run(check_device_mesh_checks):
        assert messages["backend"].startswith("torch_fsdp_ext.fully_shard(Linear): the mesh is "
                                              "on cuda, but its shard process group"), messages
        assert "has no backend for cuda tensors" in messages["backend"], messages
        assert "('cpu:gloo'" in messages["backend"], messages
        assert "the mesh is on cuda:0, but these parameters are elsewhere" in messages["params"]
        assert "('0.weight', 'cpu')" in messages["params"], messages


PID_NAMESPACE_SCRIPT = textwrap.dedent("""
    import datetime, os, time, torch, torch.distributed as dist
    import torch_fsdp_ext
    rank = int(os.environ["RANK"])
    dist.init_process_group("fsdp_ext", timeout=datetime.timedelta(seconds=60))
    t = torch.ones(3)
    for _ in range(20):
        dist.all_reduce(t)
    assert t.tolist() == [2.0 ** 20] * 3, t
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        while True:
            dist.all_reduce(t)
    except dist.DistBackendError as error:
        print(f"ERROR after {time.monotonic() - start:.2f}s: {error}", flush=True)
""")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root and unshare(1) to start a rank in a PID namespace of its own")
def test_peer_in_another_pid_namespace_is_another_host(tmp_path):
    """Containers of one machine may share a hostname and not their PIDs
    (pods on the host's network). A peer's pid means nothing there: the
    group treats such a peer as on another host (no /proc/<pid> access to
    it, watched over TCP), says so in its log line, and still reports the
    peer's death within seconds rather than at the 60 s timeout."""
    script = tmp_path / "pid_namespace.py"
    script.write_text(PID_NAMESPACE_SCRIPT)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 1000),
               WORLD_SIZE="2", UCX_NET_DEVICES="lo", UCX_TLS="self,sm,tcp", UCX_LOG_LEVEL="error",
               TORCH_CPP_LOG_LEVEL="INFO")
    commands = [[sys.executable, str(script)],
                ["unshare", "--pid", "--fork", "--kill-child", sys.executable, str(script)]]
    procs = [subprocess.Popen(command, env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for rank, command in enumerate(commands)]
    try:
        out0, err0 = procs[0].communicate(timeout=90)
        _, err1 = procs[1].communicate(timeout=10)
    finally:
        for proc in procs:
            proc.kill()
    assert procs[0].returncode == 0 and procs[1].returncode == 3, (err0[-2000:], err1[-2000:])
    for rank, err in enumerate((err0, err1)):
        line = next(line for line in err.splitlines() if "fsdp_ext group '0'" in line)
        assert (f"rank {rank}/2, 2 hosts on 1 machine (separate PID namespaces count as hosts), "
                "shared memory off (one rank per host)") in line, line
    error = out0.strip().splitlines()[-1]
    assert float(error.split("ERROR after ")[1].split("s:")[0]) < 10, error
    assert "rank 1 (host " in error and "(another PID namespace)" in error, error
    assert "is gone" in error, error


SEND_THEN_EXIT_SCRIPT = textwrap.dedent("""
    import datetime, os, time, torch, torch.distributed as dist
    import torch_fsdp_ext
    rank = int(os.environ["RANK"])
    dist.init_process_group("fsdp_ext", timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    if rank == 0:
        dist.send(torch.full((5,), 7.0), dst=1, tag=1)
        dist.send(torch.full((2,), 8.0), dst=1, tag=3)
        dist.send(torch.full((3,), 9.0), dst=1, tag=4)
        os._exit(0)  # its sends completed: gone without a word
    time.sleep(1.5)  # rank 0's exit is seen by now: the group is broken
    got = torch.zeros(5)
    dist.recv(got, src=0, tag=1)
    print("RECEIVED", got.tolist(), flush=True)
    # The same through a batch of receives (one coalesced op).
    batch = [torch.zeros(2), torch.zeros(3)]
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, batch[0], 0, tag=3),
                                        dist.P2POp(dist.irecv, batch[1], 0, tag=4)]):
        work.wait()
    print("BATCH RECEIVED", [t.tolist() for t in batch], flush=True)
    for name, call in (("recv", lambda: dist.recv(torch.zeros(5), src=0, tag=2)),
                       ("all_reduce", lambda: dist.all_reduce(torch.ones(3)))):
        start = time.monotonic()
        try:
            call()
            print(f"NO ERROR {name}", flush=True)
        except dist.DistBackendError as error:
            print(f"ERROR {name} after {time.monotonic() - start:.2f}s: {error}", flush=True)
""")


def test_a_message_sent_before_the_sender_exited_is_received(tmp_path):
    """Note [what a lost peer sent still arrives]: rank 0 sends, then exits.
    Its sends completed, so rank 1's receives for them get the data, alone
    or in a batch_isend_irecv, as gloo's do, although the exit broke the
    group; a receive for a message never
    sent fails at once naming the exit, and collectives are refused."""
    script = tmp_path / "send_then_exit.py"
    script.write_text(SEND_THEN_EXIT_SCRIPT)
    _, (_, out1, err1) = run_script_ranks(script, 28400 + os.getpid() % 1000, first=1, timeout=90)
    lines = out1.strip().splitlines()
    assert "RECEIVED [7.0, 7.0, 7.0, 7.0, 7.0]" in lines, (out1, err1[-2000:])
    assert "BATCH RECEIVED [[8.0, 8.0], [9.0, 9.0, 9.0]]" in lines, (out1, err1[-2000:])
    recv = next(line for line in lines if line.startswith("ERROR recv"))
    assert float(recv.split(" after ")[1].split("s:")[0]) < 5, recv
    assert "fsdp_ext recv (group '0', rank 1/2)" in recv and "rank 0 (host " in recv, recv
    assert "exited" in recv, recv
    reduce = next(line for line in lines if line.startswith("ERROR all_reduce"))
    assert "unusable after an earlier failure" in reduce and "exited" in reduce, reduce


def check_peer_destroyed_the_group(ctx, numel):
    """Rank 0 runs one all-reduce on a group and a send, then destroys the
    group; rank 1 runs the same, then one all-reduce more (uneven data: one
    step more), and receives what rank 0 sent. Returns rank 1's error and
    how long it took, and what it received."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=60))
    dist.all_reduce(torch.ones(numel), group=group)
    outcome = None
    if ctx.rank == 0:
        dist.send(torch.full((3,), 5.0), dst=1, group=group)
        dist.destroy_process_group(group)
    else:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(numel), group=group)
            outcome = ("no error", time.monotonic() - start)
        except dist.DistBackendError as error:
            outcome = (str(error), time.monotonic() - start)
        got = torch.zeros(3)
        dist.recv(got, src=0, group=group)
        outcome += (got.tolist(),)
        dist.destroy_process_group(group)
    dist.barrier(group=ctx.gloo_group)
    return outcome


@pytest.mark.parametrize("numel", [4, 1 << 18], ids=["small-op-channel", "1MiB"])
def test_a_collective_after_the_peer_destroyed_the_group_fails_at_once(pool2, numel):
    """Note [a peer that destroyed the group]: rank 1's one collective more
    fails within a second, naming rank 0 and the collectives' numbers,
    instead of waiting out the group's 60 s timeout; what rank 0 sent before
    it destroyed the group is still received."""
    message, seconds, received = pool2.run(check_peer_destroyed_the_group, numel)[1]
    assert seconds < 5, (seconds, message)
    assert message.startswith("fsdp_ext all_reduce (group ") and "rank 1/2" in message, message
    assert "rank 0 (host " in message and "destroyed this group" in message, message
    assert "uneven data" in message, message
    assert received == [5.0, 5.0, 5.0], received


def check_group_created_by_one_rank_only(ctx):
    """Rank 0 creates an fsdp_ext group (timeout 2 s) that rank 1 never
    creates: rank 0 gets an error of the group's creation, within about the
    group's timeout, that names the rank that did not come (not a store key)."""
    from torch_fsdp_ext import _C

    outcome = None
    if ctx.rank == 0:
        store = dist.PrefixStore("lonely_group/", dist.distributed_c10d._get_default_store())
        start = time.monotonic()
        try:
            _C.FsdpExtBackend(store, 0, 2, datetime.timedelta(seconds=2), "lonely", None, [0, 1])
            outcome = ("created", None, time.monotonic() - start)
        except Exception as error:  # the test asserts the type
            outcome = (type(error).__name__, str(error), time.monotonic() - start)
    dist.barrier(group=ctx.gloo_group)
    return outcome


def test_group_created_by_one_rank_only_names_the_missing_rank(pool2):
    kind, message, seconds = pool2.run(check_group_created_by_one_rank_only)[0]
    assert kind == "DistBackendError", (kind, message)
    assert "group 'lonely'" in message and "rank 0/2" in message, message
    assert "rank 1 did not create this group within the timeout" in message, message
    assert 1.5 < seconds < 20, (seconds, message)


def check_recv_timeout(ctx):
    """Rank 0 waits for a message rank 1 never sends: the timeout names the
    peer (rank, host, pid) and the receive's size."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=2))
    message = None
    if ctx.rank == 0:
        try:
            dist.recv(torch.empty(8), src=1, group=group)
        except dist.DistBackendError as error:
            message = str(error)
    dist.barrier(group=ctx.gloo_group)
    dist.destroy_process_group(group)
    return message


def test_recv_timeout_names_the_peer(pool2):
    message = pool2.run(check_recv_timeout)[0]
    assert message is not None, "recv returned although rank 1 never sent"
    assert "fsdp_ext recv" in message and "rank 0/2" in message, message
    assert "timed out after 2000 ms; rank 1 (host " in message, message
    assert "sent nothing to this receive of 32 bytes (no matching send there)" in message, message


@pytest.mark.parametrize("record,expected", [
    (b"\x00" * 40, "rank 1 published an address record this build cannot read: it runs another "
                   "version of torch_fsdp_ext (older than this one's wire format "),
    (b"1fsdpext" + (999).to_bytes(4, "little") + b"\x00" * 40,
     "rank 1 runs a torch_fsdp_ext of wire format 999, this rank one of wire format "),
], ids=["older-build", "other-wire-format"])
def test_a_peer_of_another_build_is_named_at_group_creation(record, expected):
    """Ranks running different torch_fsdp_ext builds find out when the group
    is created, by name, instead of misreading each other. Rank 1 is played
    by the test: it takes its ticket and publishes a record as another
    build would, in the store rank 0 creates its group on."""
    from torch_fsdp_ext import _C

    store = dist.HashStore()
    store.add("fsdp_ext/incarnation", 1)
    store.set("fsdp_ext/0/address/1", record)
    with pytest.raises(dist.DistBackendError) as info:
        _C.FsdpExtBackend(store, 0, 2, datetime.timedelta(seconds=5), "mixed", None, [0, 1])
    message = str(info.value)
    assert message.startswith("fsdp_ext init (group 'mixed', rank 0/2): "), message
    assert expected in message, message
    assert "Install the same torch_fsdp_ext on every host" in message, message


def check_pg_options_are_warned_about(ctx):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = dist.new_group(backend="fsdp_ext", pg_options=dist.ProcessGroupGloo._Options())
    t = torch.ones(2)
    dist.all_reduce(t, group=group)  # the group works regardless
    dist.destroy_process_group(group)
    return t.tolist(), [str(w.message) for w in caught if "pg_options" in str(w.message)]


def test_pg_options_are_warned_about_not_silently_ignored(pool2):
    for total, warned in pool2.run(check_pg_options_are_warned_about):
        assert total == [2.0, 2.0]
        assert len(warned) == 1 and "pg_options (_Options) are ignored" in warned[0], warned
