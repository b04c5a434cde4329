"""The backend inside a container's limits.

Docker gives a container 64 MiB of /dev/shm unless told otherwise. UCX's
posix transport takes its receive pool from there for every worker, and every
fsdp_ext group of every rank has a worker: at UCX's own pool size (about
4 MiB a worker) a few groups on a few ranks used /dev/shm up. The backend
starts UCX with smaller pools (comm/ucx_config_defaults.h)."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

GROUPS = 6
DEV_SHM_MIB = 36  # UCX's default pools need 12 x ~4.1 MiB here (49 MiB)

JOB = textwrap.dedent(f"""
    import datetime, os, subprocess, sys
    if "RANK" not in os.environ:  # the launcher, inside the mount namespace
        ranks = [subprocess.Popen([sys.executable, __file__], env=dict(os.environ, RANK=str(r)))
                 for r in range(2)]
        sys.exit(max(proc.wait(timeout=120) for proc in ranks))

    import torch, torch.distributed as dist
    import torch_fsdp_ext
    rank = int(os.environ["RANK"])
    dist.init_process_group("fsdp_ext", timeout=datetime.timedelta(seconds=30))
    groups = [None] + [dist.new_group([0, 1], backend="fsdp_ext") for _ in range({GROUPS} - 1)]
    for index, group in enumerate(groups):
        t = torch.full((1 << 14,), float(rank + index))
        dist.all_reduce(t, group=group)
        assert t.eq(2 * index + 1).all(), (index, t[:4])
        # A point-to-point message: UCX carries it, over shared memory here.
        message = torch.arange(1 << 16, dtype=torch.float32) + index
        if rank == 0:
            dist.send(message, 1, group=group)
        else:
            received = torch.empty_like(message)
            dist.recv(received, 0, group=group)
            assert torch.equal(received, message), index
    dist.barrier()
    if rank == 0:
        used = int(subprocess.run(["df", "-B1", "--output=used", "/dev/shm"], capture_output=True,
                                  text=True, check=True).stdout.split()[1])
        print(f"/dev/shm used: {{used / 2**20:.1f}} MiB", flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root and unshare(1) to give the job a small /dev/shm of its own")
def test_six_groups_on_two_ranks_fit_a_small_dev_shm(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29300 + os.getpid() % 1000),
               WORLD_SIZE="2", UCX_NET_DEVICES="lo", UCX_TLS="self,sm,tcp", UCX_LOG_LEVEL="error")
    for name in ("UCX_MM_RX_BUFS_GROW", "UCX_POSIX_RX_BUFS_GROW", "UCX_SYSV_RX_BUFS_GROW"):
        env.pop(name, None)
    mount_and_run = (f'mount -t tmpfs -o size={DEV_SHM_MIB}m tmpfs /dev/shm && '
                     f'exec "{sys.executable}" "{script}"')
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             mount_and_run], env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert "/dev/shm used:" in result.stdout, result.stdout
    print(result.stdout.strip())
