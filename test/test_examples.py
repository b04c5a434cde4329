"""The examples in examples/ run as their docstrings say, launched by torchrun
as a user launches them, and what each one shows holds:

- checkpoint_resume.py: rank 1 dies mid-run, torchrun restarts the job, it
  resumes from the last DCP checkpoint and ends with the losses of a run that
  never stopped, bit for bit;
- mixed_precision_bf16.py: bf16 compute with fp32 reduction trains, keeps fp32
  parameters and optimizer state, tracks fp32 training closely, and has the
  losses of torch's fully_shard over gloo bit for bit;
- hsdp.py: a 2 x 2 (replicate, shard) mesh on 4 ranks, the losses of torch's
  fully_shard on the same mesh over gloo bit for bit; on one host, and across
  two emulated hosts (test/multihost.py; needs root) with a shard group per
  host, as its docstring suggests;
- framework_fabric.py: Lightning Fabric's FSDP2 strategy routed to ours by
  use_as_fully_shard(): every FSDP module is ours, and the losses are those
  of the plain training loop of checkpoint_resume.py (same model, data and
  optimizer) bit for bit.

Each case is one torchrun launch (the fp32 reference is shared), 15-75 s each
on 2 cores: make test runs the docstring check; the launches are `extended`
(make test-extended, which CI runs).
"""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

import multihost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TIMEOUT = 300  # per launch; a loaded 2-core machine is slow to import torch in 4 processes


def torchrun(cwd, script, *args, nproc=2, max_restarts=0):
    """Runs `torchrun --standalone --nproc-per-node N [--max-restarts R]
    examples/<script> args` from `cwd` and returns its combined output;
    fails with that output if the job fails. A job past the time limit is
    killed with every process it started."""
    env = dict(os.environ, UCX_NET_DEVICES="lo", UCX_TLS="self,sm,tcp", UCX_LOG_LEVEL="error",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TMPDIR=str(cwd))  # torchrun's torchelastic_* directories go there
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
           os.path.join(EXAMPLES, script), *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{script} did not finish within {TIMEOUT}s:\n{output[-6000:]}")
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{output[-6000:]}"
    return output


def run_example(tmp_path, script, *args, **kwargs):
    """torchrun(...) with --losses-json; returns (rank 0's JSON, output)."""
    out = tmp_path / "result.json"
    output = torchrun(tmp_path, script, *args, "--losses-json", out, **kwargs)
    return json.loads(out.read_text()), output


def assert_trains(losses, what):
    assert len(losses) >= 8 and losses[-1] < 0.8 * losses[0], f"{what}: no progress: {losses}"


@pytest.fixture(scope="module")
def fp32_reference(tmp_path_factory):
    """checkpoint_resume.py without interruption: the losses of 12 steps of
    the plain fp32 loop (TinyTransformer(layers=2), AdamW, 2 ranks)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    result, _ = run_example(tmp, "checkpoint_resume.py", "--checkpoint-dir", tmp / "ckpt",
                            "--steps", 12, "--save-every", 4)
    assert result["attempt"] == 0 and result["resumed_from"] is None, result
    saved = sorted(os.listdir(tmp / "ckpt"))
    assert saved == ["step_000004", "step_000008", "step_000012"], saved
    assert_trains(result["losses"], "checkpoint_resume.py")
    return result["losses"]


def test_docstrings_show_a_command_with_real_flags():
    """Each example's docstring gives its torchrun command, and every flag it
    names after the script is one the script's parser accepts."""
    for script in ("checkpoint_resume.py", "mixed_precision_bf16.py", "hsdp.py",
                   "framework_fabric.py", "train_fsdp.py"):
        source = open(os.path.join(EXAMPLES, script)).read()
        docstring = source.split('"""')[1]
        command = re.search(rf"torchrun .*?{re.escape(script)}(.*?)\n\s*\n", docstring, re.S)
        assert command, f"{script}: no torchrun command in the docstring"
        shown = set(re.findall(r"--[a-z][a-z-]*", command.group(1)))
        accepted = set(re.findall(r"add_argument\(\s*\"(--[a-z-]+)\"", source))
        assert shown and shown <= accepted, (script, shown - accepted)


@pytest.mark.extended
def test_checkpoint_resume_after_a_rank_dies(tmp_path, fp32_reference):
    result, output = run_example(tmp_path, "checkpoint_resume.py",
                                 "--checkpoint-dir", tmp_path / "ckpt", "--steps", 12,
                                 "--save-every", 4, "--crash-after-step", 6, max_restarts=1)
    # Rank 1 really died on the first attempt, and torchrun started a second.
    assert "rank 1: dying after step 6 (attempt 0)" in output, output[-4000:]
    assert result["attempt"] == 1, result
    # It resumed from the checkpoint taken after step 3 (steps 4-6 ran twice).
    assert result["resumed_from"] == str(tmp_path / "ckpt" / "step_000004"), result
    assert "attempt 1: resuming at step 4" in output, output[-4000:]
    assert result["losses"] == fp32_reference, (result["losses"], fp32_reference)


@pytest.mark.extended
def test_mixed_precision_bf16_matches_upstream(tmp_path, fp32_reference):
    result, output = run_example(tmp_path, "mixed_precision_bf16.py", "--steps", 10,
                                 "--check-upstream")
    ours, upstream = result["ours"], result["upstream"]
    assert_trains(ours["losses"], "bf16")
    assert ours["losses"] == upstream["losses"], (ours["losses"], upstream["losses"])
    assert "bit for bit" in output
    # bf16 compute, fp32 everything the optimizer sees.
    assert ours["logits_dtype"] == "torch.bfloat16", ours
    assert ours["param_dtype"] == ours["optimizer_state_dtype"] == "torch.float32", ours
    # Close to fp32 training, but computed in bf16 (not the same numbers).
    fp32 = fp32_reference[:10]
    assert ours["losses"] != fp32
    for step, (a, b) in enumerate(zip(ours["losses"], fp32)):
        assert abs(a - b) <= 1e-2 * abs(b), (step, ours["losses"], fp32)


@pytest.mark.extended
def test_hsdp_matches_upstream(tmp_path):
    result, output = run_example(tmp_path, "hsdp.py", "--replicas", 2, "--steps", 8,
                                 "--check-upstream", nproc=4)
    ours, upstream = result["ours"], result["upstream"]
    assert result["mesh_shape"] == [2, 2], result
    assert ours["placements"] == upstream["placements"] == "(Replicate(), Shard(dim=0))", result
    assert_trains(ours["losses"], "HSDP")
    assert ours["losses"] == upstream["losses"], (ours["losses"], upstream["losses"])
    assert "bit for bit" in output


@pytest.mark.skipif(not multihost.available(),
                    reason="needs root and `ip netns` for two emulated hosts")
@pytest.mark.extended
def test_hsdp_across_two_hosts(tmp_path):
    """torchrun --nnodes 2 --nproc-per-node 2, one agent per emulated host:
    ranks 0-1 on host 0, 2-3 on host 1, so each shard group is one host's
    ranks and the replicas all-reduce over TCP between the hosts."""
    out = tmp_path / "result.json"
    with multihost.TwoHosts() as hosts:
        ended = hosts.torchrun(os.path.join(EXAMPLES, "hsdp.py"),
                               ["--replicas", "2", "--steps", "8", "--check-upstream",
                                "--losses-json", str(out)],
                               ranks_per_host=2, timeout=TIMEOUT, linger=60)
    for host in ended:
        assert host.returncode == 0, f"host {host.host}:\n{host.output[-6000:]}"
    result = json.loads(out.read_text())
    ours, upstream = result["ours"], result["upstream"]
    assert result["mesh_shape"] == [2, 2], result
    assert_trains(ours["losses"], "HSDP across hosts")
    assert ours["losses"] == upstream["losses"], (ours["losses"], upstream["losses"])


@pytest.mark.extended
def test_lightning_fabric_on_our_fully_shard(tmp_path, fp32_reference):
    pytest.importorskip("lightning_fabric",
                        reason="lightning-fabric is not installed (make test installs it)")
    result, output = run_example(tmp_path, "framework_fabric.py", "--steps", 8)
    assert result["backend"] == "fsdp_ext", result
    # The root and both blocks, all ours although parallelize() names torch's fully_shard.
    assert result["our_modules"] == result["fsdp_modules"] == 3, result
    # The same training as checkpoint_resume.py's loop: the gradient norm
    # stays below 1, so Fabric's clipping multiplies by exactly 1.0.
    assert result["losses"] == fp32_reference[:8], (result["losses"], fp32_reference[:8])
