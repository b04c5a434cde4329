"""Training with fully_shard matches non-sharded data-parallel training.

The reference is a plain copy of the model made before sharding (same
initial values) whose gradients are all-reduced over the workers' gloo group
and averaged, stepped by the same optimizer. Each rank feeds its own batch to
both. For at least 10 steps the rank-local losses agree, and at the end every
sharded parameter's ``full_tensor()`` matches the reference parameter.

Cases: an MLP stack (root Linear + 3 MLPs, dims that shard unevenly over 4
ranks) and a small transformer (embeddings, 3 blocks, norm, output), on 1, 2
and 4 ranks, with ``reshard_after_forward`` True and False; two forwards
before one backward; a module whose output is unused (its parameters get no
gradient and are resharded after backward) and a head used by only some
steps. Our fully_shard everywhere; upstream's on 2 ranks to pin the
expectations to the reference implementation.
"""

import copy

import pytest
import torch
import torch.nn as nn

from conftest import get_pool
from fsdp_testing import (
    MLP,
    MLPStack,
    TinyLM,
    assert_params_match,
    average_grads,
    fsdp_api,
    lm_batch,
    lm_loss,
    mlp_batch,
    shard_lm,
    shard_stack,
)

STEPS = 10
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)


def _build(model_name):
    torch.manual_seed(0)
    if model_name == "mlp":
        return MLPStack(n=3, dim=10, hidden=24)
    if model_name == "transformer":
        return TinyLM(n_layers=3)
    raise ValueError(model_name)


def _shard(model_name, model, api, **kwargs):
    if model_name == "mlp":
        return shard_stack(model, api, **kwargs)
    return shard_lm(model, api, **kwargs)


def _loss(model_name, model, rank, step):
    if model_name == "mlp":
        x = mlp_batch(rank, step)
        return model(x).pow(2).mean()
    tokens, targets = lm_batch(rank, step)
    return lm_loss(model(tokens), targets)


def _assert_all_dtensors(model, what):
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{what}: {name} is not a DTensor"


def check_parity(ctx, impl, model_name, reshard_after_forward, forwards_per_step=1):
    api = fsdp_api(impl)
    model = _build(model_name)
    ref = copy.deepcopy(model)
    _shard(model_name, model, api, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        ref_loss = sum(_loss(model_name, ref, ctx.rank, STEPS * k + step)
                       for k in range(forwards_per_step))
        ref_loss.backward()
        average_grads(ref, ctx.gloo_group, ctx.world_size)
        ref_optim.step()
        ref_optim.zero_grad()

        loss = sum(_loss(model_name, model, ctx.rank, STEPS * k + step)
                   for k in range(forwards_per_step))
        loss.backward()
        _assert_all_dtensors(model, f"after backward {step}")
        optim.step()
        optim.zero_grad(set_to_none=(step % 2 == 0))
        torch.testing.assert_close(loss, ref_loss, **LOSS_TOL,
                                   msg=lambda m, step=step: f"step {step}: {m}")
        losses.append(loss.item())
    assert_params_match(model, ref, **PARAM_TOL)
    assert losses[-1] < losses[0], losses
    return losses


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["raf", "no-raf"])
@pytest.mark.parametrize("model_name", ["mlp", "transformer"])
@pytest.mark.parametrize("ws", [1, 2, 4])
def test_train_parity(ws, model_name, reshard_after_forward):
    get_pool(ws).run(check_parity, "ours", model_name, reshard_after_forward)


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["raf", "no-raf"])
@pytest.mark.parametrize("model_name", ["mlp", "transformer"])
def test_train_parity_upstream(model_name, reshard_after_forward):
    get_pool(2).run(check_parity, "upstream", model_name, reshard_after_forward)


# Ours on 2 and 4 ranks (or 1, 2, 4); upstream on 2 ranks only, for time.
OURS_AND_UPSTREAM_2 = [(2, "upstream"), (2, "ours"), (4, "ours")]
OURS_ALL_AND_UPSTREAM_2 = [(2, "upstream"), (1, "ours"), (2, "ours"), (4, "ours")]


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["raf", "no-raf"])
@pytest.mark.parametrize("ws,impl", OURS_AND_UPSTREAM_2)
def test_two_forwards_before_backward(ws, impl, reshard_after_forward):
    get_pool(ws).run(check_parity, impl, "transformer", reshard_after_forward, 2)


# --------------------------------------------------------------------------
# Modules unused in backward


class WithUnused(nn.Module):
    """``unused`` runs forward every step but its output is dropped; ``aux``
    feeds the loss only on even steps (``use_aux``)."""

    def __init__(self, dim=10):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.body = MLP(dim, 24)
        self.unused = nn.Linear(dim, dim)
        self.aux = nn.Linear(dim, 3)

    def forward(self, x, use_aux):
        h = self.proj(x)
        self.unused(h)  # output discarded
        out = self.body(h).pow(2).mean()
        if use_aux:
            out = out + self.aux(h).pow(2).mean()
        return out


def check_unused_in_backward(ctx, impl, reshard_after_forward):
    from torch.distributed.tensor import DTensor

    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = WithUnused()
    ref = copy.deepcopy(model)
    for child in (model.body, model.unused, model.aux):
        api.fully_shard(child, reshard_after_forward=reshard_after_forward)
    api.fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        use_aux = step % 2 == 0
        x = mlp_batch(ctx.rank, step)
        ref_loss = ref(x, use_aux)
        ref_loss.backward()
        average_grads(ref, ctx.gloo_group, ctx.world_size)

        loss = model(x, use_aux)
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, **LOSS_TOL)
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), f"step {step}: {name} not resharded"
            expect_grad = not name.startswith("unused.") and (use_aux or not name.startswith("aux."))
            if expect_grad:
                assert isinstance(param.grad, DTensor), (step, name)
                torch.testing.assert_close(param.grad.full_tensor(), ref_params[name].grad,
                                           rtol=1e-5, atol=1e-6)
            else:
                assert param.grad is None, (step, name)
                assert ref_params[name].grad is None, (step, name)
        optim.step()
        ref_optim.step()
        optim.zero_grad(set_to_none=True)
        ref_optim.zero_grad(set_to_none=True)
    assert_params_match(model, ref, **PARAM_TOL)
    return True


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["raf", "no-raf"])
@pytest.mark.parametrize("ws,impl", OURS_ALL_AND_UPSTREAM_2)
def test_module_unused_in_backward(ws, impl, reshard_after_forward):
    get_pool(ws).run(check_unused_in_backward, impl, reshard_after_forward)
