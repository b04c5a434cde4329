"""The runtime behaviours the seed scenarios leave implicit: unsharded memory
is released on reshard (the storage, not the tensors autograd saved), a
trained model is freed by `del`,
gradient accumulation without sync, unshard_in_backward, meta-device init,
ignored parameters, a dtype change after wrapping, recovery with
reset_iter_state after an exception mid-forward, nested traces, and clear
errors for the features this release does not implement.

Where upstream supports the same thing, a check runs on both implementations
so its expectation is the reference's behaviour."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from conftest import get_pool
from fsdp_testing import (
    AG, IMPLS, MLP, RS, MLPStack, assert_params_match, average_grads, comm_counts,
    counting_comms, fsdp_api, mlp_batch, shard_stack,
)


def storage_bytes(tensor):
    return tensor.untyped_storage().nbytes()


def train_alongside(ctx, model, ref, steps):
    """SGD steps on the sharded model and its data-parallel reference, then
    every parameter must match."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        x = mlp_batch(ctx.rank, step)
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        average_grads(ref, ctx.gloo_group, ctx.world_size)
        optim.step()
        optim.zero_grad()
        ref_optim.step()
        ref_optim.zero_grad()
    assert_params_match(model, ref)


# --------------------------------------------------------------------------
# Memory: reshard releases the unsharded storage


def check_unsharded_storage_released(ctx):
    import torch_fsdp_ext

    torch.manual_seed(0)
    model = shard_stack(MLPStack(n=3, dim=16, hidden=32), fsdp_api("ours"))
    mlp = model[1]
    group = mlp._get_fsdp_state()._fsdp_param_group
    loss = model(mlp_batch(ctx.rank, 0, dim=16)).sum()
    # After forward the block is resharded: its modules hold DTensors and the
    # unsharded parameters (kept for autograd) have no storage bytes.
    assert isinstance(mlp.in_proj.weight, DTensor)
    assert group.sharded_state == torch_fsdp_ext.ShardedState.SHARDED
    unsharded = [p.unsharded_param for p in group.params]
    assert all(storage_bytes(t) == 0 for t in unsharded), [storage_bytes(t) for t in unsharded]
    # The root keeps its parameters after forward (reshard_after_forward=None).
    root_group = model._get_fsdp_state()._fsdp_param_group
    assert all(storage_bytes(p.unsharded_param) > 0 for p in root_group.params)
    loss.backward()
    # Backward re-gathered into the same tensors and released them again.
    assert [p.unsharded_param for p in group.params] == unsharded
    assert all(storage_bytes(t) == 0 for t in unsharded)
    assert all(storage_bytes(p.unsharded_param) == 0 for p in root_group.params)
    # Between steps only the padded shards hold parameter memory.
    for p in group.params:
        assert storage_bytes(p.padded_sharded_data) == p.padded_sharded_data.numel() * 4
    return True


@pytest.mark.parametrize("ws", [1, 2])
def test_unsharded_storage_released(ws):
    get_pool(ws).run(check_unsharded_storage_released)


def _trained_stack(ctx, impl):
    torch.manual_seed(0)
    model = shard_stack(MLPStack(n=3, dim=16, hidden=32), fsdp_api(impl), reshard_after_forward=2)
    model[1].set_modules_to_forward_prefetch([model[2]])
    model[2].set_modules_to_backward_prefetch([model[1]])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(mlp_batch(ctx.rank, step, dim=16)).sum().backward()
        optim.step()
        optim.zero_grad()
    return model


def check_model_freed_by_del(ctx, impl):
    import gc
    import weakref

    model = _trained_stack(ctx, impl)
    modules = [weakref.ref(m) for m in model.modules()]
    params = [weakref.ref(p) for p in model.parameters()]
    del model
    gc.collect()
    return [m() is None for m in modules], [p() is None for p in params]


@pytest.mark.parametrize("impl", IMPLS)
def test_trained_model_freed_by_del(impl):
    # The C++ runtime holds its modules weakly (a strong edge from C++ back
    # to a module that owns the runtime is a cycle gc cannot see).
    for modules, params in get_pool(2).run(check_model_freed_by_del, impl):
        assert all(modules), modules
        assert all(params), params


# --------------------------------------------------------------------------
# Gradient accumulation without communication


def check_gradient_accumulation(ctx, impl, reshard_after_backward):
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = MLPStack(n=3)
    ref = copy.deepcopy(model)
    shard_stack(model, api)
    microbatches = 3
    counts = []
    for micro in range(microbatches):
        last = micro == microbatches - 1
        model.set_requires_gradient_sync(last)
        # Keeping parameters unsharded between microbatches saves their
        # all-gathers; the last one reshards so the optimizer sees DTensors.
        model.set_reshard_after_backward(reshard_after_backward or last)
        x = mlp_batch(ctx.rank, micro)
        with counting_comms() as mode:
            model(x).pow(2).sum().backward()
        counts.append(comm_counts(mode))
        ref(x).pow(2).sum().backward()
    average_grads(ref, ctx.gloo_group, ctx.world_size)
    for name, param in model.named_parameters():
        ref_grad = dict(ref.named_parameters())[name].grad
        torch.testing.assert_close(param.grad.full_tensor(), ref_grad, rtol=1e-5, atol=1e-5)
    return counts


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reshard_after_backward", [True, False])
def test_gradient_accumulation_without_sync(impl, reshard_after_backward):
    counts = get_pool(2).run(check_gradient_accumulation, impl, reshard_after_backward)[0]
    # Root + 3 MLPs; the MLPs reshard after forward (the root keeps its
    # parameters), so each microbatch gathers them in forward and again in
    # backward, unless backward left them unsharded: then forward needs no
    # all-gather. Only the last microbatch reduce-scatters, once per group.
    if reshard_after_backward:
        assert counts == [{AG: 7}, {AG: 7}, {AG: 7, RS: 4}], counts
    else:
        assert counts == [{AG: 7}, {AG: 3}, {AG: 3, RS: 4}], counts


# --------------------------------------------------------------------------
# unshard_in_backward(False): a module whose backward needs no weights


class EmbedThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def check_unshard_in_backward(ctx, impl):
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = EmbedThenLinear()
    ref = copy.deepcopy(model)
    api.fully_shard(model.embed)
    api.fully_shard(model)
    model.embed.set_unshard_in_backward(False)
    tokens = torch.arange(6).reshape(2, 3) + ctx.rank
    model(tokens).sum()  # lazy init outside the counted region
    model.zero_grad()
    with counting_comms() as mode:
        loss = model(tokens).sum()
    with counting_comms() as backward_mode:
        loss.backward()
    ref(tokens).sum().backward()
    average_grads(ref, ctx.gloo_group, ctx.world_size)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), dict(ref.named_parameters())[name].grad)
    return comm_counts(mode), comm_counts(backward_mode)


@pytest.mark.parametrize("impl", IMPLS)
def test_unshard_in_backward_false(impl):
    forward, backward = get_pool(2).run(check_unshard_in_backward, impl)[0]
    # The root kept its parameters from the warm-up forward (reshard after
    # forward defaults to False on the root); only the embedding gathers,
    # and backward does not re-gather it.
    assert forward == {AG: 1}, forward
    assert backward == {RS: 2}, backward


# --------------------------------------------------------------------------
# Meta-device init


def check_meta_init(ctx, impl):
    api = fsdp_api(impl)
    with torch.device("meta"):
        model = MLPStack(n=2)
    shard_stack(model, api)
    for param in model.parameters():
        assert isinstance(param, DTensor) and param.device.type == "meta"
    with pytest.raises(RuntimeError, match="FSDP parameters should be materialized from meta "
                       "device before training, but the following were still on meta device"):
        model(mlp_batch(ctx.rank, 0))
    # Materialise, then give every parameter a known full value.
    torch.manual_seed(0)
    ref = MLPStack(n=2)
    model = MLPStack(n=2).to("meta")
    shard_stack(model, api)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            rows = param.to_local().shape[0]
            chunk = -(-ref_param.shape[0] // ctx.world_size)
            start = min(ctx.rank * chunk, ref_param.shape[0])
            param.to_local().copy_(ref_param[start:start + rows])
    train_alongside(ctx, model, ref, steps=3)
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ws", [2, 4])
def test_meta_device_init(ws, impl):
    get_pool(ws).run(check_meta_init, impl)


# --------------------------------------------------------------------------
# Ignored parameters and a dtype change after wrapping


def check_ignored_params(ctx, impl):
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = MLPStack(n=2)
    ignored = model[1].out_proj.weight
    shard_stack(model, api, ignored_params={ignored})
    assert model[1].out_proj.weight is ignored and not isinstance(ignored, DTensor)
    assert isinstance(model[1].out_proj.bias, DTensor)
    model(mlp_batch(ctx.rank, 0)).sum().backward()
    # Not reduced: every rank keeps the gradient of its own batch.
    grads = [torch.empty_like(ignored.grad) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(grads, ignored.grad, group=ctx.gloo_group)
    assert not all(torch.equal(grads[0], g) for g in grads[1:])
    return True


@pytest.mark.parametrize("impl", IMPLS)
def test_ignored_params(impl):
    get_pool(2).run(check_ignored_params, impl)


def check_dtype_change(ctx, impl):
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = MLPStack(n=2)
    ref = copy.deepcopy(model).double()
    shard_stack(model, api)
    model.to(torch.float64)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.dtype == torch.float64, name
        assert param.to_local().dtype == torch.float64, name
    x = mlp_batch(ctx.rank, 0).double()
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    average_grads(ref, ctx.gloo_group, ctx.world_size)
    for name, param in model.named_parameters():
        assert param.grad.dtype == torch.float64, name
        torch.testing.assert_close(param.grad.full_tensor(), dict(ref.named_parameters())[name].grad)
    return True


@pytest.mark.parametrize("impl", IMPLS)
def test_dtype_change_after_fully_shard(impl):
    get_pool(2).run(check_dtype_change, impl)


# --------------------------------------------------------------------------
# reset_iter_state after an exception, nested traces


class Flaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(10, 10)
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise ValueError("injected failure")
        return self.lin(x)


def check_reset_iter_state(ctx):
    import torch_fsdp_ext

    torch.manual_seed(0)
    model = nn.Sequential(MLP(10, 24), Flaky(), MLP(10, 24))
    ref = copy.deepcopy(model)
    for module in model:
        torch_fsdp_ext.fully_shard(module)
    torch_fsdp_ext.fully_shard(model)
    # An unsynced microbatch leaves gradients on the unsharded parameters;
    # then a forward fails. Nothing of that iteration may reach the next step.
    model.set_requires_gradient_sync(False)
    model(mlp_batch(ctx.rank, 0)).pow(2).sum().backward()
    model.set_requires_gradient_sync(True)
    model[1].fail = True
    with pytest.raises(ValueError, match="injected failure"):
        model(mlp_batch(ctx.rank, 0))
    model.reset_iter_state()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
    model[1].fail = ref[1].fail = False
    x = mlp_batch(ctx.rank, 1)
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    average_grads(ref, ctx.gloo_group, ctx.world_size)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), dict(ref.named_parameters())[name].grad)
    with pytest.raises(RuntimeError, match="must be called on the root"):
        model[0].reset_iter_state()
    return True


def test_reset_iter_state_after_exception():
    get_pool(2).run(check_reset_iter_state)


def check_reset_iter_state_ends_the_iteration(ctx, impl):
    """What reset_iter_state leaves after a completed step and a failed one,
    as this torch's upstream: the sharded gradients (dropped from torch 2.15
    on, kept before), and a manual-finalization iteration ended (its mode can
    change again)."""
    from fsdp_testing import fsdp_api, upstream_has

    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = nn.Sequential(MLP(10, 24), Flaky(), MLP(10, 24))
    for module in model:
        api.fully_shard(module)
    api.fully_shard(model)
    model(mlp_batch(ctx.rank, 0)).sum().backward()
    if impl == "ours" or upstream_has("manual_backward_finalization"):
        model.set_manual_backward_finalization(True)
        model(mlp_batch(ctx.rank, 1)).sum().backward()
    model[1].fail = True
    with pytest.raises(ValueError, match="injected failure"):
        model(mlp_batch(ctx.rank, 2))
    model.reset_iter_state()
    if impl == "ours" or upstream_has("manual_backward_finalization"):
        model.set_manual_backward_finalization(False)
    return {name: param.grad is not None for name, param in model.named_parameters()}


def test_reset_iter_state_ends_the_iteration_as_upstream():
    from torch.distributed.fsdp import FSDPModule as UpstreamFSDPModule

    if not hasattr(UpstreamFSDPModule, "reset_iter_state"):
        pytest.skip(f"upstream's FSDPModule.reset_iter_state is not in torch {torch.__version__}")
    pool = get_pool(2)
    ours = pool.run(check_reset_iter_state_ends_the_iteration, "ours")
    upstream = pool.run(check_reset_iter_state_ends_the_iteration, "upstream")
    assert ours == upstream, (ours, upstream)
    assert len(set(ours[0].values())) == 1, ours  # every gradient kept, or every one dropped


def check_reshard_after_forward_changed_on_post_forward_mesh(ctx):
    """Parameters left on the reshard_after_forward=k mesh (a no_grad
    forward) go back to full sharding when the setting changes, and the next
    step gathers over the full group."""
    torch.manual_seed(0)
    model = MLPStack(n=2)
    ref = copy.deepcopy(model)
    shard_stack(model, fsdp_api("ours"), reshard_after_forward=2)
    with torch.no_grad():
        model(mlp_batch(ctx.rank, 0))
    assert model[1].in_proj.weight.device_mesh.ndim == 2  # on the post-forward mesh
    model.set_reshard_after_forward(True)
    assert model[1].in_proj.weight.device_mesh.ndim == 1
    train_alongside(ctx, model, ref, steps=2)
    return True


def test_reshard_after_forward_changed_on_post_forward_mesh():
    get_pool(4).run(check_reshard_after_forward_changed_on_post_forward_mesh)


def check_nested_traces(ctx):
    import torch_fsdp_ext

    torch.manual_seed(0)
    model = shard_stack(MLPStack(n=2), fsdp_api("ours"))
    with torch_fsdp_ext.trace_fsdp_events() as outer:
        model(mlp_batch(ctx.rank, 0)).sum().backward()
        with torch_fsdp_ext.trace_fsdp_events() as inner:
            model(mlp_batch(ctx.rank, 1))
    with torch_fsdp_ext.trace_fsdp_events() as after:
        pass
    forward_events = [e for e in outer if e.training_state == torch_fsdp_ext.TrainingState.FORWARD]
    assert [e.event for e in inner] == [e.event for e in forward_events], (inner, outer)
    assert all(e.event != "post_backward" for e in inner)
    assert any(e.event == "post_backward" for e in outer) and after == []
    return True


def test_nested_traces():
    get_pool(2).run(check_nested_traces)


# --------------------------------------------------------------------------
# Not implemented yet: clear errors, not silent differences


def check_not_implemented(ctx):
    import torch_fsdp_ext

    model = torch_fsdp_ext.fully_shard(nn.Linear(4, 4))
    with pytest.raises(NotImplementedError, match="set_symm_mem_for_comm: symmetric memory"):
        model.set_symm_mem_for_comm()
    return True


def test_not_implemented_features_raise():
    get_pool(2).run(check_not_implemented)


# --------------------------------------------------------------------------
# Communication buffers allocated from the process group


def check_allocation_from_group(ctx, backend):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    torch.manual_seed(0)
    model = MLPStack(n=2)
    ref = copy.deepcopy(model)
    group = dist.group.WORLD if backend == "fsdp_ext" else ctx.gloo_group
    shard_stack(model, fsdp_api("ours"), DeviceMesh.from_group(group, "cpu"))
    for module in model.modules():
        if hasattr(module, "set_allocate_memory_from_process_group_for_comm"):
            module.set_allocate_memory_from_process_group_for_comm(True)
    pool = dist.group.WORLD._get_backend(torch.device("cpu"))
    before = pool._pool_stats()["allocations"] + pool._pool_stats()["reuses"]
    train_alongside(ctx, model, ref, steps=3)
    after = pool._pool_stats()["allocations"] + pool._pool_stats()["reuses"]
    return after - before


@pytest.mark.parametrize("backend", ["fsdp_ext", "gloo"])
def test_allocation_from_group(backend):
    taken = get_pool(2).run(check_allocation_from_group, backend)
    if backend == "fsdp_ext":
        # Every all-gather output and reduce-scatter buffer came from the pool:
        # per step 3 groups x (forward AG) + 2 x (backward AG) + 3 x (RS in, out).
        assert all(n >= 3 * (3 + 2 + 6) for n in taken), taken
    else:
        # gloo has no allocator: ordinary memory, same numbers.
        assert all(n == 0 for n in taken), taken


# --------------------------------------------------------------------------
# Lazy initialisation runs from the root


def check_lazy_init_order(ctx, impl):
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = shard_stack(MLPStack(n=2), api)
    # Forwarding a child first makes it the root of its own subtree ...
    model[1](mlp_batch(ctx.rank, 0))
    # ... so the real root's first forward must refuse, naming the child.
    with pytest.raises(RuntimeError, match="FSDP state has already been lazily initialized for "
                       "1\nFSDP requires running forward through the root module first"):
        model(mlp_batch(ctx.rank, 0))
    # fully_shard([a, b]) cannot be the root of a forward.
    pair = nn.ModuleList([MLP(10, 24), MLP(10, 24)])
    api.fully_shard([pair[0], pair[1]])
    with pytest.raises(RuntimeError, match="FSDP requires a single root module but got "):
        pair[0](mlp_batch(ctx.rank, 0))
    return True


@pytest.mark.parametrize("impl", IMPLS)
def test_lazy_init_must_start_at_the_root(impl):
    get_pool(2).run(check_lazy_init_order, impl)
