"""All-gather extensions (issue 37, item 2): ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` set as instance methods on each parameter's
``_local_tensor`` after ``fully_shard`` and ``to_empty()`` (no subclass), as
upstream's FSDP2 honours them. Ours against upstream's ``fully_shard`` from
the same weights and batches: the same losses and parameters bit for bit, the
same calls of the hooks, the same meshes handed to them.

Variants (the corners): one input gathered in bf16 and cast back by the post
hook into tensors of its own (filled in place, ``out=``, after the first
unshard); two inputs of different dtypes, the post hook viewing the first
output directly (the flat buffer then carries bytes); the legacy one-argument
pre hook; and an HSDP mesh, where the hook sees the shard mesh only.
"""

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conftest import get_pool
from fsdp_testing import MLPStack, fsdp_api, mlp_batch


def _install(model, variant, calls):
    """Sets the variant's hooks on every parameter's local tensor; `calls`
    records (hook, what it was given)."""

    def pre_cast(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls.append(("pre", mesh.ndim, mesh.size(), tuple(outer_size), type(module).__name__))
        return (self.to(torch.bfloat16),), self.dtype

    def post_cast(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        calls.append(("post", out is not None, str(gathered.dtype), str(metadata)))
        if out is not None:
            # In place into the unsharded parameter autograd saved: its
            # version must not move (as FSDP's own copy-out keeps it).
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(gathered)
            return None
        unsharded = gathered.to(metadata)
        return unsharded, (unsharded,)

    def pre_two(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls.append(("pre", mesh.ndim, mesh.size(), tuple(outer_size), type(module).__name__))
        return (self, (self * 2).to(torch.bfloat16)), None

    def post_two(self, outputs, metadata, param_dtype, *, out=None):
        first, second = outputs
        calls.append(("post", out is not None, str(first.dtype), str(second.dtype)))
        # The second input came through the byte buffer intact.
        assert torch.equal(second, (first * 2).to(torch.bfloat16))
        if out is not None:
            return None  # `out` views `first`, whose memory the copy-out filled
        return first, (first,)

    def pre_legacy(self, mesh):
        calls.append(("pre", mesh.ndim, mesh.size()))
        return (self,), None

    def post_legacy(self, outputs, metadata, param_dtype, *, out=None):
        calls.append(("post", out is not None))
        if out is not None:
            return None
        return outputs[0], (outputs[0],)

    pre, post = {"cast": (pre_cast, post_cast), "two": (pre_two, post_two),
                 "legacy": (pre_legacy, post_legacy), "hsdp": (pre_cast, post_cast)}[variant]
    for param in model.parameters():
        local = param._local_tensor
        local.fsdp_pre_all_gather = types.MethodType(pre, local)
        local.fsdp_post_all_gather = types.MethodType(post, local)


def train_with_extensions(ctx, impl, variant):
    from torch.distributed.device_mesh import init_device_mesh

    api = fsdp_api(impl)
    if variant == "hsdp":
        mesh = init_device_mesh("cpu", (2, ctx.world_size // 2),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (ctx.world_size,))
    with torch.device("meta"):
        # Even shards: a pre hook must return padded inputs where a shard is
        # padded (checked, as upstream), which these simple hooks do not.
        model = MLPStack(n=2, dim=10, hidden=12)
    for module in model:
        if not isinstance(module, nn.Linear):
            api.fully_shard(module, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
    calls: list = []
    _install(model, variant, calls)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        x = mlp_batch(ctx.rank, step)
        loss = F.mse_loss(model(x), torch.sin(x))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    params = [p.full_tensor() for p in model.parameters()]
    return losses, params, calls


def compare_extensions(ctx, variant):
    upstream = train_with_extensions(ctx, "upstream", variant)
    ours = train_with_extensions(ctx, "ours", variant)
    problems = []
    if ours[0] != upstream[0]:
        problems.append(f"losses: ours {ours[0]} upstream {upstream[0]}")
    for i, (mine, theirs) in enumerate(zip(ours[1], upstream[1])):
        if not torch.equal(mine, theirs):
            problems.append(f"parameter {i}: max diff {(mine - theirs).abs().max().item():.3e}")
    if ours[2] != upstream[2]:
        problems.append(f"hook calls: ours {ours[2][:6]}... ({len(ours[2])}) upstream "
                        f"{upstream[2][:6]}... ({len(upstream[2])})")
    return problems, len(upstream[2])


@pytest.mark.parametrize("variant", ["cast", "two", "legacy"])
def test_extensions_on_local_tensors_match_upstream(variant, pool2):
    for rank, (problems, upstream_calls) in enumerate(pool2.run(compare_extensions, variant)):
        assert upstream_calls > 0, "upstream never called the hooks: the test proves nothing"
        assert not problems, (rank, problems)


def test_extensions_see_the_shard_mesh_under_hsdp(pool4):
    for rank, (problems, upstream_calls) in enumerate(pool4.run(compare_extensions, "hsdp")):
        assert upstream_calls > 0
        assert not problems, (rank, problems)


def unshard_with_release_hook(ctx, impl, answer):
    """An extension that casts to bf16 for the all-gather and builds the
    unsharded parameter as a new tensor, declaring through
    fsdp_should_release_all_gather_outputs_after_post_all_gather that the
    raw outputs may go at once. Returns whether each gathered output's
    memory was freed while its parameter was unsharded, and the unsharded
    parameters."""
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = MLPStack(n=1, dim=8, hidden=8)
    for module in model:
        if not isinstance(module, nn.Linear):
            api.fully_shard(module)
    api.fully_shard(model)
    gathered = []

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.to(torch.bfloat16),), self.dtype

    def post(self, outputs, metadata, param_dtype, *, out=None):
        gathered.append(outputs[0])
        if out is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(outputs[0])
            return None
        unsharded = outputs[0].to(metadata)
        return unsharded, (unsharded,)

    for param in model.parameters():
        local = param._local_tensor
        local.fsdp_pre_all_gather = types.MethodType(pre, local)
        local.fsdp_post_all_gather = types.MethodType(post, local)
        local.fsdp_should_release_all_gather_outputs_after_post_all_gather = (
            types.MethodType(lambda self: answer, local))
    try:
        model(mlp_batch(ctx.rank, 0, dim=8)).sum().backward()  # lazy init, a step's unshards
    except AssertionError as error:
        return str(error)
    block = model[1]
    block.unshard()
    freed = [g.untyped_storage().nbytes() == 0 for g in gathered[-len(list(block.parameters())):]]
    values = [p.detach().clone() for p in block.parameters()]
    block.reshard()
    return freed, values


@pytest.mark.parametrize("impl", ["ours", "upstream"])
def test_release_hook_frees_the_all_gather_outputs_after_the_post_hook(impl, pool2):
    from fsdp_testing import needs_newer_torch, upstream_has, UPSTREAM_SINCE

    if impl == "upstream" and not upstream_has("release_all_gather_outputs"):
        version, what = UPSTREAM_SINCE["release_all_gather_outputs"]
        pytest.skip(needs_newer_torch(f"upstream's {what}", version))
    results = pool2.run(unshard_with_release_hook, impl, True)
    kept = pool2.run(unshard_with_release_hook, impl, False)
    for (freed, values), (kept_freed, kept_values) in zip(results, kept):
        assert freed and all(freed), freed
        assert not any(kept_freed), kept_freed
        # The unsharded parameters do not depend on the outputs' memory.
        for mine, reference in zip(values, kept_values):
            assert torch.equal(mine, reference)
    # A hook that does not answer with a bool is refused, as upstream's.
    for message in pool2.run(unshard_with_release_hook, impl, "yes"):
        assert "must return a bool, got <class 'str'>" in message, message
