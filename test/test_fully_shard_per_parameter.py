"""set_per_parameter_collectives: one coalesced collective per group, a member
per parameter, over the fsdp_ext group (ours only).

The all-gather then writes every parameter's unsharded storage itself (no
copy-out) and the reduce-scatter reads gradients where they lie when they
already have their padded parameter's layout (the TinyLM's dims divide by 4;
the MLP stack's rows do not, so its gradients take the padded copy). The numbers must not change: each case trains ours in that mode, ours
with the flat collectives and upstream's fully_shard from the same initial
values on the same batches, and the losses, the gradients of the last step
and the final parameters must be equal bit for bit. The profiler must see the
coalesced collectives, and no flat one, where the mode applies.

Two sizes: small models, whose flat and coalesced reduce-scatters (64 KiB at
most) both take the small-op channel, and models whose groups are over
64 KiB, where both take the shared-memory path. Each sums a block starting with its owner's
contribution, so the rounding is the same whichever runs.

Cases (4 ranks): fp32 with reshard_after_forward True, False and 2 (a
post-forward mesh: the backward all-gather gathers the post-forward chunks);
bf16 parameters reduced in bf16 (read in place) and in fp32 (cast copy); HSDP
on a 2 x 2 mesh; activation checkpointing with a micro-batch that
accumulates without gradient sync; parameters sharded on dim 1, whose
groups keep the flat collectives while the root's go per parameter.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from conftest import get_pool
from collections import Counter

from fsdp_testing import MLPStack, TinyLM, fsdp_api, lm_batch, lm_loss, mlp_batch
from test_fully_shard_configs import make_mesh

STEPS = 3
AG, RS = "c10d::_allgather_base_", "c10d::_reduce_scatter_base_"
AG_COALESCED = "c10d::allgather_into_tensor_coalesced_"
RS_COALESCED = "c10d::reduce_scatter_tensor_coalesced_"
# (vocab, dim) of the TinyLM, (dim, hidden) of the MLP stack.
SIZES = {"small": ((32, 16), (10, 24)), "large": ((256, 128), (130, 250))}

CASES = {
    # name: (model, mesh shape, fully_shard kwargs, extras)
    "fp32_reshard_true": ("transformer", (4,), {}, {}),
    "fp32_reshard_false": ("mlp", (4,), {"reshard_after_forward": False}, {}),
    "fp32_reshard_2": ("transformer", (4,), {"reshard_after_forward": 2}, {}),
    "bf16_reduce_bf16": ("transformer", (4,), {"mp": (torch.bfloat16, None)}, {}),
    "bf16_reduce_fp32": ("mlp", (4,), {"mp": (torch.bfloat16, torch.float32)}, {}),
    "hsdp": ("transformer", (2, 2), {}, {}),
    "checkpoint_accumulate": ("transformer", (4,), {}, {"ac": True, "accumulate": True}),
    "shard_dim_1": ("transformer", (4,), {"shard_dim": 1}, {}),
}


def _build(model_name, size, ac):
    (vocab, dim), (mlp_dim, mlp_hidden) = SIZES[size]
    torch.manual_seed(0)
    if model_name == "mlp":
        return MLPStack(n=3, dim=mlp_dim, hidden=mlp_hidden)
    return TinyLM(n_layers=2, vocab=vocab, dim=dim, ac="outer" if ac else None)


def _loss(model_name, size, model, rank, step):
    (vocab, _), (mlp_dim, _) = SIZES[size]
    if model_name == "mlp":
        return model(mlp_batch(rank, step, dim=mlp_dim)).pow(2).mean()
    tokens, targets = lm_batch(rank, step, vocab=vocab)
    return lm_loss(model(tokens), targets)


def _train(ctx, impl, per_parameter, case, size):
    model_name, shape, kwargs, extras = CASES[case]
    dim = SIZES[size][0][1]
    api = fsdp_api(impl)
    kwargs = dict(kwargs)
    mesh = make_mesh(ctx, "fsdp_ext", shape)
    if "mp" in kwargs:
        param_dtype, reduce_dtype = kwargs.pop("mp")
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=param_dtype,
                                                       reduce_dtype=reduce_dtype)
    if "shard_dim" in kwargs:
        shard_dim = kwargs.pop("shard_dim")
        # The blocks' square weights on `shard_dim`, the rest (all the root's) on 0.
        kwargs["shard_placement_fn"] = lambda p: Shard(shard_dim if p.shape == (dim, dim) else 0)
    model = _build(model_name, size, extras.get("ac"))
    blocks = model.layers if model_name == "transformer" else list(model)[1:]
    for block in blocks:
        api.fully_shard(block, mesh=mesh, **kwargs)
    api.fully_shard(model, mesh=mesh, **kwargs)
    if per_parameter:
        model.set_per_parameter_collectives(True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    losses, counts = [], {}
    for step in range(STEPS):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if extras.get("accumulate"):
                model.set_requires_gradient_sync(False)
                _loss(model_name, size, model, rank, 100 + step).backward()
                model.set_requires_gradient_sync(True)
            loss = _loss(model_name, size, model, rank, step)
            loss.backward()
        counts = Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))
        losses.append(loss.detach())
        grads = [p.grad.full_tensor().detach() for p in model.parameters()]
        optim.step()
        optim.zero_grad()
    params = [p.full_tensor().detach() for p in model.parameters()]
    return {"losses": losses, "grads": grads, "params": params, "counts": counts}


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# The corners of the matrix: every path once (post-forward all-gather, cast and
# padded reduce-scatter inputs, HSDP, dim-1 fallback, checkpointing with
# accumulation) with small models, in-place inputs on the shared-memory path
# with large ones.
MATRIX = [(case, "small") for case in ("fp32_reshard_2", "bf16_reduce_fp32", "hsdp",
                                       "checkpoint_accumulate", "shard_dim_1")] + \
         [("fp32_reshard_false", "large"), ("bf16_reduce_bf16", "large")]


@pytest.mark.parametrize("case,size", MATRIX)
def test_per_parameter_collectives_change_no_number(case, size):
    pool = get_pool(4)
    runs = {
        "per_parameter": pool.run(_train, "ours", True, case, size),
        "flat": pool.run(_train, "ours", False, case, size),
        "upstream": pool.run(_train, "upstream", False, case, size),
    }
    for rank in range(4):
        ours = runs["per_parameter"][rank]
        for reference in ("flat", "upstream"):
            other = runs[reference][rank]
            for what in ("losses", "grads", "params"):
                assert _equal(ours[what], other[what]), (case, rank, reference, what)
        counts = ours["counts"]
        flat_counts = runs["flat"][rank]["counts"]
        # Every collective goes per parameter, but those of a group with a
        # parameter sharded on dim 1.
        for flat, coalesced in ((AG, AG_COALESCED), (RS, RS_COALESCED)):
            if case == "shard_dim_1":
                assert counts.get(flat, 0) > 0 and counts.get(coalesced, 0) > 0, counts
                assert counts[flat] + counts[coalesced] == flat_counts[flat], counts
            else:
                assert counts.get(flat, 0) == 0 and counts[coalesced] == flat_counts[flat], counts
        assert counts.get("c10d::allreduce_", 0) == flat_counts.get("c10d::allreduce_", 0)
