"""set_host_shared_parameters: one copy of the unsharded parameters per host.

Training cases (4 ranks, one host): ours with host-shared parameters against
ours without them and upstream's fully_shard, same initial values and
batches; losses, last-step gradients and final parameters equal bit for bit.
reshard_after_forward 2; bf16 parameters kept unsharded after forward
(False); activation checkpointing with a micro-batch accumulated without
gradient sync; HSDP (2 x 2: the shard groups are the host's pairs);
host-shared together with per-parameter reduce-scatters; and explicit
forward and backward prefetching with rank 1 made slow on purpose (sleeps
inside every block's forward and backward and before its optimizer step).
reshard_after_forward True is the default of the other cases. And ranks 0, 1
and 2, 3 pretending to be two hosts (bf16, reshard 2, the slow rank 1;
checkpointing with a no-sync micro-batch; a backward prefetch nobody waits
for): two copies, each host's shards sent to the other's. Every group must
be host-shared and no all-gather may run.

The ordering rule that protects a slower rank (Note [ordering of host-shared
unsharded parameters]) is checked where it matters: a single-group model
whose shards change between forwards (no_grad), with rank 1 sleeping after
its unshard and before it reads the parameters. Without the rule, rank 0
would write its next shard under rank 1's read.

Across hosts the backward reuses what the forward wrote and received (a
flag per group crosses instead of the shards), unless a rank's shards
changed in between, in which case that rank's new values reach every
rank's backward (within one host too, where every unshard writes).

Also: the /dev/shm file is gone once every rank has mapped it, and the
mapping once the trained model is deleted; a rank that exits while another
waits for it is an error naming it within seconds; parameters sharded on
dim 1 and a call after the first forward are refused; the host layout
(each rank's host-mates and column) and its refusal of unequal hosts.
"""

import gc
import os
import subprocess
import sys
import textwrap
import time
import weakref
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

from conftest import get_pool
from fsdp_testing import TinyLM, fsdp_api, lm_batch, lm_loss
from test_fully_shard_configs import make_mesh

STEPS = 3
SLOW_SECONDS = 0.02
CASES = {
    # name: (mesh shape, fully_shard kwargs, extras)
    "reshard_2": ((4,), {"reshard_after_forward": 2}, {}),
    "bf16_reshard_false": ((4,), {"mp": torch.bfloat16, "reshard_after_forward": False}, {}),
    "checkpoint_accumulate": ((4,), {}, {"ac": True, "accumulate": True}),
    "hsdp": ((2, 2), {}, {}),
    "per_parameter_reduce": ((4,), {}, {"per_parameter": True}),
    "slow_rank_explicit_prefetch": ((4,), {}, {"slow": True, "prefetch": True}),
    # Note [host-shared parameters across hosts]: ranks 0, 1 and 2, 3 pretend
    # to be on two hosts (two copies, the column exchange between them).
    "two_pretend_hosts_slow_rank_bf16": ((4,), {"mp": torch.bfloat16, "reshard_after_forward": 2},
                                         {"pretend_hosts": True, "slow": True, "prefetch": True}),
    # Recomputation and a no-sync micro-batch across hosts: backward
    # unshards (flags only) inside checkpointed blocks.
    "two_pretend_hosts_checkpoint_accumulate": ((4,), {}, {"pretend_hosts": True, "ac": True,
                                                           "accumulate": True}),
    # layers.0's backward prefetches layers.1, which has finished its
    # backward: an unshard nobody waits for, completed (its flags exchanged,
    # the epoch published) when the backward ends.
    "two_pretend_hosts_mistargeted_backward_prefetch": ((4,), {}, {"pretend_hosts": True,
                                                                   "mistargeted": True}),
}


def _slow_hooks(model):
    """Rank 1 sleeps inside every block's forward and backward."""
    def nap(*_):
        time.sleep(SLOW_SECONDS)

    for layer in model.layers:
        layer.attn.register_forward_pre_hook(nap)
        layer.attn.register_full_backward_pre_hook(nap)


def _train(ctx, impl, host_shared, case):
    if not CASES[case][2].get("pretend_hosts"):
        return _train_on(ctx, impl, host_shared, case)
    pretend = f"pretend-host-{dist.get_rank() // 2}"
    with mock.patch("torch_fsdp_ext.fsdp._host_shared.socket.gethostname", return_value=pretend):
        return _train_on(ctx, impl, host_shared, case)


def _train_on(ctx, impl, host_shared, case):
    shape, kwargs, extras = CASES[case]
    api = fsdp_api(impl)
    kwargs = dict(kwargs)
    if "mp" in kwargs:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=kwargs.pop("mp"))
    mesh = make_mesh(ctx, "fsdp_ext", shape)
    torch.manual_seed(0)
    model = TinyLM(n_layers=2, ac="outer" if extras.get("ac") else None)
    rank = dist.get_rank()
    slow = extras.get("slow") and rank == 1
    if slow:
        _slow_hooks(model)
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh, **kwargs)
    api.fully_shard(model, mesh=mesh, **kwargs)
    if extras.get("prefetch"):
        layers = list(model.layers)
        layers[0].set_modules_to_forward_prefetch([layers[1]])
        layers[1].set_modules_to_backward_prefetch([layers[0]])
    if extras.get("mistargeted"):
        model.layers[0].set_modules_to_backward_prefetch([model.layers[1]])
    if extras.get("per_parameter") and impl == "ours":
        model.set_per_parameter_collectives(True)
    if host_shared:
        model.set_host_shared_parameters()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if extras.get("accumulate"):
                model.set_requires_gradient_sync(False)
                lm_loss(model(lm_batch(rank, 100 + step)[0]), lm_batch(rank, 100 + step)[1]).backward()
                model.set_requires_gradient_sync(True)
            tokens, targets = lm_batch(rank, step)
            loss = lm_loss(model(tokens), targets)
            loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.full_tensor().detach() for p in model.parameters()]
        if slow:
            time.sleep(SLOW_SECONDS)
        optim.step()
        optim.zero_grad()
    counts = Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))
    shared = [g.host_shared for m in model.modules() if isinstance(m, api.FSDPModule)
              for g in m._get_fsdp_state()._fsdp_param_groups] if impl == "ours" else []
    params = [p.full_tensor().detach() for p in model.parameters()]
    return {"losses": losses, "grads": grads, "params": params, "counts": counts,
            "shared": shared}


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", list(CASES))
def test_host_shared_changes_no_number(case):
    pool = get_pool(4)
    runs = {
        "host_shared": pool.run(_train, "ours", True, case),
        "ours": pool.run(_train, "ours", False, case),
        "upstream": pool.run(_train, "upstream", False, case),
    }
    for rank in range(4):
        shared = runs["host_shared"][rank]
        assert shared["shared"] == [True] * 3, shared["shared"]
        for reference in ("ours", "upstream"):
            for what in ("losses", "grads", "params"):
                assert _equal(shared[what], runs[reference][rank][what]), \
                    (case, rank, reference, what)
        counts = shared["counts"]
        assert not any("allgather" in name for name in counts), counts
        # Across (pretend) hosts, only the column exchange's messages.
        across = CASES[case][2].get("pretend_hosts", False)
        assert ("c10d::send" in counts and "c10d::recv_" in counts) == across, counts
        # The reference does gather (flat, or per parameter).
        assert any("allgather" in name for name in runs["ours"][rank]["counts"])


# --------------------------------------------------------------------------
# The backward reuses the forward's values (Note [the backward reuses the
# forward's host-shared values])


def _events(prof, prefix):
    return Counter(e.name for e in prof.events() if e.name.startswith(prefix))


def _backward_reuse(ctx, host_shared, pretend_hosts, change_on_rank):
    """One step on 4 ranks (two pretend hosts of 2, or one host). Between
    forward and backward, rank `change_on_rank` (None: no rank) halves its
    shards of layers.0 in place. Returns the gradients, and what forward
    and backward did: FSDP's copy-in ranges and the c10d sends."""
    rank = dist.get_rank()
    hostname = f"pretend-host-{rank // 2}" if pretend_hosts else "one-host"
    with mock.patch("torch_fsdp_ext.fsdp._host_shared.socket.gethostname", return_value=hostname):
        torch.manual_seed(0)
        model = TinyLM(n_layers=2)
        api = fsdp_api("ours")
        for layer in model.layers:
            api.fully_shard(layer)
        api.fully_shard(model)
        if host_shared:
            model.set_host_shared_parameters()
        tokens, targets = lm_batch(rank, 0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as forward:
            loss = lm_loss(model(tokens), targets)
    if change_on_rank == rank:
        with torch.no_grad():
            for p in model.layers[0].parameters():
                p.mul_(0.5)  # the sharded DTensors, in place (seen by the byte comparison)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as backward:
        loss.backward()
    params_per_group = {g.module_fqn: len(g.params) for m in model.modules()
                        if isinstance(m, api.FSDPModule)
                        for g in m._get_fsdp_state()._fsdp_param_groups}
    grads = [p.grad.full_tensor() for p in model.parameters()]
    return {"grads": grads, "params_per_group": params_per_group,
            "copy_in": [_events(forward, "FSDP::all_gather_copy_in"),
                        _events(backward, "FSDP::all_gather_copy_in")],
            "sends": [_events(forward, "c10d::send")["c10d::send"],
                      _events(backward, "c10d::send")["c10d::send"]]}


def test_the_backward_reuses_the_forward_values_across_hosts():
    pool = get_pool(4)
    shared = pool.run(_backward_reuse, True, True, None)
    reference = pool.run(_backward_reuse, False, True, None)
    for rank in range(4):
        assert _equal(shared[rank]["grads"], reference[rank]["grads"]), rank
        forward_copies, backward_copies = shared[rank]["copy_in"]
        # Both layers write their shards in forward, nothing in backward (the
        # root keeps its parameters from forward to backward anyway).
        assert sum(forward_copies[f"FSDP::all_gather_copy_in ({fqn})"]
                   for fqn in ("layers.0", "layers.1")) == 2, forward_copies
        assert not backward_copies, backward_copies
        per_group = shared[rank]["params_per_group"]
        # Forward: a message per parameter to the one column peer; backward:
        # a flag per resharded group.
        assert shared[rank]["sends"] == [sum(per_group.values()), 2], \
            (shared[rank]["sends"], per_group)


@pytest.mark.parametrize("pretend_hosts", [False, True], ids=["one_host", "two_pretend_hosts"])
def test_shards_changed_between_forward_and_backward_on_one_rank(pretend_hosts):
    # Rank 1's changed shards reach every rank's backward, as a re-gather
    # would bring them. Across hosts only rank 1 writes again and its flag
    # says its data follows; within one host every backward unshard writes.
    pool = get_pool(4)
    shared = pool.run(_backward_reuse, True, pretend_hosts, 1)
    reference = pool.run(_backward_reuse, False, pretend_hosts, 1)
    unchanged = pool.run(_backward_reuse, False, pretend_hosts, None)
    for rank in range(4):
        assert _equal(shared[rank]["grads"], reference[rank]["grads"]), rank
        assert not _equal(reference[rank]["grads"], unchanged[rank]["grads"]), rank
        writes = sum(shared[rank]["copy_in"][1].values())
        if not pretend_hosts:
            assert writes == 2, (rank, shared[rank]["copy_in"][1])
            continue
        assert writes == (1 if rank == 1 else 0), (rank, shared[rank]["copy_in"][1])
        layer0 = shared[rank]["params_per_group"]["layers.0"]
        assert shared[rank]["sends"][1] == 2 + (layer0 if rank == 1 else 0), \
            (rank, shared[rank]["sends"])


# --------------------------------------------------------------------------
# A slower rank's parameters are not overwritten under it


def _changing_shards(ctx, host_shared):
    """Forward only, one group resharded after each forward; between
    forwards every rank halves its own shards. Rank 1 sleeps after its
    unshard, before it reads the parameters."""
    torch.manual_seed(0)
    inner = nn.Linear(64, 64)
    model = nn.Sequential(inner, nn.Tanh())
    if dist.get_rank() == 1:
        inner.register_forward_pre_hook(lambda *_: time.sleep(0.2))
    fsdp_api("ours").fully_shard(model, reshard_after_forward=True)
    if host_shared:
        model.set_host_shared_parameters()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    outputs = []
    with torch.no_grad():
        for _ in range(4):
            outputs.append(model(x))
            for p in model.parameters():
                p.to_local().mul_(0.5)
    return outputs


def test_a_slower_rank_reads_the_values_of_its_own_unshard():
    pool = get_pool(2)
    shared = pool.run(_changing_shards, True)
    reference = pool.run(_changing_shards, False)
    for rank in range(2):
        assert _equal(shared[rank], reference[rank]), rank
    assert not torch.equal(reference[0][0], reference[0][1])  # the shards did change


# --------------------------------------------------------------------------
# Lifetime, a dead rank, refusals


def _shm_files():
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("torch_fsdp_ext-"))


def _shm_mappings():
    with open("/proc/self/maps") as f:
        return sum("/torch_fsdp_ext-" in line for line in f)


def _trained_host_shared_model():
    model = TinyLM(n_layers=2)
    api = fsdp_api("ours")
    for layer in model.layers:
        api.fully_shard(layer)
    api.fully_shard(model)
    model.set_host_shared_parameters()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        tokens, targets = lm_batch(dist.get_rank(), step)
        lm_loss(model(tokens), targets).backward()
        optim.step()
        optim.zero_grad()
    return model


def _lifetime(ctx):
    gc.collect()  # an earlier test's model in this pool worker, unreachable but not collected
    before = _shm_mappings()
    model = _trained_host_shared_model()
    files, in_use = _shm_files(), _shm_mappings() - before
    modules = [weakref.ref(m) for m in model.modules()]
    del model
    gc.collect()
    return files, in_use, [m() is None for m in modules], _shm_mappings() - before


def test_the_shm_file_is_gone_once_mapped_and_the_mapping_with_the_model():
    for files, in_use, model_freed, left in get_pool(2).run(_lifetime):
        assert files == [], files  # unlinked once every rank mapped it
        assert in_use >= 3, in_use  # one mapping per group (3), in use
        assert all(model_freed), model_freed  # del + gc.collect() frees every module
        assert left == 0, left  # and with it the host's shared memory


DEAD_RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {test_dir!r})
    import torch, torch.distributed as dist
    import torch_fsdp_ext
    from fsdp_testing import TinyLM, lm_batch, lm_loss
    dist.init_process_group("fsdp_ext")
    rank = dist.get_rank()
    model = TinyLM(n_layers=2)
    for layer in model.layers:
        torch_fsdp_ext.fully_shard(layer)
    torch_fsdp_ext.fully_shard(model)
    model.set_host_shared_parameters()
    tokens, targets = lm_batch(rank, 0)
    lm_loss(model(tokens), targets).backward()
    dist.barrier()
    if rank == 1:
        os._exit(0)  # gone while rank 0 unshards next
    time.sleep(0.5)
    start = time.monotonic()
    try:
        model(tokens)
    except Exception as e:
        print("ERROR", type(e).__name__, round(time.monotonic() - start, 2), str(e), flush=True)
        os._exit(0)
    print("NO ERROR", flush=True)
    os._exit(0)
""")


def test_a_rank_that_exits_is_an_error_within_seconds(tmp_path):
    script = tmp_path / "dead_rank.py"
    script.write_text(DEAD_RANK_SCRIPT.format(test_dir=os.path.dirname(__file__)))
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(script)],
        capture_output=True, text=True, timeout=120,
        # torchrun's agent leaves its torchelastic_* directory when a worker
        # dies: in the test's own directory, not in /tmp.
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR"))]
    assert len(lines) == 1, out.stdout + out.stderr
    _, kind, seconds, message = lines[0].split(" ", 3)
    assert kind == "DistBackendError" and float(seconds) < 5, lines[0]
    assert "rank 1 (pid" in message and "exited while rank 0 waited" in message, message


def _refusals(ctx):
    api = fsdp_api("ours")
    messages = []
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    api.fully_shard(model, shard_placement_fn=lambda p: Shard(p.ndim - 1))
    model.set_host_shared_parameters()
    try:
        model(torch.randn(2, 8))
    except NotImplementedError as e:
        messages.append(str(e))
    model = api.fully_shard(nn.Linear(8, 8))
    model(torch.randn(2, 8))
    try:
        model.set_host_shared_parameters()
    except RuntimeError as e:
        messages.append(str(e))
    return messages


def test_refusals():
    dim_1, too_late = get_pool(2).run(_refusals)[0]
    assert "sharded on dim 0" in dim_1 and "is sharded on dim 1" in dim_1, dim_1
    assert "before the first forward" in too_late, too_late


def test_host_layout_pairs_each_rank_with_its_column():
    from torch_fsdp_ext.fsdp._host_shared import host_layout

    # One host: all ranks, and a column of one (no exchange).
    assert host_layout(["a"] * 3, 1) == ([0, 1, 2], [1])
    # Two hosts, ranks interleaved: each host's ranks in rank order; column l
    # holds the l-th rank of every host, hosts in order of their first rank.
    assert host_layout(["b", "a", "b", "a"], 0) == ([0, 2], [0, 1])
    assert host_layout(["b", "a", "b", "a"], 3) == ([1, 3], [2, 3])
    assert host_layout(["a", "a", "b", "b", "c", "c"], 5) == ([4, 5], [1, 3, 5])
    with pytest.raises(NotImplementedError, match=r"unequal numbers.*'a': 3, 'b': 1"):
        host_layout(["a", "a", "a", "b"], 3)
