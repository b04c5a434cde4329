"""Collectives issued by fully_shard, counted with CommDebugMode, and the
gradient divide factor.

Model: TinyLM with B = 3 blocks, ``fully_shard`` on each block and on the
root (B + 1 parameter groups; the root owns embeddings, norm and output).
Counts of ``c10d._allgather_base_`` (AG) and ``c10d._reduce_scatter_base_``
(RS) per phase, as upstream's communication tests assert them:
- forward: AG = B + 1 for every ``reshard_after_forward``, and nothing else;
- backward: RS = B + 1 always; AG = B + 1 for True and for an int (2 of 4
  ranks), B for None (the root keeps its parameters after forward), none at
  all for False;
- ``set_reshard_after_forward(v, recurse)`` on a model built with ``not v``:
  backward AG = B + 1 / 1 (v True, recurse / root only) and 0 / B (v False);
- ``reshard_after_forward=False`` then a manual ``reshard()`` of every module
  before backward: backward all-gathers every group again.
Over the fsdp_ext default group and over a gloo mesh; for our fully_shard and
upstream's (the expectations are upstream's behaviour).

Also: parameters registered after forward are DTensors or plain tensors as
each setting implies, and ``set_gradient_divide_factor(f)`` (and its alias
``set_reduce_scatter_divide_factor``) makes gradients the sum over ranks
divided by f, per module (the setter is not recursive).
"""

import copy

import pytest
import torch
import torch.distributed as dist

from conftest import get_pool
from fsdp_testing import (
    AG,
    IMPLS,
    RS,
    TinyLM,
    assert_params_match,
    average_grads,
    comm_counts,
    counting_comms,
    fsdp_api,
    lm_batch,
    lm_loss,
    make_mesh,
    shard_lm,
)

N_LAYERS = 3
N_GROUPS = N_LAYERS + 1


def _expected_backward(reshard_after_forward):
    all_gathers = {True: N_GROUPS, None: N_LAYERS, False: 0}.get(reshard_after_forward, N_GROUPS)
    expected = {RS: N_GROUPS}
    if all_gathers:
        expected[AG] = all_gathers
    return expected


def _assert_registered_after_forward(model, reshard_after_forward):
    """Which parameters a module shows between forward and backward."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for name, param in model.named_parameters():
        is_root = not name.startswith("layers.")
        if reshard_after_forward is False or (reshard_after_forward is None and is_root):
            assert not isinstance(param, DTensor), (name, reshard_after_forward)
        else:
            assert isinstance(param, DTensor), (name, reshard_after_forward)
            if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
                # Resharded to groups of k ranks: a 2-D post-forward mesh.
                assert param.device_mesh.ndim == 2, name
                assert tuple(param.device_mesh.shape) == (
                    dist.get_world_size() // reshard_after_forward, reshard_after_forward)
                assert param.placements == (Replicate(), Shard(0)), param.placements
            else:
                assert param.placements == (Shard(0),), param.placements


def check_comm_counts(ctx, impl, backend, reshard_after_forward):
    from torch.distributed.tensor import DTensor

    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = TinyLM(n_layers=N_LAYERS)
    shard_lm(model, api, make_mesh(ctx, backend), reshard_after_forward=reshard_after_forward)
    for step in range(2):
        tokens, targets = lm_batch(ctx.rank, step)
        with counting_comms() as forward_mode:
            loss = lm_loss(model(tokens), targets)
        assert comm_counts(forward_mode) == {AG: N_GROUPS}, comm_counts(forward_mode)
        _assert_registered_after_forward(model, reshard_after_forward)
        with counting_comms() as backward_mode:
            loss.backward()
        expected = _expected_backward(reshard_after_forward)
        assert comm_counts(backward_mode) == expected, (comm_counts(backward_mode), expected)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            assert isinstance(param.grad, DTensor), name
        model.zero_grad(set_to_none=(step == 0))
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("backend", ["default", "gloo"])
@pytest.mark.parametrize("ws,reshard_after_forward", [
    (2, True), (2, False), (2, None),
    (4, True), (4, False), (4, None), (4, 2),
], ids=lambda v: repr(v))
def test_comm_counts(ws, reshard_after_forward, backend, impl):
    get_pool(ws).run(check_comm_counts, impl, backend, reshard_after_forward)


def check_set_reshard_after_forward_counts(ctx, impl, backend, value, recurse):
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = TinyLM(n_layers=N_LAYERS)
    shard_lm(model, api, make_mesh(ctx, backend), reshard_after_forward=not value)
    model.set_reshard_after_forward(value, recurse=recurse)
    if value:
        backward_all_gathers = N_GROUPS if recurse else 1
    else:
        backward_all_gathers = 0 if recurse else N_LAYERS
    expected = {RS: N_GROUPS}
    if backward_all_gathers:
        expected[AG] = backward_all_gathers
    for step in range(2):
        tokens, targets = lm_batch(ctx.rank, step)
        with counting_comms() as forward_mode:
            loss = lm_loss(model(tokens), targets)
        assert comm_counts(forward_mode) == {AG: N_GROUPS}, comm_counts(forward_mode)
        with counting_comms() as backward_mode:
            loss.backward()
        assert comm_counts(backward_mode) == expected, (comm_counts(backward_mode), expected)
        model.zero_grad()
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("recurse", [True, False])
@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("ws,backend", [(2, "default"), (4, "gloo")])
def test_set_reshard_after_forward_counts(ws, backend, value, recurse, impl):
    get_pool(ws).run(check_set_reshard_after_forward_counts, impl, backend, value, recurse)


def check_manual_reshard(ctx, impl, backend):
    """reshard_after_forward=False everywhere, then reshard() every module
    between forward and backward: backward all-gathers every group again, and
    the gradients are still right."""
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = TinyLM(n_layers=N_LAYERS)
    ref = copy.deepcopy(model)
    shard_lm(model, api, make_mesh(ctx, backend), reshard_after_forward=False)
    fsdp_modules = [m for m in model.modules() if isinstance(m, api.FSDPModule)]
    assert len(fsdp_modules) == N_GROUPS
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        tokens, targets = lm_batch(ctx.rank, step)
        with counting_comms() as forward_mode:
            loss = lm_loss(model(tokens), targets)
        assert comm_counts(forward_mode) == {AG: N_GROUPS}, comm_counts(forward_mode)
        for module in fsdp_modules:
            module.reshard()
        with counting_comms() as backward_mode:
            loss.backward()
        assert comm_counts(backward_mode) == {AG: N_GROUPS, RS: N_GROUPS}, comm_counts(backward_mode)
        ref_loss = lm_loss(ref(tokens), targets)
        ref_loss.backward()
        average_grads(ref, ctx.gloo_group, ctx.world_size)
        torch.testing.assert_close(loss, ref_loss)
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    assert_params_match(model, ref)
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ws,backend", [(2, "default"), (4, "gloo")])
def test_manual_reshard_then_backward_all_gathers(ws, backend, impl):
    get_pool(ws).run(check_manual_reshard, impl, backend)


# --------------------------------------------------------------------------
# Gradient divide factor


def _summed_reference_grads(ref, ctx):
    """Per-parameter gradient summed over ranks (not averaged)."""
    grads = {}
    for name, param in ref.named_parameters():
        grad = param.grad.detach().clone()
        dist.all_reduce(grad, group=ctx.gloo_group)
        grads[name] = grad
    return grads


def check_divide_factor(ctx, impl, factor_of_ws, setter, everywhere, reshard_after_forward):
    """Gradients equal the sum over ranks divided by the factor set on the
    module that owns them; modules without a factor average (divide by the
    world size). Over several steps with an optimizer, parameters match a
    reference that divides the same way."""
    api = fsdp_api(impl)
    ws = ctx.world_size
    factor = float(factor_of_ws * ws)
    torch.manual_seed(0)
    model = TinyLM(n_layers=2)
    ref = copy.deepcopy(model)
    shard_lm(model, api, reshard_after_forward=reshard_after_forward)
    targets_of_factor = [model]
    if everywhere:
        targets_of_factor = [m for m in model.modules() if isinstance(m, api.FSDPModule)]
    for module in targets_of_factor:
        getattr(module, setter)(factor)

    def divisor(name):
        if everywhere or not name.startswith("layers."):
            return factor
        return float(ws)

    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        tokens, targets = lm_batch(ctx.rank, step)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        ref_loss = lm_loss(ref(tokens), targets)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        summed = _summed_reference_grads(ref, ctx)
        for name, param in model.named_parameters():
            expected = summed[name] / divisor(name)
            torch.testing.assert_close(param.grad.full_tensor(), expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
            ref.get_parameter(name).grad = expected.clone()
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    assert_params_match(model, ref)
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("factor_of_ws", [2, 1, 0.75])
@pytest.mark.parametrize("ws", [1, 2, 4])
def test_gradient_divide_factor(ws, factor_of_ws, impl):
    get_pool(ws).run(check_divide_factor, impl, factor_of_ws, "set_gradient_divide_factor",
                     True, False)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_divide_factor_is_per_module_and_alias(reshard_after_forward, impl):
    """Set on the root only (through the deprecated alias): the blocks keep
    averaging."""
    get_pool(2).run(check_divide_factor, impl, 2, "set_reduce_scatter_divide_factor",
                    False, reshard_after_forward)
