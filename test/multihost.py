"""Two emulated hosts on one machine, for tests and benchmarks that cross a network.

Each host is a network namespace of its own, joined to the other by a veth
pair (10.<n>.0.1 and 10.<n>.0.2), and every process started on it runs under
``unshare --uts`` with a hostname of its own, so the backend sees two hosts:
its shared memory stays among the ranks of one namespace and everything else
travels over TCP on the veth link. Jobs are real ``torchrun --nnodes 2``
launches, one per host, with a static rendezvous on host 0.

Needs root (``ip netns``); ``available()`` says whether this process can use
it. Everything is removed on exit, even when a job hangs or the caller fails:
the namespaces (which takes their interfaces with them) and every process
started inside them.

    with TwoHosts() as hosts:
        results = hosts.torchrun("job.py", ["--steps", "5"], ranks_per_host=2)
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# The link as the backend and UCX see it inside each namespace.
LINK = "fxlink"


def available():
    """Whether this process may create network namespaces (root, iproute2, unshare)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        return False
    probe = f"fxprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return made


def _netem_available():
    probe = f"fxnetem{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
        return subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo",
                               "root", "netem", "delay", "1ms"], capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)


def _delete_namespace(ns, attempts=25):
    """`ip netns delete`, retried: its file cannot be removed (EBUSY) while a
    process killed a moment ago still holds a mount namespace that copied the
    mount (the hosts run under `unshare --mount-proc`). A CI run once left a
    pair behind with the single try."""
    for _ in range(attempts):
        done = subprocess.run(["ip", "netns", "delete", ns], capture_output=True, text=True)
        if done.returncode == 0 or not os.path.exists(f"/run/netns/{ns}"):
            return
        time.sleep(0.2)
    print(f"multihost: could not delete network namespace {ns}: {done.stderr.strip()}",
          file=sys.stderr)


@dataclass
class HostResult:
    host: int
    returncode: int
    output: str
    seconds: float


def _run(*cmd):
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class TwoHosts:
    """Two network namespaces and a veth link between them.

    ``delay_ms`` / ``rate_mbit`` shape the link (both directions) to emulate
    a real network: netem for a delay, a token bucket (tbf) for a rate alone;
    unset, the link is as fast as the kernel's veth.
    """

    def __init__(self, delay_ms=None, rate_mbit=None):
        tag = f"{os.getpid() % 100000}"
        self.subnet = 10 + os.getpid() % 200  # 10.<subnet>.0.0/24
        self.namespaces = [f"fxh{tag}a", f"fxh{tag}b"]
        self.hostnames = [f"fxhost{tag}a", f"fxhost{tag}b"]
        self.addresses = [f"10.{self.subnet}.0.1", f"10.{self.subnet}.0.2"]
        self._veth = [f"fxv{tag}a", f"fxv{tag}b"]
        self._delay_ms = delay_ms
        self._rate_mbit = rate_mbit
        self._procs = []
        # The jobs' temporary files (torchrun's agents make a torchelastic_*
        # directory each and leave it when a job is killed): made on enter,
        # removed by close().
        self._tmpdir = None

    def __enter__(self):
        self._tmpdir = tempfile.mkdtemp(prefix="fsdp_ext_hosts_")
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _create(self):
        for ns in self.namespaces:
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", self._veth[0], "type", "veth", "peer", "name", self._veth[1])
        for ns, veth, address in zip(self.namespaces, self._veth, self.addresses):
            _run("ip", "link", "set", veth, "netns", ns)
            # The same interface name on both hosts, so one UCX_NET_DEVICES fits all.
            _run("ip", "-n", ns, "link", "set", veth, "name", LINK)
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", LINK)
            _run("ip", "-n", ns, "link", "set", LINK, "up")
            if self._delay_ms or self._rate_mbit:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", LINK, "root",
                     *self._shaping())

    def _shaping(self):
        """The qdisc that shapes each end of the link: netem for a delay (with
        its rate, if any), a token bucket for a rate alone. Some kernels have
        no netem (this VM's: 'Specified qdisc kind is unknown'); a rate then
        still works, and a delay is refused with a clear error."""
        if self._delay_ms:
            if not _netem_available():
                raise RuntimeError(f"--netem-delay-ms {self._delay_ms}: this kernel has no netem "
                                   "qdisc (sch_netem), so a link delay cannot be emulated here")
            shape = ["netem", "delay", f"{self._delay_ms}ms"]
            return shape + (["rate", f"{self._rate_mbit}mbit"] if self._rate_mbit else [])
        # Bucket: 4 ms of the rate and at least a few GSO segments (veth
        # passes 64 KiB segments); queue: 20 ms of the rate.
        rate_bytes = self._rate_mbit * 1e6 / 8
        burst = max(int(rate_bytes * 0.004), 256 << 10)
        return ["tbf", "rate", f"{self._rate_mbit}mbit", "burst", str(burst), "latency", "20ms"]

    def link_down(self, host):
        """Takes host's end of the link down: the other host can no longer reach it."""
        _run("ip", "-n", self.namespaces[host], "link", "set", LINK, "down")

    def popen(self, host, argv, env=None, **kwargs):
        """Starts argv on `host`, in a session of its own.

        A host is its own network namespace and hostname, and also its own
        IPC and PID namespaces (with its own /proc): without them UCX finds
        the other host's processes reachable through System V shared memory
        and cross-memory attach, and "cross-host" traffic never touches the
        network (seen in the group log line's transports)."""
        command = ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "--ipc",
                   "--pid", "--fork", "--mount-proc", "sh", "-c",
                   f'hostname {self.hostnames[host]} && exec "$@"', "sh", *argv]
        proc = subprocess.Popen(command, env=env, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def job_env(self, extra=None):
        env = dict(os.environ)
        # Tests elsewhere pin UCX to loopback; here the link is the network.
        env["UCX_NET_DEVICES"] = LINK
        env["UCX_TLS"] = "self,sm,tcp"
        env.setdefault("UCX_LOG_LEVEL", "error")
        env["GLOO_SOCKET_IFNAME"] = LINK
        env["OMP_NUM_THREADS"] = "1"
        env["TMPDIR"] = self._tmpdir
        env.update(extra or {})
        return env

    def start_torchrun(self, script, args=(), ranks_per_host=1, env=None, port=29500):
        """Starts one torchrun per host; returns the two Popen objects.
        ``ranks_per_host``: the same count on both hosts, or a pair (3, 1)."""
        counts = ranks_per_host if isinstance(ranks_per_host, (tuple, list)) else \
            (ranks_per_host, ranks_per_host)
        procs = []
        for host in (0, 1):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--node-rank", str(host), "--nproc-per-node", str(counts[host]),
                    "--master-addr", self.addresses[0], "--master-port", str(port),
                    "--max-restarts", "0", script, *args]
            procs.append(self.popen(host, argv, env=self.job_env(env), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True))
        return procs

    def torchrun(self, script, args=(), ranks_per_host=1, env=None, timeout=240, linger=None,
                 until=None):
        """Runs a job on both hosts to the end; returns one HostResult per host.

        ``linger``: once one host's torchrun has ended, how long the other
        may go on before it is killed. torchrun's agents wait up to 300 s in
        an exit barrier for a node that failed; tests of failures do not.
        ``until``: a callable; once it returns true, whatever still runs is
        killed (a failure test has what it needs).
        """
        procs = self.start_torchrun(script, args, ranks_per_host, env)
        return self.wait(procs, timeout, linger, until)

    def wait(self, procs, timeout, linger=None, until=None):
        start = time.monotonic()
        first_exit = None
        ended = [None] * len(procs)
        while any(e is None for e in ended):
            now = time.monotonic()
            for host, proc in enumerate(procs):
                if ended[host] is None and proc.poll() is not None:
                    ended[host] = now - start
                    first_exit = first_exit or now
            too_long = now - start > timeout
            lingered = linger is not None and first_exit and now - first_exit > linger
            if too_long or lingered or (until is not None and until()):
                self._kill_all()
                break
            time.sleep(0.05)
        results = []
        for host, proc in enumerate(procs):
            output, _ = proc.communicate()
            if ended[host] is None:
                why = f"after {timeout:.0f} s" if linger is None or not first_exit else \
                    f"{linger:.0f} s after the other host's job ended"
                if until is not None and until():
                    why = "once the caller had what it waited for"
                output += f"\n[multihost] host {host} still running {why}: killed"
            results.append(HostResult(host, proc.returncode, output,
                                      ended[host] if ended[host] is not None
                                      else time.monotonic() - start))
        return results

    def _kill_all(self):
        # torchrun starts its workers in sessions of their own: kill whatever
        # runs in the namespaces too, or a worker keeps the output pipe open.
        self._kill_namespace_processes()
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def _kill_namespace_processes(self):
        # Anything a job left behind (a rank that escaped its session) still
        # runs in the namespace: `ip netns pids` finds it.
        for ns in self.namespaces:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass

    def close(self):
        self._kill_all()
        for ns in self.namespaces:
            _delete_namespace(ns)
        # The veth pair goes with its namespaces; one still in the root
        # namespace (set-up failed half way) is removed here.
        subprocess.run(["ip", "link", "delete", self._veth[0]], capture_output=True)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
