"""Shared pieces for the fully_shard test files: small models, meshes, the two
implementations under test, and an event recorder for upstream FSDP2.

Test functions run inside the harness workers, so everything here is plain
module-level code that the workers import by name.

Two implementations can be exercised by the same checks:
- ``"ours"``: ``torch_fsdp_ext.fully_shard`` and friends (the subject);
- ``"upstream"``: ``torch.distributed.fsdp.fully_shard`` (the authority our
  expectations are verified against).
``fsdp_api(name)`` returns a namespace with the same attribute names for both.
For upstream there is no ``trace_fsdp_events``; ``upstream_trace_events`` gives
the same records by wrapping upstream's param-group methods, following the
recording conventions of fsdp2-runtime.md section 4.3.
"""

import contextlib
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torch_fsdp_ext._compat import TORCH_VERSION, needs_newer_torch

IMPLS = ("ours", "upstream")


# --------------------------------------------------------------------------
# Upstream across the torch versions we support
#
# What upstream's fully_shard lacks, or does otherwise, before the newest
# torch: the tests that compare with it skip, or leave out the one comparison
# that differs, through these, so each reason names the version. What our
# package itself adapts to is in torch_fsdp_ext/_compat.py.

UPSTREAM_SINCE = {
    "per_param_mesh": ((2, 12), "a mesh per parameter (ShardPlacementResult)"),
    "dp_mesh_dims": ((2, 12), "fully_shard(dp_mesh_dims=...)"),
    # Before: a parameter tied between two fully_shard groups goes unnoticed
    # (ours refuses it on every torch).
    "tied_across_groups_refused": (
        (2, 12), "the error for a parameter tied across two fully_shard groups"),
    # Before: an AttributeError from deep inside ("'str' object has no
    # attribute 'dim'"); ours raises the ValueError on every torch.
    "invalid_placement_error": (
        (2, 12), "a ValueError for an invalid shard_placement_fn result"),
    # Before: a grouped fully_shard([a, b]) runs its post_backward once per
    # module of the group.
    "grouped_post_backward_once": (
        (2, 12), "one post_backward per grouped fully_shard([a, b]) and backward"),
    # Before: no such range (ours records it on every torch).
    "rs_wait_profiler_range": ((2, 12), "the FSDP::post_backward_rs_wait profiler range"),
    # Before: any ModuleList / ModuleDict is refused, with or without forward.
    "container_with_forward": ((2, 12), "fully_shard of a ModuleList that implements forward"),
    "separate_reduce_scatter_group": ((2, 13), "FSDPModule.set_separate_reduce_scatter_group"),
    "reduce_scatter_max_input_buffers": (
        (2, 13), "FSDPModule.set_reduce_scatter_max_input_buffers"),
    "reduce_scatter_unused_params": ((2, 13), "FSDPModule.set_reduce_scatter_unused_params"),
    # A grouped fully_shard([norm, head]) whose head runs outside forward
    # (a chunked loss): 2.13 completes the group's post-forward at the
    # root's post-forward (_force_complete_incomplete_states), as ours does on
    # every torch. Before, upstream's numbers are the same, with one
    # reduce-scatter fewer per step, and a head run alone after a backward
    # fails in its layer_norm (mixed torch.Tensor and DTensor).
    "grouped_outside_forward": (
        (2, 13), "the post-forward of a grouped module that runs outside forward"),
    # torch 2.11's threaded test process group (ranks as threads) fails in
    # destroy_process_group ('ThreadLocalWorld' object has no attribute
    # 'comms'), and a second round of threads in the process then segfaults
    # in DTensor's sharding propagation -- with upstream's fully_shard alone
    # too, our package never imported. 2.12 fixed it.
    "threaded_process_group_rounds": (
        (2, 12), "threaded test process group, more than once per process"),
    # FSDPModule.set_manual_backward_finalization / finalize_backward (and
    # GradientReductionHandle), set_keep_unsharded_storage: torch 2.15's,
    # which its pipelining schedules call; ours has them on every torch.
    "manual_backward_finalization": (
        (2, 15), "FSDPModule.finalize_backward and set_manual_backward_finalization"),
    "keep_unsharded_storage": ((2, 15), "FSDPModule.set_keep_unsharded_storage"),
    # An all-gather extension's fsdp_should_release_all_gather_outputs_after_
    # post_all_gather: before 2.15 upstream never calls it (the outputs stay
    # allocated until reshard); ours honours it on every torch.
    "release_all_gather_outputs": (
        (2, 15), "fsdp_should_release_all_gather_outputs_after_post_all_gather"),
}


def upstream_has(feature: str) -> bool:
    return TORCH_VERSION >= UPSTREAM_SINCE[feature][0]


def requires_upstream(feature: str):
    """A skip mark for a test that compares with upstream's `feature`."""
    version, what = UPSTREAM_SINCE[feature]
    return pytest.mark.skipif(not upstream_has(feature),
                              reason=needs_newer_torch(f"upstream's {what}", version))

AG = "c10d._allgather_base_"
RS = "c10d._reduce_scatter_base_"


# --------------------------------------------------------------------------
# The implementations


def fsdp_api(impl):
    """Namespace of the fully_shard API for ``impl`` ("ours" or "upstream")."""
    if impl == "ours":
        import torch_fsdp_ext as pkg

        trace = pkg.trace_fsdp_events
    elif impl == "upstream":
        import torch.distributed.fsdp as pkg

        trace = upstream_trace_events
    else:
        raise ValueError(impl)
    return SimpleNamespace(
        name=impl,
        fully_shard=pkg.fully_shard,
        FSDPModule=pkg.FSDPModule,
        UnshardHandle=pkg.UnshardHandle,
        register_fsdp_forward_method=pkg.register_fsdp_forward_method,
        MixedPrecisionPolicy=pkg.MixedPrecisionPolicy,
        OffloadPolicy=pkg.OffloadPolicy,
        trace=trace,
    )


@contextlib.contextmanager
def upstream_trace_events():
    """Records upstream FSDP2's unshard / reshard / post_backward calls as
    ``(event, module_fqn, training_state)`` tuples, with the conventions that
    ``torch_fsdp_ext.trace_fsdp_events`` documents:

    - "unshard": only when no all-gather is pending and the group is not
      already unsharded, with the group's training state at call time;
    - "reshard": every call except forward-state calls on a group that does
      not reshard after forward;
    - "post_backward": after the call returns, with the state then.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    events = []
    originals = {
        name: getattr(FSDPParamGroup, name) for name in ("unshard", "reshard", "post_backward")
    }

    def unshard(group, *args, **kwargs):
        if group._all_gather_result is None and group._sharded_state != ShardedState.UNSHARDED:
            events.append(("unshard", group._module_fqn, group._training_state))
        return originals["unshard"](group, *args, **kwargs)

    def reshard(group, *args, **kwargs):
        if not (group._training_state == TrainingState.FORWARD
                and not group._reshard_after_forward):
            events.append(("reshard", group._module_fqn, group._training_state))
        return originals["reshard"](group, *args, **kwargs)

    def post_backward(group, *args, **kwargs):
        result = originals["post_backward"](group, *args, **kwargs)
        events.append(("post_backward", group._module_fqn, group._training_state))
        return result

    FSDPParamGroup.unshard = unshard
    FSDPParamGroup.reshard = reshard
    FSDPParamGroup.post_backward = post_backward
    try:
        yield events
    finally:
        for name, fn in originals.items():
            setattr(FSDPParamGroup, name, fn)


def plain_events(events, kinds=("unshard", "reshard", "post_backward")):
    """Events as ``(event, fqn, state name)`` tuples, keeping only ``kinds``.

    Comparing state names keeps the checks independent of which enum class an
    implementation uses."""
    out = []
    for ev in events:
        event, fqn, state = tuple(ev)
        if event in kinds:
            out.append((event, fqn, state.name))
    return out


# --------------------------------------------------------------------------
# Meshes


def make_mesh(ctx, backend):
    """A 1-D CPU mesh over every rank: "default" (None: fully_shard builds it
    from the default group, fsdp_ext), "fsdp_ext" (init_device_mesh over the
    default group) or "gloo" (the worker's gloo group)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if backend == "default":
        return None
    if backend == "fsdp_ext":
        return init_device_mesh("cpu", (ctx.world_size,))
    if backend == "gloo":
        return DeviceMesh.from_group(ctx.gloo_group, "cpu")
    raise ValueError(backend)


@contextlib.contextmanager
def counting_comms():
    """CommDebugMode, without two warnings it provokes: its module tracker's
    about full backward hooks firing on outputs (inputs are token ids), and
    upstream FSDP's about a root output that is a view."""
    from torch.distributed.tensor.debug import CommDebugMode

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        # Under the dispatch mode outputs can look like views to upstream's check.
        warnings.filterwarnings("ignore", message=".*returned a view tensor")
        with CommDebugMode() as mode:
            yield mode


def comm_counts(mode):
    """CommDebugMode counts keyed by op name ("c10d._allgather_base_", ...)."""
    return {str(op): n for op, n in mode.get_comm_counts().items() if n}


# --------------------------------------------------------------------------
# Models


_aten = torch.ops.aten
# The ops whose results stay of the subclass (the others answer plain
# tensors), as quantised-weight subclasses keep them: what sharding, padding,
# pinning and the optimizer's in-place updates go through.
WRAPPER_KEEPS_CLASS = {_aten.empty_like.default, _aten.new_zeros.default, _aten.slice.Tensor,
                       _aten.copy_.default, _aten.view.default, _aten.as_strided.default,
                       _aten._to_copy.default, _aten.split.Tensor, _aten.clone.default,
                       _aten.detach.default, _aten.alias.default}


class WrapperWeight(torch.Tensor):
    """A wrapper tensor subclass, as quantised weights are (torchao's float8,
    NF4): no storage of its own, its data is `_data`; the ops of
    WRAPPER_KEEPS_CLASS answer tensors of its class, the others plain ones."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data):
        self._data = data

    def __repr__(self):
        return f"{type(self).__name__}({self._data})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def unwrap(t):
            return t._data if isinstance(t, WrapperWeight) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func not in WRAPPER_KEEPS_CLASS:
            return out
        return tree_map(lambda t: cls(t) if isinstance(t, torch.Tensor) else t, out)


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden)
        self.out_proj = nn.Linear(hidden, dim)

    def forward(self, x):
        return F.relu(self.out_proj(F.relu(self.in_proj(x))))


class MLPStack(nn.Sequential):
    """A root Linear (the root's own parameters) followed by ``n`` MLPs."""

    def __init__(self, n=3, dim=10, hidden=24):
        super().__init__(nn.Linear(dim, dim), *[MLP(dim, hidden) for _ in range(n)])


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        # No bias: the key bias's true gradient is zero (softmax ignores a
        # per-row shift), so Adam would amplify rounding noise in it.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """Pre-norm transformer block. ``checkpoint_inside``: the feed-forward
    branch runs under torch.utils.checkpoint inside the block's forward."""

    def __init__(self, dim, heads, checkpoint_inside=False):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, 2 * dim + 4)
        self.checkpoint_inside = checkpoint_inside

    def _ffn_branch(self, h):
        return self.feed_forward(self.ffn_norm(h))

    def forward(self, x):
        h = x + self.attn(self.attn_norm(x))
        if self.checkpoint_inside:
            return h + checkpoint(self._ffn_branch, h, use_reentrant=False)
        return h + self._ffn_branch(h)


class TinyLM(nn.Module):
    """Token ids in, logits ``(batch * seq, vocab)`` out. Root parameters: token and position
    embeddings, final norm and output projection; blocks in ``layers``.

    ``ac``: None, "outer" (each block call wrapped in torch.utils.checkpoint,
    so FSDP's hooks run again during recomputation) or "inner" (checkpoint
    inside each block's forward)."""

    def __init__(self, n_layers=3, vocab=32, dim=16, heads=2, max_seq=8, ac=None):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(max_seq, dim)
        self.layers = nn.ModuleList(
            Block(dim, heads, checkpoint_inside=(ac == "inner")) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab)
        self.ac = ac
        self.vocab = vocab
        self.max_seq = max_seq

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1])
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            if self.ac == "outer":
                h = checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        # 2-D logits (batch * seq, vocab): a fresh tensor, not a view
        return self.output(self.norm(h).flatten(0, 1))


class DoubleLinear(nn.Module):
    """Two heads on the same input; returns both outputs."""

    def __init__(self, dim):
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, x):
        return F.relu(self.lin1(x)), F.relu(self.lin2(x))


def shard_lm(model, api, mesh=None, **kwargs):
    """fully_shard each block, then the root (FSDP2's usual wrapping)."""
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh, **kwargs)
    api.fully_shard(model, mesh=mesh, **kwargs)
    return model


def shard_stack(model, api, mesh=None, **kwargs):
    """fully_shard each MLP of an MLPStack, then the root."""
    for module in model:
        if isinstance(module, MLP):
            api.fully_shard(module, mesh=mesh, **kwargs)
    api.fully_shard(model, mesh=mesh, **kwargs)
    return model


def lm_batch(rank, step, vocab=32, batch=2, seq=8):
    """Per-rank, per-step token ids and next-token targets, following a
    learnable rule (each token is the previous one plus 1) from random starts."""
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 1)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits, targets):
    return F.cross_entropy(logits, targets.reshape(-1))


def mlp_batch(rank, step, dim=10, batch=4):
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 2)
    return torch.randn(batch, dim, generator=g)


# --------------------------------------------------------------------------
# Checks


def train_mlp_steps(model, rank, steps=3):
    """`steps` SGD steps (lr 0.1) of an MLPStack-shaped model on mlp_batch,
    fitting sin(x); returns the losses."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = mlp_batch(rank, step)
        loss = F.mse_loss(model(x), torch.sin(x))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def tracker_phase_sizes(tracker, kinds):
    """An FSDPMemTracker's last snapshot of every module and non-peak phase,
    {(module fqn, phase name): {kind: bytes}} for the named kinds (host)."""
    sizes_by_phase = {}
    for stats in tracker.memory_tracking.values():
        for state, taken in stats.snapshots.items():
            if state.name.startswith("PEAK"):
                continue
            sizes = {kind.name: size for kind, size in taken[-1][torch.device("cpu")].items()
                     if hasattr(kind, "name")}
            sizes_by_phase[(stats.mod_fqn, state.name)] = {k: sizes[k] for k in kinds}
    return sizes_by_phase


def average_grads(model, group, world_size):
    """The data-parallel reference: grads all-reduced (sum) over ``group``
    and divided by the world size."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(world_size)


def assert_params_match(sharded, reference, rtol=1e-5, atol=1e-5, what=""):
    """Every parameter of ``sharded`` is a DTensor whose full tensor matches
    the same-named parameter of ``reference`` (a collective over the mesh)."""
    from torch.distributed.tensor import DTensor

    ref_params = dict(reference.named_parameters())
    names = [name for name, _ in sharded.named_parameters()]
    assert names == list(ref_params), (names, list(ref_params))
    for name, param in sharded.named_parameters():
        assert isinstance(param, DTensor), f"{what}{name} is {type(param).__name__}, not DTensor"
        torch.testing.assert_close(
            param.full_tensor(), ref_params[name].detach(), rtol=rtol, atol=atol,
            msg=lambda m, name=name: f"{what}{name}: {m}",
        )


def _shown(value):
    """A recorded list in a failure message: its start and its length."""
    return f"{value[:6]}... ({len(value)})" if isinstance(value, list) else value


def differences(ours: dict, upstream: dict) -> list[str]:
    """What differs between two runs of one training function, ours and
    upstream's: "params" tensor by tensor, bit for bit; "frames" (what dynamo
    compiled) where ours compiled more; every other entry by ==."""
    problems = []
    if ours.keys() != upstream.keys():
        problems.append(f"recorded: ours {sorted(ours)} upstream {sorted(upstream)}")
    for key in ours.keys() & upstream.keys():
        mine, theirs = ours[key], upstream[key]
        if key == "params":
            if len(mine) != len(theirs):
                problems.append(f"{len(mine)} parameters, upstream {len(theirs)}")
            problems += [f"parameter {i}: size {tuple(a.shape)}, upstream {tuple(b.shape)}"
                         if a.shape != b.shape else
                         f"parameter {i}: max diff {(a - b).abs().max().item():.3e}"
                         for i, (a, b) in enumerate(zip(mine, theirs)) if not torch.equal(a, b)]
        elif key == "frames":
            # Note [C++ hooks run outside dynamo]: dynamo must not compile
            # the extension's hooks as frames of their own (the float8 post
            # hook's new scale then never reached the weight).
            if mine > theirs:
                problems.append(f"dynamo compiled {mine} frames, upstream {theirs}")
        elif mine != theirs:
            problems.append(f"{key}: ours {_shown(mine)} upstream {_shown(theirs)}")
    return problems


def compare_with_upstream(ctx, train, *args):
    """`train` run with upstream's fully_shard, then ours: the differences,
    and what upstream's run recorded (for the test to check it did what the
    test is about), its parameters left here."""
    upstream = train(ctx, "upstream", *args)
    ours = train(ctx, "ours", *args)
    return differences(ours, upstream), {k: v for k, v in upstream.items() if k != "params"}
