import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from harness import WorkerPool  # noqa: E402
from torch_fsdp_ext import _build_info  # noqa: E402

_pools = {}


def get_pool(world_size, **env):
    key = (world_size, tuple(sorted(env.items())))
    pool = _pools.get(key)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.kill()
        pool = WorkerPool(world_size, env)
        _pools[key] = pool
    return pool


@pytest.fixture(params=[1, 2, 3, 4], ids=lambda n: f"ws{n}")
def pool(request):
    return get_pool(request.param)


@pytest.fixture
def pool2():
    return get_pool(2)


@pytest.fixture
def pool4():
    return get_pool(4)


@pytest.fixture
def pool2_without_process_reads():
    """Shared memory but no process_vm_readv, as on hosts that restrict ptrace."""
    return get_pool(2, FSDP_EXT_PROCESS_READS="0")


@pytest.fixture
def pool2_without_small_ops():
    """Small collectives through the engine and UCX messages, not the small-op channel."""
    return get_pool(2, FSDP_EXT_SMALL_OPS="0")


@pytest.fixture
def pool2_without_shared_memory():
    """Two ranks that keep to UCX messages (FSDP_EXT_SHARED_MEMORY=0), as across hosts."""
    return get_pool(2, FSDP_EXT_SHARED_MEMORY="0")


@pytest.fixture(params=[2, 3], ids=lambda n: f"ws{n}")
def pool_without_shared_memory(request):
    """Ranks that keep to UCX messages (FSDP_EXT_SHARED_MEMORY=0), as across hosts."""
    return get_pool(request.param, FSDP_EXT_SHARED_MEMORY="0")


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
    _pools.clear()


# The CUDA test files' marks: each test skips, saying why, without a build
# that has the CUDA parts or without a GPU (test/gpu/run.sh runs them on the
# lent GPU machine).
REQUIRES_CUDA = [
    pytest.mark.skipif(not _build_info.WITH_CUDA,
                       reason="this build of torch_fsdp_ext has no CUDA parts (torch is a CPU "
                              "build, or no nvcc, or FSDP_EXT_CUDA=OFF)"),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU; none here (test/gpu/run.sh runs these on the "
                              "lent GPU machine)"),
]


# `make test` runs what is not marked `extended`; `make test-extended` (which
# .ci/run runs after it) runs what is: end-to-end launches, 10-75 s each on 2
# cores and most of it starting processes (torch's suite slice, the examples'
# and Fabric's torchrun jobs, jobs across two emulated hosts but the one make
# test keeps, launches that vary one setting of a launch make test runs).


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "extended: a slow end-to-end launch, run by make test-extended (not make test)")
