"""torch 2.15's dtypes per parameter, ours next to upstream's fully_shard in the
same processes on the same backend:

- MixedPrecisionPolicy.param_dtype_override_fn: some parameters (the norms
  here) gathered and computed in their own dtype while the rest use
  param_dtype, so one group all-gathers two dtypes and reduces gradients of
  two dtypes;
- a parameter's grad_dtype: gradients reduced and kept in a dtype of their
  own (fp32 gradients for bf16 weights), in any dtype (None), or several in
  one group, reduced in their promotion and each shard cast back;
- gradient accumulation without sync and HSDP's held partial sums under them,
  the all-reduce hook's view of the reduced buffer (its layout: parameters
  packed by gradient dtype), and the errors upstream gives.

Each case trains both implementations from the same weights and batches and
asserts equal losses bit for bit every step, equal communication counts, and
equal final parameters, sharded gradients (values and dtypes) and grad_dtype
attributes. Upstream has all of this from torch 2.15 on; on an older torch
the file is skipped (MixedPrecisionPolicy has no param_dtype_override_fn and
tensors no grad_dtype policy there), and `make compat-test` runs it on 2.15.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import get_pool
from fsdp_testing import IMPLS, comm_counts, counting_comms, fsdp_api
from test_fully_shard_configs import make_mesh, run_microbatches
from torch_fsdp_ext import _compat

pytestmark = pytest.mark.skipif(
    not _compat.PER_PARAMETER_DTYPES,
    reason=_compat.needs_newer_torch(
        "upstream's per-parameter dtypes (param_dtype_override_fn, grad_dtype)", (2, 15)))

STEPS = 4
BF16, FP32 = torch.bfloat16, torch.float32


# --------------------------------------------------------------------------
# The model and the cases (built inside the workers)


class MixedBlock(nn.Module):
    """Linear, then a LayerNorm that computes in its own weight's dtype (fp32
    where param_dtype_override_fn keeps it), then a Linear back: a block
    whose parameters compute in two dtypes."""

    def __init__(self, dim):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        h = F.gelu(self.up(x))
        h = self.norm(h.to(self.norm.weight.dtype)).to(x.dtype)
        return x + self.down(h)


class MixedModel(nn.Module):
    """An input projection, three MixedBlocks (one fully_shard each) and a
    final norm and head on the root. 13 features: padded shards at 2 and 4
    ranks."""

    def __init__(self, dim=13):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(MixedBlock(dim) for _ in range(3))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 5)

    def forward(self, x):
        h = self.proj(x.to(self.proj.weight.dtype))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h.to(self.norm.weight.dtype)).to(h.dtype))


def _norm_params(model):
    return {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}


def _linear_weights(model):
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}


def prepare(case, model):
    """Applies case `case` to `model` before fully_shard (dtypes, grad_dtype
    policies); returns the MixedPrecisionPolicy and a function applied to the
    model after fully_shard."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as MP

    norms, weights = _norm_params(model), _linear_weights(model)

    def keep_norms(param):
        return param.dtype if id(param) in norms else None

    after = lambda model: None  # noqa: E731
    if case == "norms_keep_fp32":
        policy = MP(param_dtype=BF16, param_dtype_override_fn=keep_norms)
    elif case == "norms_keep_fp32_reduce_bf16":
        policy = MP(param_dtype=BF16, reduce_dtype=BF16, param_dtype_override_fn=keep_norms)
    elif case == "norms_keep_fp32_override_to_bf16":
        # Answers of both kinds: the norms keep fp32, the weights name
        # param_dtype itself, the biases None.
        policy = MP(param_dtype=BF16, param_dtype_override_fn=lambda p: (
            p.dtype if id(p) in norms else BF16 if id(p) in weights else None))
    elif case == "bf16_model_fp32_grads":
        model.bfloat16()
        for param in model.parameters():
            param.grad_dtype = FP32
        policy = MP()
    elif case in ("mixed_grad_dtypes", "mixed_grad_dtypes_bf16_compute"):
        # Three gradient policies in every group: bf16 (the Linear weights),
        # any (the norms) and unset (the biases: fp32, the parameters' dtype).
        for param in model.parameters():
            if id(param) in weights:
                param.grad_dtype = BF16
            elif id(param) in norms:
                param.grad_dtype = None
        policy = MP(param_dtype=BF16) if case.endswith("compute") else MP()
    elif case == "any_grad_dtype_reduce_bf16":
        for param in model.parameters():
            param.grad_dtype = None
        policy = MP(reduce_dtype=BF16)
    elif case == "reduce_bf16":
        policy = MP(reduce_dtype=BF16)
    elif case == "grad_dtype_set_after_fully_shard":
        # Set on the sharded parameters: taken up at the first forward.
        policy = MP()

        def after(model):
            for name, param in model.named_parameters():
                if name.endswith("up.weight"):
                    param.grad_dtype = BF16
    else:
        raise ValueError(case)
    return policy, after


def _batch(rank, step):
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 5)
    return torch.randn(6, 13, generator=g)


def _shard(model, api, mesh, policy):
    for block in model.blocks:
        api.fully_shard(block, mesh=mesh, mp_policy=policy)
    api.fully_shard(model, mesh=mesh, mp_policy=policy)


def _sharded_grads(model):
    out = []
    for name, param in model.named_parameters():
        grad = param.grad
        out.append((name, str(param.grad_dtype),
                    None if grad is None else (str(grad.dtype), grad.full_tensor())))
    return out


def train_side_by_side(ctx, backend, mesh_shape, case, microbatches=1, no_sync="none",
                       all_reduce_hook=False):
    """Trains ours and upstream's on identical copies; returns per
    implementation the losses, comm counts per step, the sharded gradients
    of the last step (before the optimizer), the final parameters and what
    the all-reduce hook saw."""
    mesh = make_mesh(ctx, backend, mesh_shape)
    torch.manual_seed(0)
    base = MixedModel()
    results = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        model = copy.deepcopy(base)
        policy, after = prepare(case, model)
        _shard(model, api, mesh, policy)
        after(model)
        hooked = []
        if all_reduce_hook:
            # A SUM hook does nothing to the values; it records them, in the
            # buffer's own layout and dtype.
            model.set_all_reduce_hook(lambda t: hooked.append((str(t.dtype), t.clone())))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, counts, grads = [], [], None
        for step in range(STEPS):
            step_losses, step_counts = run_microbatches(
                model, step, microbatches, no_sync,
                lambda m, i: m(_batch(ctx.rank, i)).float().pow(2).mean())
            losses += step_losses
            counts.append(step_counts)
            if step == STEPS - 1:
                grads = _sharded_grads(model)
            optim.step()
            optim.zero_grad()
        results[impl] = dict(
            losses=losses, counts=counts, grads=grads, hooked=hooked,
            full=[(str(p.dtype), p.detach().full_tensor()) for p in model.parameters()],
        )
    return results


def assert_same(results, what):
    ours, upstream = results["ours"], results["upstream"]
    assert ours["losses"] == upstream["losses"], (
        f"{what}: losses differ\n ours     {ours['losses']}\n upstream {upstream['losses']}")
    assert ours["counts"] == upstream["counts"], (
        f"{what}: comm counts differ\n ours     {ours['counts']}\n upstream {upstream['counts']}")
    for (name, ours_policy, ours_grad), (_, up_policy, up_grad) in zip(ours["grads"],
                                                                        upstream["grads"]):
        assert ours_policy == up_policy, f"{what}: {name}.grad_dtype {ours_policy} vs {up_policy}"
        assert (ours_grad is None) == (up_grad is None), f"{what}: {name}.grad presence"
        if ours_grad is not None:
            assert ours_grad[0] == up_grad[0], f"{what}: {name}.grad is {ours_grad[0]} vs {up_grad[0]}"
            assert torch.equal(ours_grad[1], up_grad[1]), f"{what}: {name}.grad differs"
    for i, ((a_dtype, a), (b_dtype, b)) in enumerate(zip(ours["full"], upstream["full"])):
        assert a_dtype == b_dtype and torch.equal(a, b), f"{what}: parameter {i} differs"
    assert len(ours["hooked"]) == len(upstream["hooked"]), what
    for i, ((a_dtype, a), (b_dtype, b)) in enumerate(zip(ours["hooked"], upstream["hooked"])):
        assert a_dtype == b_dtype and torch.equal(a, b), (
            f"{what}: all-reduce hook call {i}: {a_dtype}{list(a.shape)} vs {b_dtype}{list(b.shape)}")


def _run(ws, backend, mesh_shape, case, microbatches=1, no_sync="none", all_reduce_hook=False):
    per_rank = get_pool(ws).run(train_side_by_side, backend, mesh_shape, case, microbatches,
                                no_sync, all_reduce_hook)
    for rank, results in enumerate(per_rank):
        assert_same(results, f"rank {rank} {backend} mesh {mesh_shape} {case} "
                             f"microbatches={microbatches} no_sync={no_sync}")
    return per_rank


# --------------------------------------------------------------------------
# param_dtype_override_fn


@pytest.mark.parametrize("backend", ["fsdp_ext", "gloo"])
@pytest.mark.parametrize("case", ["norms_keep_fp32", "norms_keep_fp32_reduce_bf16"])
def test_param_dtype_override_matches_upstream(backend, case):
    per_rank = _run(2, backend, (2,), case)
    grads = dict((name, grad) for name, _, grad in per_rank[0]["ours"]["grads"])
    # Reduced in fp32 or bf16, every sharded gradient is the parameters' fp32.
    assert {grad[0] for grad in grads.values()} == {"torch.float32"}


def test_param_dtype_override_of_every_kind_matches_upstream():
    _run(2, "fsdp_ext", (2,), "norms_keep_fp32_override_to_bf16")


# --------------------------------------------------------------------------
# grad_dtype


@pytest.mark.parametrize("case", ["bf16_model_fp32_grads", "mixed_grad_dtypes",
                                  "mixed_grad_dtypes_bf16_compute", "any_grad_dtype_reduce_bf16",
                                  "grad_dtype_set_after_fully_shard"])
def test_grad_dtype_matches_upstream(case):
    per_rank = _run(2, "fsdp_ext", (2,), case)
    dtypes = {name: grad[0] for name, _, grad in per_rank[0]["ours"]["grads"]}
    if case == "bf16_model_fp32_grads":
        assert set(dtypes.values()) == {"torch.float32"}, dtypes
    elif case.startswith("mixed_grad_dtypes"):
        # bf16 where set, the reduce dtype (fp32, the promotion) where any.
        assert dtypes["head.weight"] == "torch.bfloat16", dtypes
        assert dtypes["norm.weight"] == dtypes["head.bias"] == "torch.float32", dtypes
    elif case == "any_grad_dtype_reduce_bf16":
        assert set(dtypes.values()) == {"torch.bfloat16"}, dtypes


def test_grad_dtypes_over_ranks_of_three_match_upstream():
    """Three ranks: every shard padded, 1/3 inexact in the average."""
    _run(3, "fsdp_ext", (3,), "mixed_grad_dtypes_bf16_compute")


# --------------------------------------------------------------------------
# Accumulation, HSDP, the all-reduce hook


@pytest.mark.parametrize("case", ["norms_keep_fp32", "mixed_grad_dtypes", "reduce_bf16"])
def test_accumulation_without_sync_matches_upstream(case):
    """Three microbatches, the first two without gradient sync: gradients
    accumulate in their unsharded grad dtype (reduce_bf16: rounded to bf16
    before each addition, as autograd accumulates in the leaf's grad_dtype)."""
    per_rank = _run(2, "fsdp_ext", (2,), case, microbatches=3, no_sync="gradient_sync")
    assert per_rank[0]["ours"]["counts"][0]["c10d._reduce_scatter_base_"] == 4


def test_hsdp_partial_sums_of_mixed_grad_dtypes_match_upstream():
    """HSDP 2x2, all-reduce only every third microbatch: the held partial
    sums are of the promoted dtype, the shards cast back after the all-reduce."""
    _run(4, "fsdp_ext", (2, 2), "mixed_grad_dtypes", microbatches=3, no_sync="all_reduce")


def test_all_reduce_hook_sees_upstream_layout():
    """The hook gets the reduced buffer as upstream lays it out: parameters
    packed by gradient dtype (bf16 weights, then the norms, then the biases),
    in the reduce dtype."""
    per_rank = _run(2, "fsdp_ext", (2,), "mixed_grad_dtypes", all_reduce_hook=True)
    assert per_rank[0]["ours"]["hooked"], "the all-reduce hook never ran"


# --------------------------------------------------------------------------
# Errors


def test_errors_match_upstream(pool2):
    results = pool2.run(_errors)
    ours, upstream = results[0]["ours"], results[0]["upstream"]
    for what in upstream:
        assert ours[what][0] == upstream[what][0], (what, ours[what], upstream[what])
    # Ours names the fully_shard call and the parameter.
    assert "MixedModel" in ours["not_a_dtype"][1] and "Linear.weight" in ours["not_a_dtype"][1]
    assert "torch.float16" in ours["another_dtype"][1], ours["another_dtype"]
    assert "blocks.0.norm.weight" in ours["unused_any_dtype"][1], ours["unused_any_dtype"]


def _errors(ctx):
    from torch.distributed.fsdp import MixedPrecisionPolicy as MP

    mesh = make_mesh(ctx, "fsdp_ext", (ctx.world_size,))

    def outcome(fn):
        try:
            fn()
            return ("no error", "")
        except Exception as error:  # noqa: BLE001 - the type is what is compared
            return (type(error).__name__, str(error))

    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        cases = {}
        cases["not_a_dtype"] = lambda: api.fully_shard(
            MixedModel(), mesh=mesh, mp_policy=MP(param_dtype=BF16, param_dtype_override_fn=lambda p: 3))
        cases["another_dtype"] = lambda: api.fully_shard(
            MixedModel(), mesh=mesh,
            mp_policy=MP(param_dtype=BF16, param_dtype_override_fn=lambda p: torch.float16))

        def unused_any_dtype():
            model = MixedModel()
            model.blocks[0].norm.weight.grad_dtype = None
            _shard(model, api, mesh, MP())
            model.set_reduce_scatter_unused_params(True)
            model(_batch(ctx.rank, 0)).sum().backward()

        cases["unused_any_dtype"] = unused_any_dtype
        out[impl] = {what: outcome(fn) for what, fn in cases.items()}
    return out


# --------------------------------------------------------------------------
# Tensor parallelism: a gradient reduced over TP before FSDP reduces it


class SequenceParallelNorm(nn.Module):
    """A Linear, a LayerNorm whose parameters are Replicate DTensors on the
    tp mesh applied to the sequence-sharded activations (sequence
    parallelism: their gradients come back Partial, summed over tp before
    FSDP reduces them), and a Linear back."""

    def __init__(self, tp_mesh, dim=8):
        from torch.distributed.tensor import Replicate, distribute_tensor

        super().__init__()
        self.tp_mesh = tp_mesh
        self.inp = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        for name in ("weight", "bias"):
            local = getattr(self.norm, name).detach()
            setattr(self.norm, name, nn.Parameter(distribute_tensor(local, tp_mesh, [Replicate()])))
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        h = self.inp(x)
        sequence_sharded = DTensor.from_local(h, self.tp_mesh, [Replicate()],
                                              run_check=False).redistribute(self.tp_mesh, [Shard(1)])
        return self.out(self.norm(sequence_sharded).full_tensor())


def _train_sequence_parallel(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as MP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    base = SequenceParallelNorm(mesh["tp"])
    dp_rank = ctx.rank // 2  # one batch per TP group
    results = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        model = copy.deepcopy(base)
        api.fully_shard(model, mesh=mesh["dp"], mp_policy=MP(param_dtype=BF16))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, counts, grads = [], [], None
        for step in range(STEPS):
            g = torch.Generator().manual_seed(7919 * step + 104729 * dp_rank + 11)
            with counting_comms() as mode:
                loss = model(torch.randn(2, 4, 8, generator=g)).float().pow(2).mean()
                loss.backward()
            counts.append(comm_counts(mode))
            losses.append(loss.item())
            if step == STEPS - 1:
                grads = _sharded_grads(model)
            optim.step()
            optim.zero_grad()
        results[impl] = dict(losses=losses, counts=counts, grads=grads, hooked=[],
                             full=[(str(p.dtype), p.detach().full_tensor())
                                   for p in model.parameters()])
    return results


def test_sequence_parallel_norm_reduced_over_tp_in_the_wider_dtype():
    """bf16 compute, reduce_dtype unset: the norm's Partial gradients are
    summed over tp in fp32 (autograd hands them over in fp32), as upstream's;
    summed in bf16 the parameters drift from upstream's."""
    for rank, results in enumerate(get_pool(4).run(_train_sequence_parallel)):
        assert_same(results, f"rank {rank} sequence-parallel norm")
