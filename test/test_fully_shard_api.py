"""The fully_shard API surface of torch_fsdp_ext, checked against upstream FSDP2.

What is checked (each check runs on every rank of a worker pool, for our
implementation and, where cheap, for torch.distributed.fsdp.fully_shard too,
so the expectations themselves are known to hold for upstream):
- the class swap: ``FSDP<Cls>`` with bases ``(FSDPModule, Cls)``, one cached
  class per original class, submodules untouched, list arguments, slicing an
  ``nn.Sequential`` giving a plain ``Sequential``;
- sharded parameters: DTensors placed ``Shard(0)`` on a 1-D mesh whose local
  shard equals ``distribute_tensor`` of the original, including uneven dim-0
  sizes (1, 3, 5, 17 over 4 ranks: trailing ranks hold fewer or zero rows);
- one SGD iteration of an uneven ``Linear(3, 3)`` against a closed form;
- errors with upstream's types and messages (scalar and non-contiguous
  parameters, bad ``reshard_after_forward``, applying twice, containers
  without forward, deepcopy, bad prefetch lists and forward methods, meshes
  of the wrong shape);
- ``state_dict()`` / ``load_state_dict()`` with DTensors;
- torch.optim and ``clip_grad_norm_`` on DTensor gradients;
- ``register_fsdp_forward_method``;
- ``unshard(async_op=True)`` + ``wait()``, sync ``unshard()`` and ``reshard()``;
- world size 1 issues no collectives at all.
"""

import copy
import math
import re

import pytest
import torch
import torch.nn as nn

from conftest import get_pool
from fsdp_testing import (
    IMPLS,
    MLP,
    MLPStack,
    TinyLM,
    assert_params_match,
    average_grads,
    compare_with_upstream,
    counting_comms,
    upstream_has,
    fsdp_api,
    lm_batch,
    lm_loss,
    make_mesh,
    mlp_batch,
    shard_lm,
    shard_stack,
    train_mlp_steps,
    UPSTREAM_SINCE,
)
from torch_fsdp_ext._compat import needs_newer_torch

# --------------------------------------------------------------------------
# Exports


def check_exports(ctx):
    import enum

    import torch.distributed.fsdp as upstream
    import torch_fsdp_ext

    for name in ("fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
                 "trace_fsdp_events", "TrainingState"):
        assert hasattr(torch_fsdp_ext, name), name
    # The policies are upstream's own classes.
    for name in ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"):
        assert getattr(torch_fsdp_ext, name) is getattr(upstream, name), name
    assert torch_fsdp_ext.fully_shard is not upstream.fully_shard
    assert issubclass(torch_fsdp_ext.TrainingState, enum.Enum)
    assert [m.name for m in torch_fsdp_ext.TrainingState] == [
        "FORWARD", "PRE_BACKWARD", "POST_BACKWARD", "IDLE"]
    return True


def test_exports():
    get_pool(1).run(check_exports)


# --------------------------------------------------------------------------
# Class swap


def check_class_swap(ctx, impl):
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = MLPStack(n=2)
    first, second = model[1], model[2]
    assert api.fully_shard(first) is first
    api.fully_shard(second)
    assert api.fully_shard(model) is model

    for module, cls in ((model, MLPStack), (first, MLP), (second, MLP)):
        assert type(module).__name__ == "FSDP" + cls.__name__, type(module).__name__
        assert type(module).__bases__ == (api.FSDPModule, cls), type(module).__bases__
        assert isinstance(module, cls)
        assert isinstance(module, api.FSDPModule)
    # One dynamic class per original class.
    assert type(first) is type(second)
    # Only the modules passed in are swapped.
    assert type(model[0]) is nn.Linear
    assert type(first.in_proj) is nn.Linear and type(first.out_proj) is nn.Linear
    # Each call's state is found through the module.
    assert model._get_fsdp_state() is not first._get_fsdp_state()

    # Slicing a swapped Sequential builds the original class.
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    api.fully_shard(seq)
    assert type(seq).__name__ == "FSDPSequential"
    sliced = seq[:2]
    assert type(sliced) is nn.Sequential, type(sliced)
    assert len(sliced) == 2 and sliced[0] is seq[0]

    # A list shares one state and returns the list.
    torch.manual_seed(0)
    pair = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    modules = [pair[0], pair[1]]
    returned = api.fully_shard(modules)
    assert isinstance(returned, list) and len(returned) == 2
    assert returned[0] is pair[0] and returned[1] is pair[1]
    assert type(pair[0]).__name__ == "FSDPLinear"
    assert pair[0]._get_fsdp_state() is pair[1]._get_fsdp_state()
    api.fully_shard(pair)
    out = pair(torch.randn(3, 4))
    out.sum().backward()
    for param in pair.parameters():
        assert param.grad is not None
    return True


@pytest.mark.parametrize("impl", IMPLS)
def test_class_swap(impl):
    get_pool(2).run(check_class_swap, impl)


# --------------------------------------------------------------------------
# Sharded parameters

# dim-0 sizes 1, 3, 5, 17 exercise every uneven case on 2 and 4 ranks.
PARAM_SHAPES = {
    "a": (17, 3),
    "b": (5,),
    "c": (3, 2),
    "d": (1, 4),
    "e": (1,),
    "f": (8, 8),
}


class ParamBag(nn.Module):
    def __init__(self, frozen=("f",)):
        super().__init__()
        for name, shape in PARAM_SHAPES.items():
            self.register_parameter(
                name, nn.Parameter(torch.randn(shape), requires_grad=name not in frozen)
            )

    def forward(self, x):
        return x * sum(p.sum() for p in self.parameters())


def expected_rows(dim0, world_size, rank):
    """torch.chunk semantics: chunks of ceil(dim0 / ws) rows, trailing ranks
    get the remainder or nothing."""
    chunk = math.ceil(dim0 / world_size)
    return max(0, min(chunk, dim0 - rank * chunk))


def check_sharded_params(ctx, impl, backend):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = ParamBag()
    originals = {name: p.detach().clone() for name, p in model.named_parameters()}
    mesh = make_mesh(ctx, backend)
    api.fully_shard(model, mesh=mesh)

    names = [name for name, _ in model.named_parameters()]
    assert names == list(PARAM_SHAPES), names
    for name, param in model.named_parameters():
        orig = originals[name]
        assert isinstance(param, nn.Parameter), name
        assert isinstance(param, DTensor), (name, type(param))
        assert param.placements == (Shard(0),), (name, param.placements)
        assert param.device_mesh.ndim == 1 and param.device_mesh.size() == ctx.world_size
        assert param.device_mesh.device_type == "cpu"
        if mesh is not None:
            assert param.device_mesh == mesh
        assert param.shape == orig.shape and param.stride() == orig.stride(), name
        assert param.requires_grad == (name != "f"), name
        local = param.to_local()
        rows = expected_rows(orig.shape[0], ctx.world_size, ctx.rank)
        assert tuple(local.shape) == (rows, *orig.shape[1:]), (name, local.shape)
        expected = distribute_tensor(orig, param.device_mesh, [Shard(0)]).to_local()
        assert torch.equal(local, expected), name
        assert torch.equal(param.full_tensor(), orig), name

    # The sharded module still trains: the bag's only output depends on
    # every trainable parameter.
    out = model(torch.ones(2))
    out.sum().backward()
    for name, param in model.named_parameters():
        if name == "f":
            assert param.grad is None
        else:
            assert isinstance(param.grad, DTensor), name
            assert param.grad.placements == (Shard(0),)
            # d(sum(x * S))/dp = sum(x) = 2 per rank, averaged over ranks
            torch.testing.assert_close(param.grad.full_tensor(), torch.full_like(originals[name], 2.0))
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ws,backend", [(1, "default"), (2, "default"), (2, "gloo"),
                                        (4, "fsdp_ext"), (4, "gloo")])
def test_sharded_params_match_distribute_tensor(ws, backend, impl):
    get_pool(ws).run(check_sharded_params, impl, backend)


def check_uneven_one_iteration(ctx, impl):
    """One iteration of a Linear(3, 3) without bias, each rank feeding its own
    row: forward output and the SGD-updated weight follow in closed form."""
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = nn.Linear(3, 3, bias=False)
    inputs = torch.rand(ctx.world_size, 3)
    lr = 0.1
    weight = model.weight.detach().clone()
    x = inputs[ctx.rank]
    expected_out = x @ weight.T
    # loss = sum(W x): dL/dW has every row equal to x; FSDP averages over ranks.
    expected_weight = weight - lr * inputs.mean(0).expand(3, 3)

    api.fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    out = model(x)
    torch.testing.assert_close(out, expected_out)
    out.sum().backward()
    optim.step()
    optim.zero_grad()
    torch.testing.assert_close(model.weight.full_tensor(), expected_weight)
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ws", [1, 2, 4])
def test_uneven_one_iteration(ws, impl):
    get_pool(ws).run(check_uneven_one_iteration, impl)


# --------------------------------------------------------------------------
# Errors


class WithScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.scalar_p = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.lin(x) * self.scalar_p


class ListWithForward(nn.ModuleList):
    def forward(self, x):
        for module in self:
            x = module(x)
        return x


def check_errors(ctx, impl):
    api = fsdp_api(impl)
    ws = ctx.world_size
    torch.manual_seed(0)

    with pytest.raises(ValueError, match=re.escape(
            "Change scalar_p to a 1D tensor with numel equal to 1.")):
        api.fully_shard(WithScalar())

    lin = nn.Linear(3, 4)
    lin.weight = nn.Parameter(torch.randn(3, 4).t())
    assert not lin.weight.is_contiguous()
    with pytest.raises(NotImplementedError, match="FSDP does not support non-contiguous parameters"):
        api.fully_shard(lin)

    for bad in ("yes", 1.5):
        with pytest.raises(ValueError, match="reshard_after_forward should be a bool or an int"):
            api.fully_shard(nn.Linear(2, 2), reshard_after_forward=bad)
    for bad in (0, ws + 1, 3 if ws in (2, 4) else -1):
        message = f"If passing reshard_after_forward as an int, it should be a factor of {ws}, not {bad}"
        with pytest.raises(ValueError, match=re.escape(message)):
            api.fully_shard(nn.Linear(2, 2), reshard_after_forward=bad)

    twice = api.fully_shard(nn.Linear(2, 2))
    with pytest.raises(AssertionError, match=re.escape(
            "Each distinct composable distributed API can only be applied to a module once.")):
        api.fully_shard(twice)

    for container in (nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"a": nn.Linear(2, 2)})):
        with pytest.raises(ValueError, match="fully_shard does not support containers that do not implement forward"):
            api.fully_shard(container)
    # A container class that does implement forward is fine (ours on every
    # torch; upstream's refuses every ModuleList before torch 2.12).
    if impl == "ours" or upstream_has("container_with_forward"):
        chain = api.fully_shard(ListWithForward([nn.Linear(2, 2), nn.Linear(2, 2)]))
        assert type(chain).__name__ == "FSDPListWithForward"
        chain(torch.randn(1, 2)).sum().backward()
    else:
        with pytest.raises(ValueError, match="fully_shard does not support containers"):
            api.fully_shard(ListWithForward([nn.Linear(2, 2)]))

    model = api.fully_shard(nn.Sequential(api.fully_shard(nn.Linear(2, 2)), nn.Linear(2, 2)))
    with pytest.raises(AssertionError, match="FSDP does not support deepcopy"):
        copy.deepcopy(model)

    with pytest.raises(ValueError, match="Expects FSDPModule but got"):
        model.set_modules_to_forward_prefetch([model[1]])
    with pytest.raises(ValueError, match="Expects FSDPModule but got"):
        model.set_modules_to_backward_prefetch([model[1]])
    with pytest.raises(ValueError, match="reshard_after_forward should be a bool"):
        model.set_reshard_after_forward(2)
    with pytest.raises(ValueError, match="does not have a method forward_features"):
        api.register_fsdp_forward_method(model, "forward_features")
    # Registering on a module that is not an FSDPModule is a no-op.
    plain = nn.Linear(2, 2)
    api.register_fsdp_forward_method(plain, "forward")
    assert "forward" not in plain.__dict__
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ws", [1, 2, 4])
def test_errors(ws, impl):
    get_pool(ws).run(check_errors, impl)


def check_mesh_errors(ctx, impl):
    from torch.distributed.device_mesh import init_device_mesh

    api = fsdp_api(impl)
    mesh_3d = init_device_mesh("cpu", (1, 1, ctx.world_size))
    with pytest.raises(ValueError, match="fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh"):
        api.fully_shard(nn.Linear(2, 2), mesh=mesh_3d)
    mesh_2d = init_device_mesh("cpu", (1, ctx.world_size))
    with pytest.raises(AssertionError, match="Please init the 2D mesh for HSDP with mesh_dim_names specified"):
        api.fully_shard(nn.Linear(2, 2), mesh=mesh_2d)
    return True


@pytest.mark.parametrize("impl", IMPLS)
def test_mesh_errors(impl):
    get_pool(2).run(check_mesh_errors, impl)


def check_newer_torch_features(ctx):
    """What a newer torch brought: an invalid shard_placement_fn result is
    upstream's ValueError; before torch 2.12 (no per-parameter meshes, no
    dp_mesh_dims) ours also says what needs 2.12 and which torch this is."""
    import torch_fsdp_ext
    from torch.distributed.fsdp import fully_shard as upstream_fully_shard

    from torch_fsdp_ext import _compat

    def message(call):
        with pytest.raises((ValueError, NotImplementedError)) as info:
            call()
        return f"{type(info.value).__name__}: {info.value}"

    invalid = ("not a placement",)
    ours = message(lambda: torch_fsdp_ext.fully_shard(
        nn.Linear(2, 2), shard_placement_fn=lambda p: invalid))
    if _compat.ShardPlacementResult is not None:
        upstream = message(lambda: upstream_fully_shard(
            nn.Linear(2, 2), shard_placement_fn=lambda p: invalid))
        assert ours == upstream, (ours, upstream)
        return ours
    version = f"this is torch {torch.__version__}"
    assert ours.startswith(f"ValueError: Invalid shard_placement_fn result: {invalid}"), ours
    assert "ShardPlacementResult) needs torch >= 2.12" in ours and version in ours, ours
    dims = message(lambda: torch_fsdp_ext.fully_shard(nn.Linear(2, 2), dp_mesh_dims=object()))
    assert dims == ("NotImplementedError: torch_fsdp_ext.fully_shard: dp_mesh_dims "
                    f"(DataParallelMeshDims) needs torch >= 2.12; {version}"), dims
    return ours


def test_newer_torch_features_refused_clearly():
    get_pool(1).run(check_newer_torch_features)


# --------------------------------------------------------------------------
# State dict


def check_state_dict(ctx, impl, backend):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    api = fsdp_api(impl)
    mesh = make_mesh(ctx, backend)

    def build(seed):
        torch.manual_seed(seed)
        model = MLPStack(n=2)
        model.register_buffer("scale", torch.arange(3.0) + seed)
        return model

    model = build(0)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    param_names = [name for name, _ in model.named_parameters()]  # ordered: full_tensor() is a collective
    shard_stack(model, api, mesh)

    saved = model.state_dict()
    assert list(saved) == list(before), (list(saved), list(before))
    for key, value in saved.items():
        if key in param_names:
            assert isinstance(value, DTensor), key
            assert value.placements == (Shard(0),), key
            assert torch.equal(value.full_tensor(), before[key]), key
        else:
            assert not isinstance(value, DTensor) and torch.equal(value, before[key]), key

    # Load other values, given as DTensors sharded the same way.
    other = build(1)
    param_mesh = next(model.parameters()).device_mesh
    to_load = {}
    for key, value in other.state_dict().items():
        if key in param_names:
            to_load[key] = distribute_tensor(value.detach().clone(), param_mesh, [Shard(0)])
        else:
            to_load[key] = value.clone()
    model.load_state_dict(to_load)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert torch.equal(param.full_tensor(), dict(other.named_parameters())[name].detach()), name
    assert torch.equal(model.scale, other.scale)

    # The loaded model computes what the plain one computes, and trains.
    x = mlp_batch(ctx.rank, 0)
    out = model(x)
    torch.testing.assert_close(out, other(x))
    out.sum().backward()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and isinstance(param.grad, DTensor), name

    # state_dict() while parameters are unsharded (no reshard after forward)
    # still gives sharded DTensors.
    model = build(2)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shard_stack(model, api, mesh, reshard_after_forward=False)
    with torch.no_grad():
        model(x)
    assert not isinstance(model[1].in_proj.weight, DTensor)
    saved = model.state_dict()
    for key in param_names:
        assert isinstance(saved[key], DTensor), key
        assert torch.equal(saved[key].full_tensor(), expected[key]), key
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ws,backend", [(1, "default"), (2, "default"), (4, "gloo")])
def test_state_dict_round_trip(ws, backend, impl):
    get_pool(ws).run(check_state_dict, impl, backend)


def load_assigned_and_train(ctx, impl):
    """A model sharded on the meta device gets sharded tensors by
    load_state_dict(assign=True) (torchtune's loading) and trains: the
    losses and parameters, and which parameters kept the very tensors loaded
    (upstream's keep a shard of the padded size; hidden=25 rows over 2 ranks
    leave rank 1 a shorter one, which is padded into a tensor of its own)."""
    from torch.distributed.tensor import distribute_tensor

    api = fsdp_api(impl)
    torch.manual_seed(0)
    full = MLPStack(n=2, dim=10, hidden=25).state_dict()
    with torch.device("meta"):
        model = MLPStack(n=2, dim=10, hidden=25)
    shard_stack(model, api)
    loaded = {name: nn.Parameter(distribute_tensor(full[name], meta.device_mesh, meta.placements))
              for name, meta in model.state_dict().items()}
    pointers = {name: param._local_tensor.data_ptr() for name, param in loaded.items()}
    model.load_state_dict(loaded, assign=True)
    del loaded
    losses = train_mlp_steps(model, ctx.rank)
    kept = sorted(name for name, param in model.named_parameters()
                  if param._local_tensor.data_ptr() == pointers[name])
    return {"losses": losses, "params": [p.detach().full_tensor() for p in model.parameters()],
            "kept the loaded tensor": kept}


def test_load_state_dict_assign_keeps_the_loaded_shards_as_upstream():
    for rank, (problems, upstream) in enumerate(
            get_pool(2).run(compare_with_upstream, load_assigned_and_train)):
        kept = upstream["kept the loaded tensor"]
        # Upstream kept some loaded tensors (all on rank 0), padded others
        # (rank 1's in_proj): the comparison covers both.
        assert kept and (rank == 0) == (len(kept) == 10), (rank, kept)
        assert not problems, (rank, problems)


# --------------------------------------------------------------------------
# Optimizer and gradient clipping


def check_optim_and_clip(ctx, impl):
    from torch.distributed.tensor import DTensor, Shard

    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = MLPStack(n=2)
    ref = copy.deepcopy(model)
    shard_stack(model, api)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    max_norm = 0.05
    for step in range(4):
        x = mlp_batch(ctx.rank, step)
        ref_loss = ref(x).pow(2).sum()
        ref_loss.backward()
        average_grads(ref, ctx.gloo_group, ctx.world_size)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        assert ref_norm > max_norm  # clipping is active

        loss = model(x).pow(2).sum()
        loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        if step == 0:
            for name, param in model.named_parameters():
                assert isinstance(param.grad, DTensor), name
                assert param.grad.placements == (Shard(0),), name
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
        if step == 0:
            ref_grads = dict(ref.named_parameters())
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.grad.full_tensor(), ref_grads[name].grad,
                                           rtol=1e-5, atol=1e-6)
        optim.step()
        ref_optim.step()
        optim.zero_grad(set_to_none=(step % 2 == 0))
        ref_optim.zero_grad(set_to_none=(step % 2 == 0))
    assert_params_match(model, ref)
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ws", [1, 2, 4])
def test_optimizer_and_clip_grad_norm(ws, impl):
    get_pool(ws).run(check_optim_and_clip, impl)


# --------------------------------------------------------------------------
# register_fsdp_forward_method


class WithFeatures(nn.Module):
    """``forward_features`` uses the root's own ``proj_in`` and the FSDP child
    ``encoder``; ``forward`` adds the head."""

    def __init__(self, dim=10):
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        self.encoder = MLP(dim, 24)
        self.head = nn.Linear(dim, 3)

    def forward_features(self, x):
        return self.encoder(self.proj_in(x))

    def forward(self, x):
        # Not through forward_features: a registered method called from
        # forward would run FSDP's hooks twice (nested).
        return self.head(self.encoder(self.proj_in(x)))


def check_register_forward_method(ctx, impl):
    from torch.distributed.tensor import DTensor

    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = WithFeatures()
    ref = copy.deepcopy(model)
    api.fully_shard(model.encoder)
    api.fully_shard(model, reshard_after_forward=True)
    api.register_fsdp_forward_method(model, "forward_features")

    for step in range(2):
        x = mlp_batch(ctx.rank, step)
        out = model.forward_features(x)
        ref_out = ref.forward_features(x)
        torch.testing.assert_close(out, ref_out)
        # The root resharded after the registered method (like after forward).
        assert isinstance(model.proj_in.weight, DTensor)
        out.sum().backward()
        ref_out.sum().backward()
        average_grads(ref, ctx.gloo_group, ctx.world_size)
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            if name.startswith("head."):
                assert param.grad is None and ref_params[name].grad is None, name
            else:
                torch.testing.assert_close(param.grad.full_tensor(), ref_params[name].grad,
                                           rtol=1e-5, atol=1e-6)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    # forward itself still works alongside the registered method.
    x = mlp_batch(ctx.rank, 9)
    torch.testing.assert_close(model(x), ref(x))
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ws", [1, 2])
def test_register_fsdp_forward_method(ws, impl):
    get_pool(ws).run(check_register_forward_method, impl)


# --------------------------------------------------------------------------
# Explicit unshard / reshard


def check_unshard_reshard(ctx, impl):
    from torch.distributed.tensor import DTensor

    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = MLPStack(n=2)
    ref = copy.deepcopy(model)
    ref_params = dict(ref.named_parameters())
    shard_stack(model, api)

    def assert_unsharded(module, prefix):
        for name, param in module.named_parameters(prefix=prefix):
            assert not isinstance(param, DTensor), name
            assert torch.equal(param.detach(), ref_params[name].detach()), name

    def assert_sharded(module):
        for name, param in module.named_parameters():
            assert isinstance(param, DTensor), name

    # Before any forward: async unshard of the root only (not recursive).
    handle = model.unshard(async_op=True)
    assert isinstance(handle, api.UnshardHandle)
    handle.wait()
    handle.wait()  # a second wait is harmless
    assert_unsharded(model[0], "0")
    assert_sharded(model[1])
    assert_sharded(model[2])
    model.reshard()
    assert_sharded(model)

    # Synchronous unshard returns None and leaves the module unsharded.
    assert model[1].unshard() is None
    assert_unsharded(model[1], "1")
    model[1].reshard()
    assert_sharded(model)

    # Unshard, then train: forward finds the root already unsharded.
    assert model.unshard(async_op=True) is not None
    x = mlp_batch(ctx.rank, 0)
    out = model(x)
    ref_out = ref(x)
    torch.testing.assert_close(out, ref_out)
    out.sum().backward()
    ref_out.sum().backward()
    average_grads(ref, ctx.gloo_group, ctx.world_size)
    assert_sharded(model)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), ref_params[name].grad,
                                   rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ws", [1, 2, 4])
def test_unshard_and_reshard(ws, impl):
    get_pool(ws).run(check_unshard_reshard, impl)


def _skip_unless_impl_has(impl, feature):
    """Ours has torch 2.15's FSDPModule methods on every torch; upstream's
    only from 2.15 (compared there, by the compatibility pass)."""
    if impl == "upstream" and not upstream_has(feature):
        version, what = UPSTREAM_SINCE[feature]
        pytest.skip(needs_newer_torch(f"upstream's {what}", version))


def check_manual_backward_finalization(ctx, impl):
    """torch 2.15's pipelining flow: microbatch backwards with gradient sync
    and resharding off under manual finalization, then sync on and
    finalize_backward(async_op=True), its handle waited on. The gradients
    are those of the automatic flow (sync only on the last microbatch), bit
    for bit: the same sums in the same order."""
    import torch.distributed.fsdp as upstream_fsdp
    from torch.distributed.tensor import DTensor

    pkg = upstream_fsdp if impl == "upstream" else __import__("torch_fsdp_ext")
    api = fsdp_api(impl)
    torch.manual_seed(0)
    automatic = MLPStack(n=2)
    manual = copy.deepcopy(automatic)
    shard_stack(automatic, api)
    shard_stack(manual, api)
    batches = [mlp_batch(ctx.rank, step) for step in range(3)]

    for i, x in enumerate(batches):
        automatic.set_requires_gradient_sync(i == len(batches) - 1)
        automatic(x).sum().backward()

    # Before the first forward: a no-op, a handle whose wait() does nothing.
    assert manual.finalize_backward() is None
    manual.finalize_backward(async_op=True).wait()
    manual.set_manual_backward_finalization(True)
    manual.set_requires_gradient_sync(False)
    manual.set_reshard_after_backward(False)
    for x in batches:
        manual(x).sum().backward()
    # Nothing reduced nor resharded yet: the unsharded parameters hold the
    # accumulated gradients. The mode is the iteration's until it ends.
    for name, param in manual.named_parameters():
        assert not isinstance(param, DTensor) and param.grad is not None, name
    with pytest.raises(RuntimeError, match="cannot change mode after backward starts"):
        manual.set_manual_backward_finalization(False)
    with pytest.raises(RuntimeError, match="must be called on the root"):
        manual[1].set_manual_backward_finalization(True)
    manual.set_requires_gradient_sync(True)
    manual.set_reshard_after_backward(True)
    handle = manual.finalize_backward(async_op=True)
    assert isinstance(handle, pkg.GradientReductionHandle), type(handle)
    with pytest.raises(RuntimeError, match="must be waited on before forward"):
        manual(batches[0])
    with pytest.raises(RuntimeError, match="waited on before finalizing backward again"):
        manual.finalize_backward()
    handle.wait()
    handle.wait()  # a second wait is harmless
    manual.set_manual_backward_finalization(False)
    for (name, ours), theirs in zip(manual.named_parameters(), automatic.parameters()):
        assert ours.grad is not None, name
        assert torch.equal(ours.grad.to_local(), theirs.grad.to_local()), (
            name, ours.grad.to_local(), theirs.grad.to_local())
    for name, param in manual.named_parameters():
        assert isinstance(param, DTensor), name  # resharded

    # Back in automatic mode: finalize_backward is refused, training goes on.
    with pytest.raises(RuntimeError, match="requires manual backward finalization"):
        manual.finalize_backward()
    manual(batches[0]).sum().backward()
    # Synchronous finalization of one backward with sync on.
    manual.set_manual_backward_finalization(True)
    manual.zero_grad()
    automatic.zero_grad()
    manual(batches[1]).sum().backward()
    automatic(batches[1]).sum().backward()
    assert manual.finalize_backward() is None
    for (name, ours), theirs in zip(manual.named_parameters(), automatic.parameters()):
        assert torch.equal(ours.grad.to_local(), theirs.grad.to_local()), name
    return True


@pytest.mark.parametrize("impl", IMPLS)
def test_manual_backward_finalization(impl):
    _skip_unless_impl_has(impl, "manual_backward_finalization")
    get_pool(2).run(check_manual_backward_finalization, impl)


def check_async_finalize_with_another_roots_work(ctx, impl):
    """Two roots sharing a comm context (share_comm_ctx, pipeline stages):
    while the first has run a forward whose backward has not ended, the
    second's finalize_backward(async_op=True) is refused, as upstream's is;
    once the first's backward has ended it goes ahead."""
    import torch.distributed.fsdp as upstream_fsdp

    pkg = upstream_fsdp if impl == "upstream" else __import__("torch_fsdp_ext").fsdp
    api = fsdp_api(impl)
    torch.manual_seed(0)
    first, second = shard_stack(MLPStack(n=1), api), shard_stack(MLPStack(n=1), api)
    pkg.share_comm_ctx([first, second])
    x = mlp_batch(ctx.rank, 0)
    # One automatic step each first: upstream's lazy init of a root resets the
    # shared context's forward order, which would drop first's entries.
    for model in (first, second):
        model(x).sum().backward()
    second.set_manual_backward_finalization(True)
    loss = first(x).sum()  # first's forward order is on the shared context
    second(x).sum().backward()
    with pytest.raises(RuntimeError, match="cannot overlap work from another FSDP root"):
        second.finalize_backward(async_op=True)
    loss.backward()  # first's backward ends: the context holds nothing of it
    second.finalize_backward(async_op=True).wait()
    return all(p.grad is not None for p in second.parameters())


@pytest.mark.parametrize("impl", IMPLS)
def test_async_finalize_refuses_to_overlap_another_roots_work(impl):
    _skip_unless_impl_has(impl, "manual_backward_finalization")
    assert all(get_pool(2).run(check_async_finalize_with_another_roots_work, impl))


def check_keep_unsharded_storage(ctx, impl):
    """set_keep_unsharded_storage(True): resharding leaves the unsharded
    parameters' storage allocated, so the next unshard writes the same memory
    (the same data pointers); False: it is freed again."""
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = shard_stack(MLPStack(n=2), api)
    block = model[1]

    def unsharded_weight():
        block.unshard()
        weight = block.in_proj.weight
        return weight, weight.data_ptr()

    weight, pointer = unsharded_weight()
    block.reshard()
    assert weight.untyped_storage().nbytes() == 0  # freed by default
    model.set_keep_unsharded_storage(True)
    weight, pointer = unsharded_weight()
    block.reshard()
    assert weight.untyped_storage().nbytes() > 0
    assert unsharded_weight()[1] == pointer
    block.reshard()
    model.set_keep_unsharded_storage(False, recurse=True)
    weight, _ = unsharded_weight()
    block.reshard()
    assert weight.untyped_storage().nbytes() == 0
    return True


@pytest.mark.parametrize("impl", IMPLS)
def test_keep_unsharded_storage(impl):
    _skip_unless_impl_has(impl, "keep_unsharded_storage")
    get_pool(2).run(check_keep_unsharded_storage, impl)


# --------------------------------------------------------------------------
# World size 1


def check_world_size_one(ctx, impl, backend):
    from torch.distributed.tensor import DTensor

    assert ctx.world_size == 1
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = TinyLM(n_layers=2)
    ref = copy.deepcopy(model)
    for raf in (True, False, None):
        model = copy.deepcopy(ref)
        shard_lm(model, api, make_mesh(ctx, backend), reshard_after_forward=raf)
        for param in model.parameters():
            assert isinstance(param, DTensor)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        # One CommDebugMode per phase (its module tracker expects that).
        for step in range(2):
            tokens, targets = lm_batch(ctx.rank, step)
            with counting_comms() as forward_mode:
                loss = lm_loss(model(tokens), targets)
            with counting_comms() as backward_mode:
                loss.backward()
            with counting_comms() as step_mode:
                optim.step()
                optim.zero_grad()
                model.unshard()
                model.reshard()
            for mode in (forward_mode, backward_mode, step_mode):
                assert mode.get_total_counts() == 0, (raf, step, mode.get_comm_counts())
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("backend", ["default", "gloo"])
def test_world_size_one_issues_no_collectives(backend, impl):
    get_pool(1).run(check_world_size_one, impl, backend)


def train_world_size_one(ctx, config):
    """Both implementations train TinyLM from the same weights at world size 1
    (config: fp32; accumulate, two backwards per step; bf16 parameters with
    fp32 reduction; divide, an explicit gradient divide factor). Returns each
    one's losses and final parameters, and for ours whether every sharded
    gradient has a storage of its own (no flat reduce buffer behind it)."""
    torch.manual_seed(0)
    reference = TinyLM(n_layers=2)
    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        model = copy.deepcopy(reference)
        kwargs = {}
        if config == "bf16":
            kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                          reduce_dtype=torch.float32)
        shard_lm(model, api, make_mesh(ctx, "default"), **kwargs)
        if config == "divide":
            model.set_gradient_divide_factor(2.0)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, own_storage = [], []
        for step in range(3):
            for micro in range(2 if config == "accumulate" else 1):
                tokens, targets = lm_batch(ctx.rank, 2 * step + micro)
                loss = lm_loss(model(tokens), targets)
                loss.backward()
                losses.append(loss.item())
            own_storage.append(all(
                p.grad._local_tensor.untyped_storage().nbytes() == p.numel() * p.element_size()
                for p in model.parameters()))
            optim.step()
            optim.zero_grad()
        params = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
        out[impl] = (losses, params, own_storage)
    return out


@pytest.mark.parametrize("config", ["fp32", "accumulate", "bf16", "divide"])
def test_world_size_one_matches_upstream_bitwise(config):
    """At world size 1 ours skips the flat reduce buffer where the reduction
    is the identity (Note [a gradient that is its own shard]): the numbers
    stay upstream's, bit for bit, in that case and in those that still pack."""
    out = get_pool(1).run(train_world_size_one, config)[0]
    ours, upstream = out["ours"], out["upstream"]
    assert ours[0] == upstream[0], (config, ours[0], upstream[0])
    for name, param in upstream[1].items():
        assert torch.equal(ours[1][name], param), (config, name)
    if config in ("fp32", "accumulate"):
        # The in-place path ran: no gradient is a view of a packed buffer.
        assert all(ours[2]), (config, ours[2])
    else:
        # A cast or a divide packs, as upstream does.
        assert not any(ours[2]), (config, ours[2])


class _ConcatenatedParameters(nn.Module):
    """Two parameters used through one torch.cat with a row of the input:
    autograd hands each a gradient that is a view into one storage, which
    also holds the input row's gradient."""

    def __init__(self):
        super().__init__()
        self.top = nn.Parameter(torch.randn(4, 3))
        self.bottom = nn.Parameter(torch.randn(2, 3))

    def forward(self, x):
        return x @ torch.cat([self.top, self.bottom, x[:1]]).t()


def train_concatenated(ctx):
    torch.manual_seed(0)
    reference = nn.Sequential(_ConcatenatedParameters(), nn.Linear(7, 1))
    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        model = copy.deepcopy(reference)
        api.fully_shard(model[0], mesh=make_mesh(ctx, "default"))
        api.fully_shard(model, mesh=make_mesh(ctx, "default"))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        storage_bytes = []
        for step in range(2):
            x = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
            model(x.requires_grad_()).square().sum().backward()
            storage_bytes.append([p.grad._local_tensor.untyped_storage().nbytes()
                                  for p in (model[0].top, model[0].bottom)])
            optim.step()
            optim.zero_grad()
        out[impl] = ({n: p.full_tensor().detach() for n, p in model.named_parameters()},
                     storage_bytes)
    return out


def test_world_size_one_copies_gradients_that_are_views():
    """Gradients that are views into a larger storage (parameters used
    through torch.cat) are copied into shards of their own group's buffer, as
    upstream's are, not kept as views that hold autograd's whole buffer."""
    out = get_pool(1).run(train_concatenated)[0]
    for name, param in out["upstream"][0].items():
        assert torch.equal(out["ours"][0][name], param), name
    # The group's flat buffer: (4 + 2) rows of 3 float32 (the cat's
    # gradient has a seventh row, the input's).
    assert out["upstream"][1] == [[72, 72], [72, 72]], out["upstream"][1]
    assert out["ours"][1] == out["upstream"][1], out["ours"][1]


class _ViewOut(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return self.lin(x)[:, :2]  # a view of the linear's output


def warnings_of_view_outputs(ctx):
    """Per impl: the view-output warnings of a forward whose inner FSDP
    module returns a view, and whether backward then still works."""
    import warnings

    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        torch.manual_seed(0)
        model = nn.Sequential(_ViewOut(4), nn.Linear(2, 2))
        api.fully_shard(model[0], mesh=make_mesh(ctx, "default"))
        api.fully_shard(model, mesh=make_mesh(ctx, "default"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(torch.randn(3, 4)).sum().backward()
        out[impl] = [str(w.message) for w in caught
                     if issubclass(w.category, UserWarning) and "returned a view tensor" in str(w.message)]
    return out


def test_a_view_output_is_warned_about_as_upstream():
    """A module that returns a view: changing it in place would drop the
    pre-backward hook (Note [a view output loses its hook]), so ours warns,
    naming the module's class, once per such output and forward; upstream
    warns the same where its torch does (2.13 on)."""
    out = get_pool(1).run(warnings_of_view_outputs)[0]
    assert len(out["ours"]) == 1, out
    assert out["ours"][0].startswith("torch_fsdp_ext.fully_shard: the FSDP module (_ViewOut) "
                                     "returned a view tensor."), out
    if out["upstream"]:
        assert len(out["upstream"]) == len(out["ours"]), out


# --------------------------------------------------------------------------
# The forward hooks' C++ path and its hand-overs to Python


class _TupleOut(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        y = self.lin(x)
        return y, y.relu()


class _ListOutWithKwargs(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, gate, *, scale=1.0):
        return [self.lin(x + gate) * scale]


class _FlagArgument(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, negate):
        y = self.lin(x)
        return -y if negate else y


class _Signatures(nn.Module):
    """Blocks whose hooks take each path: plain tensors in, a tuple out (C++);
    a keyword argument, a list out (Python pre-hook, C++ post-hook); a
    non-tensor argument (Python pre-hook)."""

    def __init__(self, dim=8):
        super().__init__()
        self.tuple_out = _TupleOut(dim)
        self.list_out = _ListOutWithKwargs(dim)
        self.flag = _FlagArgument(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        a, b = self.tuple_out(x)
        (c,) = self.list_out(a, b, scale=0.5)
        y = self.flag(c, True)  # float32 under mixed precision (output_dtype)
        return self.head(y.to(self.head.weight.dtype)).float().sum()


def train_signatures(ctx, mixed_precision):
    out = {}
    torch.manual_seed(0)
    reference = _Signatures()
    for impl in IMPLS:
        api = fsdp_api(impl)
        model = copy.deepcopy(reference)
        kwargs = {}
        if mixed_precision:
            kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                          output_dtype=torch.float32)
        for block in (model.tuple_out, model.list_out, model.flag):
            api.fully_shard(block, **kwargs)
        api.fully_shard(model, **kwargs)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + ctx.rank))
            with torch.no_grad():  # a forward outside grad mode first
                losses.append(model(x).item())
            loss = model(x)
            loss.backward()
            losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        model.reshard()
        out[impl] = (losses, {n: p.full_tensor().detach() for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_forward_hooks_of_every_signature_match_upstream(mixed_precision):
    for rank_out in get_pool(2).run(train_signatures, mixed_precision):
        ours, upstream = rank_out["ours"], rank_out["upstream"]
        assert ours[0] == upstream[0], (ours[0], upstream[0])
        for name, param in upstream[1].items():
            assert torch.equal(ours[1][name], param), name
