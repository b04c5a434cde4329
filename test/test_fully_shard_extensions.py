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
pre hook; both on weights sharded on dim 1; and an HSDP mesh, where the hook
sees the shard mesh only.

Then the hooks as quantised training defines them, on the class of a tensor
subclass weight (sharding must keep the class), on tensor-parallel (DTensor)
parameters, torchao's float8 training with its float8 all-gather, and
torchao's NF4 (QLoRA), int8 and BitNet weights.
"""

import contextlib
import functools
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import get_pool
from fsdp_testing import (MLPStack, WrapperWeight, compare_with_upstream, fsdp_api, mlp_batch,
                          train_mlp_steps)


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

    def pre_cast_shard1(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls.append(("pre", mesh.ndim, mesh.size(), tuple(outer_size), type(module).__name__))
        return (self.to(torch.bfloat16),), (self.dtype, tuple(outer_size))

    def post_cast_shard1(self, outputs, metadata, param_dtype, *, out=None):
        # Sharded on dim 1, the gathered output holds the unsharded layout but
        # comes viewed with the shard's trailing sizes, as upstream hands it.
        dtype, outer_size = metadata
        gathered = outputs[0].view(outer_size) if len(outer_size) == 2 else outputs[0]
        calls.append(("post", out is not None, str(gathered.dtype), tuple(outputs[0].shape)))
        if out is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(gathered)
            return None
        unsharded = gathered.to(dtype)
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
                 "legacy": (pre_legacy, post_legacy), "hsdp": (pre_cast, post_cast),
                 "shard1": (pre_cast_shard1, post_cast_shard1),
                 "two_shard1": (pre_two, post_two)}[variant]
    for param in model.parameters():
        local = param._local_tensor
        local.fsdp_pre_all_gather = types.MethodType(pre, local)
        local.fsdp_post_all_gather = types.MethodType(post, local)


def _materialize(model):
    """A model sharded on the meta device: its memory on the host, its Linear
    layers initialised from seed 0."""
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()


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
    placement = None
    if variant in ("shard1", "two_shard1"):
        from torch.distributed.tensor import Shard

        # The weights on their dim 1 (the copy-out fills each output along it).
        def placement(param):
            return Shard(1) if param.ndim == 2 else None
    for module in model:
        if not isinstance(module, nn.Linear):
            api.fully_shard(module, mesh=mesh, shard_placement_fn=placement)
    api.fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    _materialize(model)
    calls: list = []
    _install(model, variant, calls)
    losses = train_mlp_steps(model, ctx.rank)
    params = [p.full_tensor() for p in model.parameters()]
    return {"losses": losses, "params": params, "hook calls": calls}


@pytest.mark.parametrize("variant", ["cast", "two", "legacy", "shard1", "two_shard1"])
def test_extensions_on_local_tensors_match_upstream(variant, pool2):
    for rank, (problems, upstream) in enumerate(
            pool2.run(compare_with_upstream, train_with_extensions, variant)):
        assert upstream["hook calls"], "upstream never called the hooks: the test proves nothing"
        assert not problems, (rank, problems)


def test_extensions_see_the_shard_mesh_under_hsdp(pool4):
    for rank, (problems, upstream) in enumerate(
            pool4.run(compare_with_upstream, train_with_extensions, "hsdp")):
        assert upstream["hook calls"]
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


# --------------------------------------------------------------------------
# Tensor subclass parameters (Note [tensor subclass parameters]): quantised
# training keeps its weights as wrapper subclasses that define the hooks on
# the class (torchao's float8 weights, NF4). Sharding must keep the class, or
# the hooks are silently never called.

class Bf16GatherWeight(WrapperWeight):
    """With an all-gather extension that gathers it in bf16 and casts back,
    the shape of torchao's float8 weights. `calls` records the hooks' calls."""

    calls: list = []

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        Bf16GatherWeight.calls.append(("pre", mesh.size(), tuple(outer_size)))
        return (self._data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        Bf16GatherWeight.calls.append(("post", out is not None, str(gathered.dtype)))
        if out is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(gathered)
            return None
        unsharded = gathered.to(param_dtype)
        return unsharded, (unsharded,)


_WEIGHT_CLASSES = {"extension": Bf16GatherWeight, "no_extension": WrapperWeight,
                   "meta": Bf16GatherWeight}


def train_subclass_weights(ctx, impl, variant):
    """The Linear weights as subclass tensors ("extension": with the hooks;
    "no_extension": without; "meta": with the hooks, built on the meta device
    and materialised after fully_shard, so the shard is padded again), then
    three SGD steps. Returns the losses, full parameters, hook calls and the
    local tensors' classes."""
    api = fsdp_api(impl)
    cls = _WEIGHT_CLASSES[variant]
    torch.manual_seed(0)
    # Without hooks the shards are uneven, so they are padded (copied in
    # through the subclass): 11 rows over 2 ranks; over 4, 6 rows leave the
    # last rank none (torch.chunk makes 3 pieces). The hooks return the local
    # shard unpadded, which upstream allows only where shards are even.
    hidden = 12
    if variant == "no_extension":
        hidden = 6 if ctx.world_size == 4 else 11
    with torch.device("meta" if variant == "meta" else "cpu"):
        model = MLPStack(n=2, dim=10, hidden=hidden)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(cls(module.weight.detach()))
    for module in model:
        if not isinstance(module, nn.Linear):
            api.fully_shard(module)
    api.fully_shard(model)
    if variant == "meta":
        _materialize(model)
    Bf16GatherWeight.calls = []
    losses = train_mlp_steps(model, ctx.rank)
    classes = sorted({type(p._local_tensor).__name__ for p in model.parameters()})
    params = [p.full_tensor() for p in model.parameters()]
    params = [p._data if isinstance(p, WrapperWeight) else p for p in params]
    return {"losses": losses, "params": params, "hook calls": list(Bf16GatherWeight.calls),
            "classes": classes}


@pytest.mark.parametrize("world_size,variant", [
    (2, "extension"), (2, "no_extension"), (2, "meta"), (4, "no_extension"),
    # One rank: nothing gathered, each shard copied into its own storage.
    (1, "extension"), (1, "no_extension")])
def test_tensor_subclass_weights_keep_their_class_and_match_upstream(world_size, variant):
    for rank, (problems, upstream) in enumerate(
            get_pool(world_size).run(compare_with_upstream, train_subclass_weights, variant)):
        # Upstream kept the class and (with the hooks) called them: the
        # comparison has something to compare.
        classes, calls = upstream["classes"], upstream["hook calls"]
        assert classes == sorted(["Tensor", _WEIGHT_CLASSES[variant].__name__]), classes
        assert bool(calls) == (variant != "no_extension"), calls
        assert not problems, (rank, problems)


# --------------------------------------------------------------------------
# Extensions on tensor-parallel (DTensor) parameters: the hook gets the
# data-parallel mesh and the TP-local sizes, and the post hook's tensor
# becomes the TP DTensor (`out` is that DTensor after the first unshard), as
# with upstream's FSDP + TP (torchao's float8 with tensor parallelism).

def train_tp_with_extensions(ctx, impl):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from test_fully_shard_surface import TPModel, _x

    calls = []

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls.append(("pre", mesh.mesh_dim_names, mesh.size(), tuple(outer_size)))
        return (self.to(torch.bfloat16),), self.dtype

    def post(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        calls.append(("post", type(out).__name__, str(gathered.dtype)))
        if out is not None:
            local = out._local_tensor if isinstance(out, DTensor) else out
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(local):
                local.copy_(gathered)
            return None
        unsharded = gathered.to(metadata)
        return unsharded, (unsharded,)

    api = fsdp_api(impl)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TPModel()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        api.fully_shard(block, mesh=mesh["dp"])
    api.fully_shard(model, mesh=mesh["dp"])
    for param in model.parameters():
        local = param._local_tensor
        local.fsdp_pre_all_gather = types.MethodType(pre, local)
        local.fsdp_post_all_gather = types.MethodType(post, local)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for step in range(3):
        loss = model(_x(ctx.rank // 2, step)).pow(2).mean()  # one batch per TP pair
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().full_tensor() for p in model.parameters()],
            "hook calls": calls,
            "unsharded types": {type(p).__name__ for p in model.blocks[0].parameters()}}


def test_extensions_on_tensor_parallel_parameters_match_upstream(pool4):
    for rank, (problems, upstream) in enumerate(
            pool4.run(compare_with_upstream, train_tp_with_extensions)):
        assert not problems, (rank, problems)
        calls = upstream["hook calls"]
        # The hooks saw the 2-rank data-parallel mesh and TP-local sizes (the
        # column-parallel w1, 32x16, has 16 rows per TP rank), and `out` was
        # the TP DTensor after the first unshard.
        assert ("pre", ("dp",), 2, (16, 16)) in calls, calls[:6]
        assert ("post", "DTensor", "torch.bfloat16") in calls, calls[:12]


# --------------------------------------------------------------------------
# torchao's float8 training with FSDP2's float8 all-gather
# (Float8LinearConfig(enable_fsdp_float8_all_gather=True), as torchtitan runs
# it): the weights are torchao's wrapper subclass, whose extension gathers
# float8 bytes. `make test` installs torchao (without dependencies).

@contextlib.contextmanager
def recording_gathered_dtypes(weight_class):
    """While open, the dtypes of every all-gather input that weight_class's
    fsdp_pre_all_gather returns, recorded in the list it yields."""
    dtypes = []
    pre = weight_class.fsdp_pre_all_gather

    @functools.wraps(pre)  # FSDP reads the hook's signature (one argument: legacy)
    def recording_pre(self, *args, **kwargs):
        inputs, metadata = pre(self, *args, **kwargs)
        dtypes.extend(str(t.dtype) for t in inputs)
        return inputs, metadata

    weight_class.fsdp_pre_all_gather = recording_pre
    try:
        yield dtypes
    finally:
        weight_class.fsdp_pre_all_gather = pre


class Float8Net(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim, bias=False), nn.GELU(),
                          nn.Linear(2 * dim, dim, bias=False)) for _ in range(2))
        self.head = nn.Linear(dim, 16)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def train_float8(ctx, impl, compiled=False):
    from torch._dynamo.utils import counters
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    api = fsdp_api(impl)
    if compiled:
        torch._dynamo.reset()  # each implementation compiles its own graphs
        counters.clear()
    with recording_gathered_dtypes(WeightWithDynamicFloat8CastTensor) as gathered_dtypes:
        torch.manual_seed(0)
        model = Float8Net()
        convert_to_float8_training(
            model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
            module_filter_fn=lambda module, fqn: fqn != "head")
        for block in model.blocks:
            api.fully_shard(block)
            if compiled:  # as torchtitan compiles float8 blocks
                block.compile(backend="aot_eager")
        api.fully_shard(model)
        classes = sorted({type(p._local_tensor).__name__ for p in model.parameters()})
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 * step + ctx.rank))
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    params = [p.detach().full_tensor() for p in model.parameters()]
    params = [getattr(p, "_tensor", p) for p in params]  # torchao's wrapper: its data
    return {"losses": losses, "params": params, "gathered dtypes": gathered_dtypes,
            "classes": classes, "frames": counters["frames"]["total"] if compiled else 0}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_torchao_float8_all_gather_matches_upstream(compiled, pool2):
    pytest.importorskip("torchao", reason="torchao is not installed (make test installs it)")
    for rank, (problems, upstream) in enumerate(
            pool2.run(compare_with_upstream, train_float8, compiled)):
        gathered = upstream["gathered dtypes"]
        assert not compiled or upstream["frames"] > 0, "nothing compiled: the test proves nothing"
        # 4 float8 weights, gathered as float8 in each forward and backward unshard.
        assert gathered and set(gathered) == {"torch.float8_e4m3fn"}, gathered
        assert not problems, (rank, problems)


# --------------------------------------------------------------------------
# torchao's other FSDP2-aware weights, each a corner of its own: NF4 (QLoRA:
# frozen, the legacy one-argument pre hook, sharded through aten.split since
# it refuses a slice that does not start at 0), NF4 built on the meta device
# and loaded as torchtune loads it (a padded NF4 shard per rank, then
# load_state_dict(assign=True)), int8 weight-only quantised training (trained
# in place with stochastic rounding; its view(-1) is itself, 2-D) and BitNet
# (2-bit packed gathers, the post hook's out= path).

class LoRALinear(nn.Module):
    """A frozen NF4 weight with a trainable low-rank update, as in QLoRA."""

    def __init__(self, d_in, d_out, rank=8):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        super().__init__()
        self.weight = nn.Parameter(to_nf4(torch.randn(d_out, d_in) / d_in ** 0.5),
                                   requires_grad=False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)

    def forward(self, x):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


def _qlora_model():
    return nn.Sequential(*(nn.Sequential(LoRALinear(128, 512), nn.GELU(), LoRALinear(512, 128))
                           for _ in range(2)))


def _load_nf4_as_torchtune(model, full_state):
    """A model sharded on the meta device gets its weights: NF4 ones as a
    padded NF4 shard made on each rank, the rest by distribute_tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4

    sharded = {}
    for name, meta in model.state_dict().items():
        full, mesh = full_state[name], meta.device_mesh
        if isinstance(meta._local_tensor, NF4Tensor):
            full = to_nf4(full.get_original_weight(), meta._local_tensor.block_size,
                          meta._local_tensor.scaler_block_size)
            rows = torch.chunk(full, mesh.size(), dim=0)[mesh.get_local_rank()]
            local = full.new_zeros(rows.size())
            local[: rows.size(0)].copy_(rows)
            spec = DTensorSpec(mesh, meta.placements, tensor_meta=TensorMeta(
                meta.size(), meta.stride(), meta.dtype))
            tensor = DTensor(local, spec, requires_grad=False)
        else:
            tensor = distribute_tensor(full, mesh, meta.placements)
        sharded[name] = nn.Parameter(tensor, requires_grad=meta.requires_grad)
    model.load_state_dict(sharded, strict=True, assign=True)


def _quantised_weight_class(recipe):
    if recipe.startswith("nf4"):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

        return NF4Tensor
    from torchao.prototype import quantized_training

    return {"int8": quantized_training.Int8QuantizedTrainingLinearWeight,
            "bitnet": quantized_training.BitNetTrainingLinearWeight}[recipe]


def _plain_weight(tensor):
    """A quantised weight as the float tensor it stands for."""
    for name in ("get_original_weight", "dequantize"):
        if hasattr(tensor, name):
            return getattr(tensor, name)()
    return getattr(tensor, "_data", tensor)


def train_quantised(ctx, impl, recipe):
    from torchao import quantize_
    from torchao.prototype import quantized_training

    api = fsdp_api(impl)
    with recording_gathered_dtypes(_quantised_weight_class(recipe)) as gathered_dtypes:
        torch.manual_seed(0)
        if recipe == "nf4_meta_load":
            full_state = _qlora_model().state_dict()
            with torch.device("meta"):
                model = _qlora_model()
        elif recipe == "nf4":
            model = _qlora_model()
        else:
            model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(),
                                                  nn.Linear(128, 64, bias=False))
                                    for _ in range(2)))
            quantize_(model, {"int8": quantized_training.int8_weight_only_quantized_training,
                              "bitnet": quantized_training.bitnet_training}[recipe]())
        for block in model:
            api.fully_shard(block)
        api.fully_shard(model)
        if recipe == "nf4_meta_load":
            _load_nf4_as_torchtune(model, full_state)
        classes = sorted({type(p._local_tensor).__name__ for p in model.parameters()})
        # int8 weights take no weight decay (their mul_ is not implemented).
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=1e-2, weight_decay=0.0)
        losses = []
        d_in = model[0][0].weight.shape[1]
        for step in range(3):
            torch.manual_seed(100 + step)  # int8's stochastic rounding draws from it
            x = torch.randn(16, d_in, generator=torch.Generator().manual_seed(10 * step + ctx.rank))
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            if recipe == "bitnet":
                quantized_training.precompute_bitnet_scale_for_fsdp(model)
            losses.append(loss.item())
    # Each rank's shards, as the floats they stand for (int8 weights have no
    # full_tensor); NF4 weights also gathered whole, as a checkpoint saves them.
    params = [_plain_weight(p.detach()._local_tensor) for p in model.parameters()]
    if recipe.startswith("nf4"):
        params += [_plain_weight(p.detach().full_tensor()) for p in model.parameters()
                   if not p.requires_grad]
    return {"losses": losses, "params": params, "gathered dtypes": gathered_dtypes,
            "classes": classes}


@pytest.mark.parametrize("recipe, gathered, weight_class", [
    # NF4: int8 block scalers, their float32 factors, the 4-bit codes in uint8.
    ("nf4", {"torch.int8", "torch.float32", "torch.uint8"}, "NF4Tensor"),
    ("nf4_meta_load", {"torch.int8", "torch.float32", "torch.uint8"}, "NF4Tensor"),
    ("int8", {"torch.int8", "torch.float32"}, "Int8QuantizedTrainingLinearWeight"),
    ("bitnet", {"torch.int8"}, "BitNetTrainingLinearWeight"),
])
def test_torchao_quantised_weights_match_upstream(recipe, gathered, weight_class, pool2):
    pytest.importorskip("torchao", reason="torchao is not installed (make test installs it)")
    for rank, (problems, upstream) in enumerate(
            pool2.run(compare_with_upstream, train_quantised, recipe)):
        dtypes, classes = upstream["gathered dtypes"], upstream["classes"]
        assert weight_class in classes, classes
        # The quantised bytes are what travels, not the floats they stand for.
        assert dtypes and set(dtypes) == gathered, (rank, sorted(set(dtypes)))
        assert not problems, (rank, problems)
