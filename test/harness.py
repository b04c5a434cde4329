"""A pool of long-lived worker processes, one per rank, for multi-rank tests.

Starting torch and a process group costs seconds per process, so each world
size gets one pool for the whole session: the workers initialise
``fsdp_ext`` (plus a gloo group for comparisons) once, then run test
functions sent to them. ``pool.run(fn, *args)`` calls ``fn(ctx, *args)`` on
every rank and returns the per-rank results, or raises with every failing
rank's traceback. A call that fails or exceeds its time limit retires the
pool, and the next test gets a fresh one: a failed collective leaves the
group unusable by design, and a rank may still be inside the failed test, so
one failure must not become the failure of every test after it.
"""

import datetime
import faulthandler
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

DEFAULT_CALL_TIMEOUT = 180.0


class WorkerExited(RuntimeError):
    """A worker process ended while the pool waited for its answer."""


@dataclass
class RankContext:
    rank: int
    world_size: int
    gloo_group: object  # a gloo group over the same ranks, for parity checks


def _worker_main(rank, world_size, init_file, conn, env):
    # On a time-out the pool asks every worker for its Python stacks first.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(env)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_TLS", "self,sm,tcp")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    import torch
    import torch.distributed as dist

    import torch_fsdp_ext  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(
        "fsdp_ext",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    ctx = RankContext(rank, world_size, dist.new_group(backend="gloo"))
    conn.send(("ready", None))
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args = message
        # Each task starts from the worker's environment: a task that sets
        # variables (forced algorithms) and fails cannot leak them into the
        # next test run by this long-lived worker.
        environ = dict(os.environ)
        try:
            conn.send(("ok", fn(ctx, *args)))
        except BaseException:  # report everything, including assertion errors
            conn.send(("error", traceback.format_exc()))
        finally:
            if os.environ != environ:
                os.environ.clear()
                os.environ.update(environ)
    dist.destroy_process_group()
    conn.send(("closed", None))


class WorkerPool:
    def __init__(self, world_size, env=None):
        """``env``: extra environment variables for the workers (set before torch loads)."""
        self.world_size = world_size
        context = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._tmp.name, "init")
        self._conns = []
        self._procs = []
        for rank in range(world_size):
            parent, child = context.Pipe()
            proc = context.Process(
                target=_worker_main, args=(rank, world_size, init_file, child, dict(env or {})),
                daemon=True
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        for rank in range(world_size):
            self._receive(rank, 120.0, "start-up")

    def _receive(self, rank, timeout, what):
        conn, proc = self._conns[rank], self._procs[rank]
        deadline = time.monotonic() + timeout
        # In slices: a worker that died (a crash, a failed start-up) is
        # reported at once, not after the whole time limit.
        while not conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if not proc.is_alive():
                self.kill()
                raise WorkerExited(f"rank {rank}'s worker exited with code {proc.exitcode} "
                                   f"({what}); its output is above")
            if time.monotonic() >= deadline:
                self.dump_stacks()
                self.kill()
                raise TimeoutError(f"rank {rank} did not answer within {timeout}s ({what})")
        return conn.recv()

    def run(self, fn, *args, timeout=DEFAULT_CALL_TIMEOUT):
        for conn in self._conns:
            conn.send((fn, args))
        results, failures = [], []
        for rank in range(self.world_size):
            try:
                status, value = self._receive(rank, timeout, fn.__name__)
            except (TimeoutError, WorkerExited) as lost:
                # A rank that failed first often leaves its peers waiting for
                # it: its traceback is the cause, so it must not be lost.
                if not failures:
                    raise
                raise type(lost)(
                    f"{lost}; before that, {fn.__name__} failed on:\n" + "\n".join(failures)
                ) from None
            if status == "error":
                failures.append(f"--- rank {rank} ---\n{value}")
            results.append(value)
        if failures:
            self.kill()
            raise AssertionError(
                f"{fn.__name__} failed on {len(failures)} of {self.world_size} ranks:\n"
                + "\n".join(failures)
            )
        return results

    def close(self):
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=30)
        self.kill()
        self._tmp.cleanup()

    def dump_stacks(self):
        """Every live worker prints its threads' Python stacks to stderr."""
        for proc in self._procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(2)

    def kill(self):
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    @property
    def alive(self):
        return all(p.is_alive() for p in self._procs)


def run_script_ranks(script, master_port, first, timeout, world_size=2):
    """Runs `script` as ranks 0..world_size-1 of its own job (env:// on
    loopback, UCX over lo): waits up to `timeout` s for rank `first`, then
    10 s for each other rank, and kills whatever is left, so that no rank
    outlives a failed test. Returns [(returncode, stdout, stderr)] by rank
    (None, "", "" for a rank that was killed before it answered)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
               WORLD_SIZE=str(world_size), UCX_NET_DEVICES="lo", UCX_TLS="self,sm,tcp",
               UCX_LOG_LEVEL="error")
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world_size)]
    results = [(None, "", "")] * world_size
    try:
        order = [first] + [rank for rank in range(world_size) if rank != first]
        for rank in order:
            out, err = procs[rank].communicate(timeout=timeout if rank == first else 10)
            results[rank] = (procs[rank].returncode, out, err)
    finally:
        for proc in procs:
            proc.kill()
    return results
