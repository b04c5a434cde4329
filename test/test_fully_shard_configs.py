"""Real training configurations, ours next to upstream's fully_shard in the same
processes on the same backend: mixed precision (every MixedPrecisionPolicy
field, policies that differ between nested modules, parameters of several
dtypes in one group), HSDP on a 2x2 mesh (reduce-scatter within the shard dim,
all-reduce across replicas, set_requires_all_reduce), and gradient
accumulation under them.

Each case trains both implementations for several steps from the same
initial weights and per-rank batches and asserts that the losses are equal
bit for bit, every step (upstream's arithmetic is reproduced exactly: same
casts, same divisions at the same points), that the communication counts are
the same (CommDebugMode), and that the final sharded parameters and their
dtypes agree.
"""

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conftest import get_pool
from fsdp_testing import (IMPLS, Block, TinyLM, comm_counts, counting_comms, fsdp_api, lm_batch,
                          lm_loss, upstream_has)

BACKENDS = ("fsdp_ext", "gloo")
STEPS = 5

# --------------------------------------------------------------------------
# Meshes and policies (built inside the workers)


def make_mesh(ctx, backend, shape):
    """A CPU mesh over every rank on `backend`: 1-D ("fsdp") or 2-D
    replicate x shard ("hsdp", dims named as upstream's tests name them)."""
    from torch.distributed.device_mesh import init_device_mesh

    override = None if backend == "fsdp_ext" else {d: "gloo" for d in range(len(shape))}
    if len(shape) == 1:
        return init_device_mesh("cpu", shape, backend_override=override)
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"),
                            backend_override=override)


def policy(name):
    from torch.distributed.fsdp import MixedPrecisionPolicy as MP

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    return {
        "none": MP(),
        "bf16": MP(param_dtype=bf16),
        "bf16_reduce_fp32": MP(param_dtype=bf16, reduce_dtype=fp32),
        "bf16_output_fp32": MP(param_dtype=bf16, output_dtype=fp32),
        "fp16_reduce_fp32": MP(param_dtype=fp16, reduce_dtype=fp32),
        # Lower reduce than param precision, and fp16's split divide factors.
        "reduce_fp16": MP(reduce_dtype=fp16),
        "reduce_bf16": MP(reduce_dtype=bf16),
        # Inputs left as they come: the model must accept fp32 inputs itself.
        "bf16_no_input_cast": MP(param_dtype=bf16, cast_forward_inputs=False),
    }[name]


class CastingBlock(Block):
    """A block that casts its input to its own (unsharded) weights' dtype."""

    def forward(self, x):
        return super().forward(x.to(self.attn_norm.weight.dtype))


class CastingLM(TinyLM):
    """TinyLM for policies that leave inputs or outputs in another dtype than
    the next module computes in: blocks cast their inputs themselves, and the
    root casts what reaches its norm."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(CastingBlock(16, 2) for _ in range(3))

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1])
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h.to(self.norm.weight.dtype)).flatten(0, 1))


class FrozenScale(nn.Module):
    """A Linear followed by a frozen per-feature scale stored in bf16: a
    group whose parameters have two dtypes (upstream gathers them as bytes)."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim).to(torch.bfloat16),
                                  requires_grad=False)

    def forward(self, x):
        return F.relu(self.lin(x)) * self.scale.to(x.dtype)


class FrozenScaleStack(nn.Sequential):
    def __init__(self, n=3, dim=12):
        super().__init__(*[FrozenScale(dim) for _ in range(n)])


# --------------------------------------------------------------------------
# Side-by-side training


def placement_fn(name, shard_world):
    """shard_placement_fn variants: "dim1" shards 2-D weights on dim 1,
    "last" on dim -1 (a negative dim), "largest" on their largest dim; each
    falls back to Shard(0) (None) where that dim does not divide evenly."""
    from torch.distributed.tensor import Shard

    if name == "none":
        return None

    def fn(param):
        if param.ndim < 2:
            return None
        dim = {"dim1": 1, "last": param.ndim - 1,
               "largest": max(range(param.ndim), key=lambda d: param.shape[d])}[name]
        if param.shape[dim] % shard_world != 0:
            return None
        return Shard(-1) if name == "last" else Shard(dim)

    return fn


def _shard(model, api, mesh, block_policy, root_policy, **kwargs):
    blocks = model.layers if hasattr(model, "layers") else list(model)
    for block in blocks:
        api.fully_shard(block, mesh=mesh, mp_policy=block_policy, **kwargs)
    api.fully_shard(model, mesh=mesh, mp_policy=root_policy, **kwargs)


def _batch_loss(model, rank, step):
    if isinstance(model, TinyLM):
        tokens, targets = lm_batch(rank, step)
        return lm_loss(model(tokens).float(), targets)
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 3)
    x = torch.randn(4, 12, generator=g)
    return model(x).float().pow(2).mean()


def run_microbatches(model, step, microbatches, no_sync, loss_of):
    """One optimizer step's forwards and backwards: `loss_of(model, index)`
    for each microbatch, all but the last without gradient sync (`no_sync`
    "gradient_sync") or without HSDP's all-reduce ("all_reduce"). Returns
    the losses and the step's comm counts."""
    losses, step_counts = [], Counter()
    for micro in range(microbatches):
        last = micro == microbatches - 1
        if no_sync == "gradient_sync":
            model.set_requires_gradient_sync(last)
        elif no_sync == "all_reduce":
            model.set_requires_all_reduce(last)
        # One CommDebugMode per forward (its module tracker expects one).
        with counting_comms() as mode:
            loss = loss_of(model, step * microbatches + micro)
            loss.backward()
        step_counts.update(comm_counts(mode))
        losses.append(loss.item())
    return losses, dict(step_counts)


def train_side_by_side(ctx, backend, mesh_shape, model_name, block_policy_name,
                       root_policy_name, microbatches, no_sync, placement="none"):
    """Trains ours and upstream's fully_shard on identical copies; returns
    {impl: (losses, comm counts per step, final full params, param dtypes,
    grad dtypes)}. `no_sync`: "none", "gradient_sync" (all but the last
    microbatch skip reduction) or "all_reduce" (HSDP: all but the last skip
    only the all-reduce)."""
    mesh = make_mesh(ctx, backend, mesh_shape)
    torch.manual_seed(0)
    base = {"lm": TinyLM, "casting_lm": CastingLM, "frozen_scale": FrozenScaleStack}[model_name]()
    block_policy = policy(block_policy_name)
    root_policy = policy(root_policy_name or block_policy_name)
    results = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        model = copy.deepcopy(base)
        _shard(model, api, mesh, block_policy, root_policy,
               shard_placement_fn=placement_fn(placement, mesh_shape[-1]))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, counts = [], []
        for step in range(STEPS):
            step_losses, step_counts = run_microbatches(
                model, step, microbatches, no_sync, lambda m, i: _batch_loss(m, ctx.rank, i))
            losses += step_losses
            counts.append(step_counts)
            optim.step()
            optim.zero_grad()
        full = [p.detach().full_tensor() for p in model.parameters()]
        results[impl] = dict(
            losses=losses, counts=counts, full=full,
            param_dtypes=[str(p.dtype) for p in model.parameters()],
            placements=[str(p.placements) for p in model.parameters()],
        )
    return results


def assert_same_training(results, what):
    ours, upstream = results["ours"], results["upstream"]
    assert ours["losses"] == upstream["losses"], (
        f"{what}: losses differ\n ours     {ours['losses']}\n upstream {upstream['losses']}")
    assert ours["counts"] == upstream["counts"], (
        f"{what}: comm counts differ\n ours     {ours['counts']}\n upstream {upstream['counts']}")
    assert ours["param_dtypes"] == upstream["param_dtypes"], what
    assert ours["placements"] == upstream["placements"], what
    for i, (a, b) in enumerate(zip(ours["full"], upstream["full"])):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: parameter {i} differs"


def _run(ws, backend, mesh_shape, model_name, block_policy, root_policy=None,
         microbatches=1, no_sync="none", placement="none"):
    pool = get_pool(ws)
    per_rank = pool.run(train_side_by_side, backend, mesh_shape, model_name, block_policy,
                        root_policy, microbatches, no_sync, placement)
    for rank, results in enumerate(per_rank):
        assert_same_training(results, f"rank {rank} {backend} mesh {mesh_shape} {block_policy}")
    return per_rank


# --------------------------------------------------------------------------
# Mixed precision


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_policy", [
    "bf16", "bf16_reduce_fp32", "fp16_reduce_fp32", "reduce_fp16", "reduce_bf16",
])
def test_mixed_precision_matches_upstream_ws2(backend, block_policy):
    per_rank = _run(2, backend, (2,), "lm", block_policy)
    ours = per_rank[0]["ours"]
    # The optimizer sees fp32 sharded parameters, whatever the compute dtype.
    assert set(ours["param_dtypes"]) == {"torch.float32"}
    counts = ours["counts"][0]
    # 4 groups gather in forward, the 3 resharded blocks again in backward.
    assert counts["c10d._allgather_base_"] == 7 and counts["c10d._reduce_scatter_base_"] == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_precision_matches_upstream_ws4(backend):
    _run(4, backend, (4,), "lm", "bf16_reduce_fp32")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_policy", ["none", "bf16"])
def test_group_of_three_matches_upstream(backend, block_policy):
    """Gradients averaged over 3 ranks (1/3 is inexact) round as upstream's:
    the division after our SUM and upstream's ReduceOp.AVG agree bit for bit."""
    _run(3, backend, (3,), "lm", block_policy)


@pytest.mark.parametrize("block_policy", ["bf16_no_input_cast", "bf16_output_fp32"])
def test_input_and_output_casts_ws2(block_policy):
    """cast_forward_inputs=False hands blocks fp32 inputs; output_dtype=fp32
    hands the next module fp32 outputs."""
    _run(2, "fsdp_ext", (2,), "casting_lm", block_policy)


def test_nested_policies_differ_ws2():
    """bf16 blocks whose outputs come back as fp32 under an fp32 root."""
    _run(2, "fsdp_ext", (2,), "lm", "bf16_output_fp32", root_policy="none")


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameters_of_two_dtypes_in_one_group(backend):
    """An fp32 trainable Linear and a frozen bf16 scale share each group: the
    all-gather carries both as bytes, as upstream's does."""
    _run(2, backend, (2,), "frozen_scale", "none")
    _run(2, backend, (2,), "frozen_scale", "bf16_reduce_fp32")


@pytest.mark.parametrize("no_sync", ["gradient_sync"])
def test_gradient_accumulation_in_reduce_dtype(no_sync):
    """Without sync, bf16 gradients accumulate in fp32 (reduce_dtype)
    between microbatches, then one reduce-scatter per group."""
    per_rank = _run(2, "fsdp_ext", (2,), "lm", "bf16_reduce_fp32", microbatches=3,
                    no_sync=no_sync)
    assert per_rank[0]["ours"]["counts"][0]["c10d._reduce_scatter_base_"] == 4


def test_uniform_dtype_checks_match_upstream(pool2):
    results = pool2.run(_mixed_trainable_dtypes)
    assert results[0]["ours"] == results[0]["upstream"], results[0]


def _mixed_trainable_dtypes(ctx):
    """Trainable parameters of two dtypes in one group: both raise the same
    AssertionError at the first forward."""
    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float64))
        api.fully_shard(model, mesh=make_mesh(ctx, "fsdp_ext", (ctx.world_size,)))
        try:
            model(torch.randn(2, 4))
            out[impl] = "no error"
        except AssertionError as error:
            out[impl] = str(error).split(" but got")[0]
    return out


# --------------------------------------------------------------------------
# HSDP


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_policy", ["none", "bf16_reduce_fp32", "reduce_fp16"])
def test_hsdp_2x2_matches_upstream(backend, block_policy):
    per_rank = _run(4, backend, (2, 2), "lm", block_policy)
    counts = per_rank[0]["ours"]["counts"][0]
    # One reduce-scatter then one all-reduce per group.
    assert counts["c10d._reduce_scatter_base_"] == 4
    assert counts["c10d.allreduce_"] == 4


def test_hsdp_without_all_reduce_accumulates_partials():
    """set_requires_all_reduce(False) on all but the last microbatch: a
    reduce-scatter every microbatch, one all-reduce per group per step."""
    per_rank = _run(4, "fsdp_ext", (2, 2), "lm", "bf16_reduce_fp32", microbatches=3,
                    no_sync="all_reduce")
    counts = per_rank[0]["ours"]["counts"][0]
    assert counts["c10d._reduce_scatter_base_"] == 12
    assert counts["c10d.allreduce_"] == 4


def test_hsdp_gradient_accumulation_without_sync():
    per_rank = _run(4, "fsdp_ext", (2, 2), "lm", "none", microbatches=2,
                    no_sync="gradient_sync")
    counts = per_rank[0]["ours"]["counts"][0]
    assert counts["c10d._reduce_scatter_base_"] == 4 and counts["c10d.allreduce_"] == 4


def test_hsdp_sharded_params_are_replicate_shard(pool4):
    placements = pool4.run(_hsdp_placements)
    for rank_result in placements:
        assert rank_result["ours"] == rank_result["upstream"], rank_result


def _hsdp_placements(ctx):
    mesh = make_mesh(ctx, "fsdp_ext", (2, 2))
    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        torch.manual_seed(0)
        model = nn.Linear(5, 3)
        api.fully_shard(model, mesh=mesh)
        out[impl] = [(str(p.placements), tuple(p.to_local().shape), tuple(p.shape))
                     for p in model.parameters()]
    return out


# --------------------------------------------------------------------------
# shard_placement_fn


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("placement", ["dim1", "last", "largest"])
def test_shard_placement_matches_upstream_ws2(backend, placement):
    per_rank = _run(2, backend, (2,), "lm", "none", placement=placement)
    placements = per_rank[0]["ours"]["placements"]
    assert any("Shard(dim=1)" in p for p in placements), placements


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["fsdp4", "hsdp2x2"])
def test_shard_placement_with_mixed_precision_ws4(mesh_shape):
    _run(4, "fsdp_ext", mesh_shape, "lm", "bf16_reduce_fp32", placement="dim1")


def test_shard_placement_errors_match_upstream(pool2):
    results = pool2.run(_placement_errors)
    ours, upstream = list(results[0]["ours"]), list(results[0]["upstream"])
    assert all("no error" not in r for r in ours), results[0]
    if not upstream_has("invalid_placement_error"):
        assert ours.pop() == "ValueError: Invalid shard_placement_fn result", results[0]
        assert upstream.pop().startswith("AttributeError"), results[0]
    assert ours == upstream, results[0]


def _placement_errors(ctx):
    from torch.distributed.tensor import Shard

    mesh = make_mesh(ctx, "fsdp_ext", (ctx.world_size,))
    cases = [lambda p: Shard(1), lambda p: Shard(2), lambda p: "Shard(0)"]
    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        out[impl] = []
        for fn in cases:
            try:
                api.fully_shard(nn.Linear(3, 4), mesh=mesh, shard_placement_fn=fn)
                out[impl].append("no error")
            except Exception as error:  # the type and first words are compared
                out[impl].append(f"{type(error).__name__}: {str(error).split(':')[0]}")
    return out
