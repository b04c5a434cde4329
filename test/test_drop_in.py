"""torch_fsdp_ext as a drop-in for the ecosystem: our sharded modules are
instances of upstream's ``torch.distributed.fsdp.FSDPModule``, upstream's
public functions that take FSDP modules accept them, and
``use_as_fully_shard()`` makes ``torch.distributed.fsdp.fully_shard`` ours
until undone (nothing is routed on import).

Routing rebinds module globals in the worker processes: every check undoes it
in ``finally``, so a failure cannot leak into the next test on the pool.
"""

import json
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import get_pool
from fsdp_testing import IMPLS, TinyLM, fsdp_api, lm_batch, lm_loss, tracker_phase_sizes


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _shard_lm(fully_shard, mesh):
    torch.manual_seed(0)
    model = TinyLM()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model, rank, steps=3, forward=None):
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        tokens, targets = lm_batch(rank, step)
        logits = (forward or model)(tokens)
        loss = lm_loss(logits, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


# --------------------------------------------------------------------------
# The class


def check_module_class(ctx):
    import torch.distributed._composable.fsdp as composable
    import torch.distributed.fsdp as upstream

    import torch_fsdp_ext

    mesh = _mesh()
    model = _shard_lm(torch_fsdp_ext.fully_shard, mesh)
    grouped = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    torch_fsdp_ext.fully_shard([grouped[0], grouped[2]], mesh=mesh)
    for module in [model, *model.layers, grouped[0], grouped[2]]:
        assert isinstance(module, upstream.FSDPModule), type(module).__mro__
        assert isinstance(module, composable.FSDPModule), type(module).__mro__
        assert isinstance(module, torch_fsdp_ext.FSDPModule), type(module).__mro__
    assert not isinstance(grouped, upstream.FSDPModule)

    # Every method upstream's class defines is ours again, so no upstream
    # body (which reads upstream's private state) runs on our modules.
    # __new__ is the exception: upstream's, steered by _orig_cls_mro_index.
    ours = vars(torch_fsdp_ext.FSDPModule)
    upstream_methods = {name for name, value in vars(upstream.FSDPModule).items()
                        if callable(value) and name != "__new__"}
    assert upstream_methods, "found no methods on upstream's FSDPModule"
    missing = sorted(name for name in upstream_methods if name not in ours)
    assert not missing, f"upstream FSDPModule methods not defined by ours: {missing}"

    # Upstream's __new__ builds the original class when an FSDP class is
    # constructed (slicing a sharded Sequential), finding it by our index.
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    torch_fsdp_ext.fully_shard(seq, mesh=mesh)
    assert type(seq[0:1]) is nn.Sequential, type(seq[0:1])

    handle = model.layers[0].unshard(async_op=True)
    assert isinstance(handle, upstream.UnshardHandle), type(handle)
    handle.wait()
    model.layers[0].reshard()
    return True


def test_sharded_modules_are_upstream_fsdp_modules():
    assert get_pool(2).run(check_module_class) == [True, True]


# --------------------------------------------------------------------------
# Upstream's public functions on our modules


class Scorer(nn.Module):
    """A model used through a method other than forward."""

    def __init__(self):
        super().__init__()
        self.lm = TinyLM()

    def forward(self, tokens):
        return self.lm(tokens)

    def score(self, tokens):
        return self.lm(tokens) * 0.5


def check_upstream_functions(ctx, impl):
    """Upstream's register_fsdp_forward_method and share_comm_ctx applied to
    ``impl``'s modules; the losses of training through the registered method."""
    import torch.distributed.fsdp as upstream

    api = fsdp_api(impl)
    mesh = _mesh()
    torch.manual_seed(0)
    model = Scorer()
    for block in model.lm.layers:
        api.fully_shard(block, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    upstream.register_fsdp_forward_method(model, "score")
    losses = _train(model, ctx.rank, forward=model.score)

    # Two roots (pipeline stages) sharing one comm context.
    stages = [api.fully_shard(nn.Linear(8, 8), mesh=mesh) for _ in range(2)]
    upstream.share_comm_ctx(stages)
    states = [stage._get_fsdp_state() for stage in stages]
    assert states[1]._comm_ctx is states[0]._comm_ctx
    # (_fsdp_param_group: a state's one group, on every torch; upstream's
    # _fsdp_param_groups came with torch 2.12.)
    assert states[1]._fsdp_param_group.comm_ctx is states[0]._comm_ctx
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(ctx.rank))
    stages[1](stages[0](x)).sum().backward()
    grads = [p.grad.full_tensor() for stage in stages for p in stage.parameters()]
    return losses, grads


def _ours_equals_upstream(check):
    """Runs ``check(ctx, impl)`` (returning losses and tensors) for both
    implementations on 2 ranks; each rank's losses and tensors must be equal
    bit for bit. Returns the results by implementation."""
    per_impl = {impl: get_pool(2).run(check, impl) for impl in IMPLS}
    for rank in range(2):
        ours_losses, ours_tensors = per_impl["ours"][rank]
        up_losses, up_tensors = per_impl["upstream"][rank]
        assert ours_losses == up_losses, (rank, ours_losses, up_losses)
        assert len(ours_tensors) == len(up_tensors), rank
        assert all(torch.equal(a, b) for a, b in zip(ours_tensors, up_tensors)), rank
    return per_impl


def test_upstream_functions_accept_our_modules():
    _ours_equals_upstream(check_upstream_functions)


def check_mixing_refused(ctx):
    import torch.distributed.fsdp as upstream

    import torch_fsdp_ext

    mesh = _mesh()
    ours = torch_fsdp_ext.fully_shard(nn.Linear(4, 4), mesh=mesh)
    theirs = upstream.fully_shard(nn.Linear(4, 4), mesh=mesh)
    messages = []
    for call in (lambda: torch_fsdp_ext.share_comm_ctx([ours, theirs]),
                 lambda: ours.set_modules_to_forward_prefetch([theirs])):
        with pytest.raises(ValueError) as info:
            call()
        messages.append(str(info.value))
    return messages


def check_upstream_mixers_refuse_our_modules(ctx):
    """Upstream's share_comm_ctx and its modules' prefetch setters, given a
    list that mixes our modules with upstream's: a ValueError naming the
    function before anything changed (both modules train a step after)."""
    import torch.distributed.fsdp as upstream
    from torch.distributed.fsdp._fully_shard._fully_shard import share_comm_ctx

    import torch_fsdp_ext

    mesh = _mesh()
    calls = {
        "share_comm_ctx([ours, theirs])": lambda o, t: share_comm_ctx([o, t]),
        "share_comm_ctx([theirs, ours])": lambda o, t: share_comm_ctx([t, o]),
        "theirs.set_modules_to_forward_prefetch([ours])":
            lambda o, t: t.set_modules_to_forward_prefetch([o]),
        "theirs.set_modules_to_backward_prefetch([ours])":
            lambda o, t: t.set_modules_to_backward_prefetch([o]),
    }
    messages = {}
    for name, call in calls.items():
        ours = torch_fsdp_ext.fully_shard(nn.Linear(4, 4), mesh=mesh)
        theirs = upstream.fully_shard(nn.Linear(4, 4), mesh=mesh)
        try:
            call(ours, theirs)
            messages[name] = "no error"
        except ValueError as error:
            messages[name] = str(error)
        x = torch.randn(2, 4)
        (ours(x).sum() + theirs(x).sum()).backward()
    # Our modules alone: upstream's share_comm_ctx works on them.
    first = torch_fsdp_ext.fully_shard(nn.Linear(4, 4), mesh=mesh)
    second = torch_fsdp_ext.fully_shard(nn.Linear(4, 4), mesh=mesh)
    share_comm_ctx([first, second])
    messages["shared"] = first._get_fsdp_state()._comm_ctx is second._get_fsdp_state()._comm_ctx
    return messages


def test_upstream_functions_refuse_lists_mixing_the_two_runtimes():
    for messages in get_pool(2).run(check_upstream_mixers_refuse_our_modules):
        assert messages.pop("shared") is True
        for name, message in messages.items():
            assert "together with modules sharded by torch.distributed.fsdp.fully_shard" in \
                message, (name, message)
        assert messages["share_comm_ctx([theirs, ours])"].startswith(
            "torch.distributed.fsdp.share_comm_ctx was given"), messages
        assert messages["theirs.set_modules_to_backward_prefetch([ours])"].startswith(
            "upstream's FSDPModule.set_modules_to_backward_prefetch (on FSDPLinear)"), messages


def test_modules_of_upstreams_runtime_are_refused_by_ours_with_a_clear_error():
    for messages in get_pool(2).run(check_mixing_refused):
        for message in messages:
            assert "torch.distributed.fsdp.fully_shard, not torch_fsdp_ext's" in message, message


# The states FSDPMemTracker records per module, and the kinds of memory whose
# sizes follow from the model alone (its parameters, their unsharded copies
# and gradients, the optimizer's state). Peak snapshots are left out: they
# land wherever the peak fell, which garbage collection moves. Where ours and
# upstream's differ by design: the collectives' buffers (ours frees the
# forward's flat all-gather output sooner), and the sharded gradients, which ours makes when
# the next group's reduce-scatter completes, so the tracker counts them as
# temporary memory.
_TRACKED_KINDS = ("SHARDED_PARAM", "UNSHARDED_PARAM", "UNSHARDED_GRAD", "OPT")


def _tracker_model(fully_shard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    for block in (model[0], model[2]):
        fully_shard(block, mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _tracker_step(model, optim, step):
    model(torch.full((4, 64), 1.0 + dist.get_rank() + step)).sum().backward()
    optim.step()
    optim.zero_grad()


def _track_memory(fully_shard):
    """A small model sharded per block: one step, two under torch's
    FSDPMemTracker (its statistics reset after the first), one after. Returns
    the tracker's per-module snapshots, the parameters after training, and
    the model (whose hooks the tracker handed back)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    model, optim = _tracker_model(fully_shard)
    _tracker_step(model, optim, 0)  # its buffers made before the tracker watches
    tracker = FSDPMemTracker(model, optim)
    with tracker:
        _tracker_step(model, optim, 1)
        tracker.reset_mod_stats()
        _tracker_step(model, optim, 2)
    snapshots = tracker_phase_sizes(tracker, _TRACKED_KINDS)
    _tracker_step(model, optim, 3)  # through the hooks handed back
    params = [p.full_tensor().clone() for p in model.parameters()]
    return snapshots, params, model


def _settled_cache_idle_bytes():
    """The block cache's idle bytes once they stop changing: a collective's
    buffer returns to the cache when the backend drops its last reference,
    which may be on its progress thread just after the op's wait()."""
    import time

    from torch_fsdp_ext import _C

    last, unchanged = _C._fsdp_host_cache_idle_bytes(), 0
    for _ in range(500):  # settled: the same for 100 ms
        time.sleep(0.02)
        now = _C._fsdp_host_cache_idle_bytes()
        unchanged = unchanged + 1 if now == last else 0
        if unchanged == 5:
            break
        last = now
    return last


def check_fsdp_mem_tracker(ctx):
    import torch.distributed.fsdp as upstream

    import torch_fsdp_ext
    from torch_fsdp_ext import _C

    theirs, _, _ = _track_memory(upstream.fully_shard)
    ours, params, model = _track_memory(torch_fsdp_ext.fully_shard)
    untracked, optim = _tracker_model(torch_fsdp_ext.fully_shard)
    for step in range(4):
        _tracker_step(untracked, optim, step)
    # The tracker handed every hook back: the C++ forward hooks in their
    # place, the groups' backward methods their own again.
    restored = []
    for block in (model[0], model[2]):
        state = block._get_fsdp_state()
        group = state._fsdp_param_group
        restored.append(state._cpp_forward_hooks[0] in block._forward_pre_hooks.values())
        restored.append(state._cpp_forward_hooks[1] in block._forward_hooks.values())
        restored.append(type(group.pre_backward).__name__ == "builtin_function_or_method")
        restored.append(type(group.post_backward).__name__ == "builtin_function_or_method")
    # After the tracker, buffers come from the block cache again, also those
    # first made while it watched: a step frees as much into the cache as a
    # step of a model it never watched.
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    first_tracked = _tracker_model(torch_fsdp_ext.fully_shard)
    with FSDPMemTracker(*first_tracked):
        _tracker_step(*first_tracked, 0)
    never_tracked = _tracker_model(torch_fsdp_ext.fully_shard)
    _tracker_step(*never_tracked, 0)
    idle = []
    for trained in (first_tracked, never_tracked):
        _settled_cache_idle_bytes()
        _C._fsdp_host_cache_release_idle()
        _tracker_step(*trained, 1)
        idle.append(_settled_cache_idle_bytes())
    return {
        "ours": ours,
        "theirs": theirs,
        "same training": all(torch.equal(a, b.full_tensor())
                             for a, b in zip(params, untracked.parameters())),
        "restored": restored,
        "cache idle bytes after a step (first tracked, never tracked)": idle,
    }


def test_fsdp_mem_tracker_on_our_modules_counts_what_it_counts_on_upstreams():
    """torch's FSDPMemTracker instruments our modules as upstream's: the same
    modules and phases, the same parameter, gradient and optimizer memory in
    each; training under it is bit for bit training without it; on exit our
    C++ hooks are back."""
    for result in get_pool(2).run(check_fsdp_mem_tracker):
        ours, theirs = result["ours"], result["theirs"]
        assert sorted(ours) == sorted(theirs), (sorted(ours), sorted(theirs))
        assert len(ours) == 16, sorted(ours)  # 2 blocks x 8 phases
        for key in theirs:
            assert ours[key] == theirs[key], (key, "ours", ours[key], "upstream", theirs[key])
        # Not vacuous: the blocks' unsharded parameters were seen after unsharding.
        assert ours[("FSDPSequential.0", "AFT_PRE_FW")]["UNSHARDED_PARAM"] > 0, ours
        assert result["same training"], result
        assert all(result["restored"]), result["restored"]
        idle = result["cache idle bytes after a step (first tracked, never tracked)"]
        assert idle[0] == idle[1] > 0, idle


def check_fsdp_mem_tracker_grouped(ctx):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    import torch_fsdp_ext

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    torch_fsdp_ext.fully_shard([model[0], model[1]], mesh=_mesh())
    torch_fsdp_ext.fully_shard(model, mesh=_mesh())
    try:
        with FSDPMemTracker(model):
            pass
        message = "ran"
    except NotImplementedError as error:
        message = str(error)
    model(torch.ones(2, 8)).sum().backward()  # its hooks untouched
    return message, all(p.grad is not None for p in model.parameters())


def test_fsdp_mem_tracker_refuses_a_state_of_several_modules_up_front():
    for message, trained in get_pool(2).run(check_fsdp_mem_tracker_grouped):
        assert "several modules (FSDPLinear, FSDPLinear)" in message, message
        assert "FSDPMemTracker" in message and "mem_tracker.MemTracker" in message, message
        assert trained


def check_mem_tracker(ctx):
    from torch.distributed._tools.mem_tracker import MemTracker

    import torch_fsdp_ext

    tracker = MemTracker()
    model = torch_fsdp_ext.fully_shard(nn.Linear(8, 8), mesh=_mesh())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker.track_external(model, optim)
    with tracker:
        model(torch.ones(2, 8)).sum().backward()
        optim.step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_mem_tracker_on_our_modules():
    for peak in get_pool(2).run(check_mem_tracker):
        # Parameters, gradients and activations of the 8x8 layer (its shard) at least.
        assert peak >= (8 * 8 + 8) * 4 // 2, peak


# --------------------------------------------------------------------------
# use_as_fully_shard


_FRAMEWORK = "fake_framework_imported_before_routing"


def _framework_shard(model, mesh):
    """A framework's FSDP2 path: it names torch's fully_shard at call time."""
    import torch.distributed.fsdp

    for block in model.layers:
        torch.distributed.fsdp.fully_shard(block, mesh=mesh)
    torch.distributed.fsdp.fully_shard(model, mesh=mesh)


def check_routing(ctx):
    import torch.distributed._composable.fsdp as composable
    import torch.distributed.fsdp as upstream
    import torch.distributed.fsdp._fully_shard._fully_shard as upstream_impl

    import torch_fsdp_ext

    upstream_fn = upstream.fully_shard
    ours_fn = torch_fsdp_ext.fully_shard
    composable_module = sys.modules["torch.distributed._composable.fsdp.fully_shard"]
    # A framework that ran `from torch.distributed.fsdp import fully_shard`
    # before the routing.
    framework = types.ModuleType(_FRAMEWORK)
    framework.fully_shard = upstream_fn
    framework.shard = upstream_fn  # under another name, too
    sys.modules[_FRAMEWORK] = framework

    def names():
        """Where code finds fully_shard by name, and what each holds now."""
        return {"torch.distributed.fsdp": upstream.fully_shard,
                "torch.distributed._composable.fsdp": composable.fully_shard,
                "its fully_shard module": composable_module.fully_shard,
                "framework.fully_shard": framework.fully_shard,
                "framework.shard": framework.shard}

    mesh = _mesh()
    routing = torch_fsdp_ext.use_as_fully_shard()
    try:
        assert upstream_fn is not ours_fn
        for where, fn in names().items():
            assert fn is ours_fn, where
        # Upstream's own module keeps its function (its body reads it).
        assert upstream_impl.fully_shard is upstream_fn

        # Nested routings: upstream's comes back when the last one ends.
        with torch_fsdp_ext.use_as_fully_shard() as inner:
            assert inner.active and upstream.fully_shard is ours_fn
        assert not inner.active and upstream.fully_shard is ours_fn

        torch.manual_seed(0)
        model = TinyLM()
        _framework_shard(model, mesh)
        for module in [model, *model.layers]:
            assert isinstance(module, torch_fsdp_ext.FSDPModule), type(module).__mro__
            # fully_shard.state through torch's name finds our state.
            assert upstream.fully_shard.state(module) is module._get_fsdp_state()
        routed_losses = _train(model, ctx.rank)
    finally:
        routing.undo()
        del sys.modules[_FRAMEWORK]
    assert not routing.active
    routing.undo()  # again: nothing
    for where, fn in names().items():
        assert fn is upstream_fn, where

    model = TinyLM()
    _framework_shard(model, mesh)
    assert isinstance(model, upstream.FSDPModule), type(model).__mro__
    assert not isinstance(model, torch_fsdp_ext.FSDPModule), type(model).__mro__
    direct_losses = _train(_shard_lm(ours_fn, mesh), ctx.rank)
    upstream_losses = _train(_shard_lm(upstream_fn, mesh), ctx.rank)
    return routed_losses, direct_losses, upstream_losses


def test_use_as_fully_shard_routes_torch_names_until_undone():
    for rank, (routed, direct, upstream) in enumerate(get_pool(2).run(check_routing)):
        assert routed == direct == upstream, (rank, routed, direct, upstream)


# --------------------------------------------------------------------------
# torch's pipelining, which branches on FSDPModule: before torch 2.15 it
# reaches FSDP state through upstream's fully_shard.state, from 2.15 on it
# calls set_manual_backward_finalization and finalize_backward(async_op=True)


def check_pipeline_stages(ctx, impl):
    """Two pipeline stages (one per rank), each sharded by ``impl`` over its
    own one-rank data-parallel mesh, trained with GPipe: the schedule turns
    gradient sync off per micro-batch and reduces in its REDUCE_GRAD action
    (through upstream's fully_shard.state before torch 2.15, through manual
    backward finalization from 2.15 on)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    api = fsdp_api(impl)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]
    stage_module = nn.Sequential(*(layers[:2] if ctx.rank == 0 else layers[2:]))
    api.fully_shard(stage_module, mesh=mesh["dp"])
    stage = PipelineStage(stage_module, stage_index=ctx.rank, num_stages=2,
                          device=torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=2,
                             loss_fn=lambda out, target: (out - target).pow(2).mean())
    optim = torch.optim.SGD(stage_module.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        if ctx.rank == 0:
            schedule.step(x)
        else:
            step_losses = []
            schedule.step(target=target, losses=step_losses)
            losses.append([loss.item() for loss in step_losses])
        optim.step()
        optim.zero_grad()
    return losses, [p.detach().full_tensor() for p in stage_module.parameters()]


def test_pipeline_schedule_with_our_stages_matches_upstream():
    per_impl = _ours_equals_upstream(check_pipeline_stages)
    assert len(per_impl["ours"][1][0]) == 3  # the last stage saw every step's losses


def test_memory_estimation_on_fake_tensors_matches_upstreams():
    """torchtitan's memory estimation: a fake process group, the model made
    and trained under FakeTensorMode, FSDPMemTracker over two steps
    (test/fake_estimation_job.py, one process, this rank 3 of 4). Ours makes
    its buffers fake and copies with ATen ops there, so the tracker reports
    the same peak and the same parameter, gradient and optimizer memory in
    every module and phase as for upstream's; the sharded gradients count as
    temporary memory, as on real tensors. Then plain fake steps, over 4 ranks
    and over one: the same shards (padded ones too) and optimizer state, every
    tensor fake."""
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_estimation_job.py")
    proc = subprocess.run([sys.executable, job], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout)
    ours, theirs = result["ours"], result["upstream"]
    assert ours["estimate"]["phases"] == theirs["estimate"]["phases"]
    assert len(ours["estimate"]["phases"]) == 24  # 3 modules x 8 phases
    peak_ours, peak_theirs = ours["estimate"]["peak"], theirs["estimate"]["peak"]
    assert peak_ours["Total"] == peak_theirs["Total"], (peak_ours, peak_theirs)
    grads = ("_FSDPRefType.SHARDED_GRAD", "_FSDPRefType.TEMP")
    for kind in peak_theirs:
        if kind not in grads:
            assert peak_ours[kind] == peak_theirs[kind], (kind, peak_ours, peak_theirs)
    assert sum(peak_ours[k] for k in grads) == sum(peak_theirs[k] for k in grads)
    # Not vacuous: the all-gathers and the unsharded parameters were seen.
    assert peak_ours["_FSDPRefType.ALL_GATHER"] > 0 < peak_ours["_FSDPRefType.UNSHARDED_PARAM"]
    for plain in ("plain", "plain, one rank"):
        assert ours[plain] == theirs[plain], (plain, ours[plain], theirs[plain])
        assert ours[plain]["all fake"], plain
    assert [61, 64] in ours["plain"]["shards"], ours["plain"]["shards"]  # rank 3's short shard
