import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import WorkerPool  # noqa: E402

_pools = {}


def get_pool(world_size):
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.kill()
        pool = WorkerPool(world_size)
        _pools[world_size] = pool
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


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
    _pools.clear()
