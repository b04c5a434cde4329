"""A fast slice of torch's own distributed suite, run on fsdp_ext.

The whole comparison with gloo (every test that runs on a CPU machine, world
sizes 2 and 3) is `make torch-suite` (test/torch_suite/compare.py, about half
an hour); this runs a corner of each area it covers, the way the full run
does (test/torch_suite/run_suite.py), in a minute or two: all-reduce and its
coalesced form, sparse all-reduce, point-to-point ops with their profiler
records and batched, DDP, and the monitored barrier's timeout. Each test
costs two spawned ranks (about 15 s on 2 cores), so the slice names tests
exactly: a bare name would also run every test it prefixes
(test_all_reduce_sum_async, ..._complex).
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

SLICE = (
    "test_all_reduce_sum",
    "test_all_reduce_coalesced_full_group_sum",
    "test_sparse_all_reduce_sum",
    "test_send_recv_any_source_torch_profiler",
    "test_batch_isend_irecv_gloo",
    "test_DistributedDataParallelCPU",
    "test_monitored_barrier_gloo_rank_0_timeout",
)


# Seven spawned tests, about 100 s: make test-extended.
@pytest.mark.extended
def test_torch_suite_slice_passes_on_fsdp_ext(tmp_path):
    results = tmp_path / "results.jsonl"
    env = dict(os.environ, BACKEND="fsdp_ext", WORLD_SIZE="2", TORCH_SUITE_RESULTS=str(results))
    env.pop("TEMP_DIR", None)
    command = [sys.executable, os.path.join(HERE, "torch_suite", "run_suite.py")]
    for name in SLICE:
        # With a wildcard, unittest matches the whole test id (fnmatch):
        # this name and no other.
        command += ["-k", f"*.{name}"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    outcomes = {}
    if results.exists():
        for line in results.read_text().splitlines():
            entry = json.loads(line)
            outcomes[entry["test"]] = entry
    assert set(outcomes) == set(SLICE), (sorted(outcomes), run.stdout[-3000:], run.stderr[-3000:])
    ran = {test: e for test, e in outcomes.items() if e["outcome"] != "skipped"}
    assert len(ran) >= len(SLICE) - 1, (sorted(outcomes), run.stdout[-3000:], run.stderr[-3000:])
    failed = {test: e["detail"][-2000:] for test, e in ran.items() if e["outcome"] != "passed"}
    assert not failed, failed
    assert run.returncode == 0, run.stderr[-3000:]
