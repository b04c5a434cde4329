"""A real framework's FSDP2 path on our runtime: Lightning Fabric's
ModelParallelStrategy over fsdp_ext at world size 2, with torch's fully_shard
as it is and with ours routed in by use_as_fully_shard() (test/fabric_job.py,
launched by torchrun as a user would). Same losses and parameters bit for
bit; Fabric's gradient-sync gate, which looks for FSDPModule instances, must
reach our modules (no reduce-scatter while accumulating).

`make test` installs lightning-fabric (without dependencies, so that it can
never pull another torch)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning_fabric", reason="lightning-fabric is not installed (make test installs it)")

HERE = os.path.dirname(os.path.abspath(__file__))


# A torchrun job of two Fabric runs, 16 s: make test-extended.
@pytest.mark.extended
def test_lightning_fabric_trains_with_our_fully_shard_routed_in(tmp_path):
    env = dict(os.environ, UCX_NET_DEVICES="lo", UCX_TLS="self,sm,tcp", UCX_LOG_LEVEL="error",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TMPDIR=str(tmp_path))  # torchrun's torchelastic_* directory goes there
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", os.path.join(HERE, "fabric_job.py"), str(tmp_path)]
    proc = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for result in results:
        upstream, routed = result["upstream"], result["routed"]
        what = f"rank {result['rank']}"
        assert upstream["backend"] == routed["backend"] == "fsdp_ext", what
        assert routed["losses"] == upstream["losses"], (what, routed, upstream)
        assert routed["params_sha256"] == upstream["params_sha256"], what
        # Routed: every FSDP module Fabric sees is ours; upstream's run has none.
        assert upstream["our_modules"] == 0 and upstream["fsdp_modules"] > 1, (what, upstream)
        assert routed["our_modules"] == routed["fsdp_modules"] == upstream["fsdp_modules"], (
            what, routed)
        # Micro-batches 0 and 2 ran under fabric.no_backward_sync.
        for counts in (upstream["reduce_scatters"], routed["reduce_scatters"]):
            assert counts[0] == counts[2] == 0 and counts[1] == counts[3] > 0, (what, counts)
