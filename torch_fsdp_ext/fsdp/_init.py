"""What fully_shard does once, at wrap time: pick and check the mesh, collect
the modules and parameters it manages, shard each parameter into a DTensor,
and build the C++ parameter group. Nothing here runs per training step."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .. import _C, _compat
from . import _tensor_parallel


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default process group on the current accelerator."""
    if not dist.is_initialized():
        dist.init_process_group()
    device_type = torch._C._get_accelerator().type
    return init_device_mesh(device_type, (dist.get_world_size(),))


class MeshInfo(NamedTuple):
    """Which mesh dims shard and replicate: a 1-D mesh shards on its only dim
    (FSDP); a 2-D mesh replicates on dim 0 and shards on dim 1 (HSDP).

    With ``dp_mesh_dims`` the user's mesh is the full SPMD mesh on which every
    parameter is already a DTensor; ``mesh`` is then its data-parallel part
    (the named dims, flattened where several) and ``spmd_mesh`` the full one."""

    mesh: DeviceMesh
    shard_dim: Optional[int]  # None: DDP through dp_mesh_dims (one shard rank)
    replicate_dim: Optional[int]
    spmd_mesh: Optional[DeviceMesh] = None
    dp_mesh_dims: Any = None

    @property
    def shard_size(self) -> int:
        return 1 if self.shard_dim is None else self.mesh.size(self.shard_dim)

    @property
    def shard_rank(self) -> int:
        return 0 if self.shard_dim is None else self.mesh.get_local_rank(self.shard_dim)

    @property
    def shard_group(self):
        return None if self.shard_dim is None else self.mesh.get_group(self.shard_dim)

    @property
    def replicate_group(self):
        return None if self.replicate_dim is None else self.mesh.get_group(self.replicate_dim)

    def placements(self, shard: Shard) -> tuple:
        return (shard,) if self.replicate_dim is None else (Replicate(), shard)


# Mesh device types the runtime runs on: the host, and CUDA (side streams
# and device copy kernels; csrc/fsdp/fsdp_streams.hpp).
_SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def mesh_info(mesh: DeviceMesh, dp_mesh_dims=None) -> MeshInfo:
    """Checks ``mesh`` as upstream does and says how it is used."""
    if mesh.device_type not in _SUPPORTED_DEVICE_TYPES:
        raise NotImplementedError(
            f"torch_fsdp_ext.fully_shard: {mesh.device_type} meshes are not supported yet "
            f"(supported: {', '.join(_SUPPORTED_DEVICE_TYPES)})"
        )
    if dp_mesh_dims is not None:
        if _compat.DataParallelMeshDims is None:
            raise NotImplementedError(
                "torch_fsdp_ext.fully_shard: "
                + _compat.needs_newer_torch("dp_mesh_dims (DataParallelMeshDims)", (2, 12)))
        return _spmd_mesh_info(mesh, dp_mesh_dims)
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
    if mesh.ndim == 1:
        return MeshInfo(mesh, shard_dim=0, replicate_dim=None)
    return MeshInfo(mesh, shard_dim=1, replicate_dim=0)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """Where fully_shard puts the parameters, as upstream: the host, or the
    mesh's device type at the current device index."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    handle = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, handle.current_device())


def check_device_backends(info: MeshInfo, device: torch.device, module) -> None:
    """A device mesh needs process groups that can carry that device's
    tensors (nccl, fsdp_ext, or a per-device backend string naming one):
    refused here, naming the module and the group, instead of failing in the
    first all-gather."""
    if device.type == "cpu":
        return
    for role, group in (("shard", info.shard_group), ("replicate", info.replicate_group)):
        if group is None:
            continue
        try:
            group._get_backend(device)
        except RuntimeError as error:
            raise ValueError(
                f"torch_fsdp_ext.fully_shard({type(module).__name__}): the mesh is on "
                f"{device.type}, but its {role} process group "
                f"({dist.get_backend(group)!r}, group {getattr(group, 'group_name', '?')}) "
                f"has no backend for {device.type} tensors ({error}). Initialise it with a "
                f"backend that carries them: 'nccl', 'fsdp_ext', or e.g. 'cpu:gloo,cuda:nccl'."
            ) from None


def check_params_on_device(groups, device: torch.device, module_name: str) -> None:
    """At lazy init (parameters may have been materialised or moved since
    fully_shard): every sharded parameter on the mesh's device, else a clear
    error naming each one and where it is."""
    stray = [(p.fqn, str(p.sharded_param.device)) for g in groups for p in g.params
             if p.sharded_param.device != device]
    if stray:
        raise ValueError(
            f"torch_fsdp_ext.fully_shard({module_name}): the mesh is on {device}, but these "
            f"parameters are elsewhere: {stray}. Keep every parameter of a fully_shard "
            f"module on the mesh's device (e.g. module.to_empty(device={str(device)!r}))."
        )


def _spmd_mesh_info(mesh: DeviceMesh, dims) -> MeshInfo:
    """dp_mesh_dims: the named dims of the full mesh FSDP shards over (and
    replicates over, HSDP), checked with upstream's errors."""
    if dims.shard is None and dims.replicate is None:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    if mesh.mesh_dim_names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in mesh.mesh_dim_names:
            raise ValueError(
                f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}"
            )
    def submesh(names):
        # Several dims are flattened into one, as upstream does.
        return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))

    if not dims.shard_names:
        # DDP: nothing sharded (no shard dim: one shard rank, no all-gather
        # or reduce-scatter), gradients all-reduced across the replicas.
        return MeshInfo(submesh(dims.replicate_names), None, 0, spmd_mesh=mesh,
                        dp_mesh_dims=dims)
    shard_mesh = submesh(dims.shard_names)
    if not dims.replicate_names:
        return MeshInfo(shard_mesh, 0, None, spmd_mesh=mesh, dp_mesh_dims=dims)
    dp_mesh = DeviceMesh._concatenate([submesh(dims.replicate_names), shard_mesh])
    return MeshInfo(dp_mesh, 1, 0, spmd_mesh=mesh, dp_mesh_dims=dims)


def validate_module(module) -> None:
    modules = [module] if isinstance(module, nn.Module) else list(module)
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward in (
            nn.ModuleList.forward,
            nn.ModuleDict.forward,
        ):
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: {m}"
            )


def pin_offloaded(offload_policy) -> bool:
    """Whether sharded parameters are kept in pinned host memory.

    CPUOffloadPolicy keeps sharded parameters, their gradients and so the
    optimizer step on the host. On a CPU mesh they are there already, so the
    only effect left is pinning (``pin_memory=True``, the default), which, as
    upstream's, needs an accelerator: without one ``Tensor.pin_memory`` raises
    at fully_shard."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory


def validate_offloaded_on_cpu(group) -> None:
    """Upstream's check at lazy init: offloaded parameters must have been
    materialised on the host (to_empty(device="cpu"), a CPU state dict)."""
    off_cpu = [(p.fqn, p.sharded_param.device) for p in group.params
               if p.sharded_param.device.type != "cpu"]
    if off_cpu:
        raise RuntimeError(
            "FSDP parameters should be materialized on CPU when enabling CPU offloading. "
            'For example, load a CPU state dict or call module.to_empty(device="cpu"). '
            f"Found following parameters on non-CPU device: {off_cpu}\n"
        )


def post_forward_setting(reshard_after_forward, info: MeshInfo):
    """(reshard after forward?, the smaller mesh to reshard to or None)."""
    if info.shard_dim is None:
        return False, None  # DDP: nothing is sharded, nothing to reshard
    world = info.shard_size
    value = reshard_after_forward
    if not isinstance(value, (bool, int)):
        raise ValueError(
            "reshard_after_forward should be a bool or an int representing the "
            f"group size to reshard to, not {value}"
        )
    if not isinstance(value, bool):
        if info.spmd_mesh is not None:
            raise NotImplementedError(
                "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)"
            )
        if value < 1 or value > world or world % value != 0:
            raise ValueError(
                "If passing reshard_after_forward as an int, it should be a "
                f"factor of {world}, not {value}"
            )
        if value == 1:
            import warnings

            warnings.warn(
                "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
                "instead of reshard_after_forward=True (bool)",
                stacklevel=3,
            )
            return False, None
        if value == world:
            return True, None
        # Groups of `value` consecutive ranks: a 2-D mesh whose dim 1 shards
        # (HSDP's replicas are flattened into dim 0).
        return True, DeviceMesh(info.mesh.device_type, info.mesh.mesh.view(-1, value))
    return value, None


def managed_modules(root_modules, ignored_params, get_state) -> list[nn.Module]:
    """Post-order modules under the roots, not descending into modules that
    have their own fully_shard, each module once."""
    roots = set(root_modules)
    visited: set = set()
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if module not in roots and get_state(module) is not None:
            return
        visited.add(module)
        for child in module.children():
            if child not in visited:
                visit(child)
        out.append(module)

    for root in root_modules:
        visit(root)
    if ignored_params:
        # A module whose parameters are all ignored and that has no buffers
        # is not managed.
        def all_ignored(m: nn.Module) -> bool:
            params = list(m.parameters(recurse=True))
            return bool(params) and all(p in ignored_params for p in params) and not list(m.buffers())

        out = [m for m in out if not all_ignored(m)]
    return out


def managed_states(modules, ignored_params):
    params, buffers, seen = [], [], set()
    ignored = ignored_params or set()
    for module in modules:
        for name, param in module.named_parameters(recurse=False):
            if param in ignored or param in seen:
                continue
            if param.dim() == 0:
                raise ValueError(
                    "fully_shard doesn't support scalar parameters. "
                    f"Change {name} to a 1D tensor with numel equal to 1."
                )
            seen.add(param)
            params.append(param)
        for buffer in module.buffers(recurse=False):
            if buffer not in seen:
                seen.add(buffer)
                buffers.append(buffer)
    return params, buffers


def validate_params(params, names, info: MeshInfo, post_forward_mesh) -> None:
    """What fully_shard cannot shard, refused before the state and hooks exist.
    `names`: each parameter's attribute name, for messages."""
    for param, name in zip(params, names):
        if info.spmd_mesh is not None:
            _tensor_parallel.check_spmd_param(param, name, info.spmd_mesh, info.dp_mesh_dims)
        elif isinstance(param, DTensor):
            _tensor_parallel.check_param(param)
            if post_forward_mesh is not None:
                raise NotImplementedError(
                    "torch_fsdp_ext.fully_shard: reshard_after_forward=int with DTensor "
                    "(tensor-parallel) parameters is not supported yet"
                )
        # What FSDP shards: a DTensor's local tensor, else the parameter.
        data = param._local_tensor if isinstance(param, DTensor) else param
        if not data.is_contiguous():
            raise NotImplementedError(
                "FSDP does not support non-contiguous parameters yet: "
                f"param.shape={data.shape} param.stride()={data.stride()}"
            )


def param_dtype_overrides(mp_policy, params, names, module_name: str) -> list:
    """torch 2.15's MixedPrecisionPolicy.param_dtype_override_fn, asked once
    per parameter as fully_shard applies (as upstream asks it): each
    parameter's own param_dtype, or None for the policy's. Its answer must be
    None, the policy's param_dtype or the parameter's own dtype (ValueError
    otherwise, naming the parameter)."""
    override_fn = getattr(mp_policy, "param_dtype_override_fn", None)
    if override_fn is None:
        return [None] * len(params)
    where = f"torch_fsdp_ext.fully_shard({module_name})"
    overrides = []
    for param, name in zip(params, names):
        dtype = override_fn(param)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(
                f"{where}: param_dtype_override_fn must return a torch.dtype or None; for "
                f"{name} it returned {type(dtype).__name__} {dtype!r}")
        if dtype is not None and dtype not in (mp_policy.param_dtype, param.dtype):
            raise ValueError(
                f"{where}: param_dtype_override_fn must return None, the policy's param_dtype "
                f"({mp_policy.param_dtype}) or the parameter's own dtype ({param.dtype}); "
                f"for {name} it returned {dtype}")
        overrides.append(dtype)
    return overrides


def policy_for_state(mp_policy):
    """The policy the state keeps (input and output casts, all-gather
    extensions): the per-parameter override is answered already, and inputs
    are cast to the policy's param_dtype, as upstream's."""
    if getattr(mp_policy, "param_dtype_override_fn", None) is None:
        return mp_policy
    return dataclasses.replace(mp_policy, param_dtype_override_fn=None)


def move_to_device(params, buffers, device: torch.device) -> None:
    for tensor in list(params) + list(buffers):
        if tensor.device == device or tensor.device.type == "meta":
            continue
        if isinstance(tensor, DTensor):
            raise ValueError(
                "Requires DTensor to have mesh of the same type as the FSDP mesh "
                f"but got {tensor.device_mesh.device_type} for DTensor and {device.type} for FSDP"
            )
        tensor.data = tensor.to(device)


def module_slots(params, modules):
    """For each parameter, every (module, attribute name) holding it."""
    wanted = {id(p): [] for p in params}
    seen_modules = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen_modules:
                continue
            seen_modules.add(id(module))
            plain = type(module).__setattr__ is nn.Module.__setattr__
            for name, param in module._parameters.items():
                if param is not None and id(param) in wanted:
                    wanted[id(param)].append((module, name, plain))
    return [wanted[id(p)] for p in params]


_orig_param_uids = itertools.count()


def orig_param_uid(param: nn.Parameter) -> int:
    """A number that names the original (unsharded) parameter object, kept on
    it: a tensor tied between two fully_shard calls is found by it at lazy
    init (the sharded parameters of the two calls are distinct objects)."""
    if not hasattr(param, "_fsdp_ext_orig_uid"):
        param._fsdp_ext_orig_uid = next(_orig_param_uids)
    return param._fsdp_ext_orig_uid


def resolve_placement(shard_placement_fn, param: nn.Parameter, info: MeshInfo,
                      per_param_infos: dict):
    """(Shard placement, MeshInfo) that `shard_placement_fn` picks for
    `param`: None is Shard(0) on fully_shard's mesh, a Shard is that dim on
    it, a ShardPlacementResult names its own mesh (e.g. experts sharded over
    an expert-parallel mesh). Checked with upstream's rules and errors.
    `per_param_infos`: one fully_shard call's MeshInfos made so far, by the
    id of the upstream mesh info they were made from."""
    result = shard_placement_fn(param) if shard_placement_fn is not None else None
    param_info = info
    per_param_mesh = _compat.ShardPlacementResult
    if per_param_mesh is not None and isinstance(result, per_param_mesh):
        param_info = _per_param_mesh_info(result.mesh_info, info, per_param_infos)
        result = result.placement
    if result is None:
        return Shard(0), param_info
    if not isinstance(result, Shard):
        if per_param_mesh is None:
            why = _compat.needs_newer_torch("a mesh per parameter (ShardPlacementResult)", (2, 12))
            raise ValueError(
                f"Invalid shard_placement_fn result: {result} (expected a Shard or None; {why})")
        raise ValueError(f"Invalid shard_placement_fn result: {result}")
    dim = result.dim + param.ndim if result.dim < 0 else result.dim
    if dim >= param.ndim:
        raise AssertionError(f"Shard dim {dim} is invalid for {param.ndim}D tensor: {param.shape}")
    # What FSDP shards: a DTensor's local tensor, else the parameter.
    data = param._local_tensor if isinstance(param, DTensor) else param
    if dim > 0 and data.shape[dim] % param_info.shard_size != 0:
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: {data.size()} "
            f"(world size: {param_info.shard_size})"
        )
    return Shard(dim), param_info


def _per_param_mesh_info(upstream_info, info: MeshInfo, per_param_infos) -> MeshInfo:
    """The MeshInfo for an upstream FSDPMeshInfo: parameters naming one
    upstream object share one MeshInfo object, which is how group_by_mesh
    recognises them (each entry holds the upstream object too, so that its
    id is not reused during the call)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    if not isinstance(upstream_info, FSDPMeshInfo):
        raise ValueError(
            "Per-param mesh via shard_placement_fn requires an FSDPMeshInfo (or HSDPMeshInfo), "
            f"got {type(upstream_info).__name__}"
        )
    if info.spmd_mesh is not None and upstream_info.dp_mesh_dims is None:
        raise NotImplementedError(
            "torch_fsdp_ext.fully_shard: with dp_mesh_dims, a per-parameter mesh "
            "(ShardPlacementResult) must carry dp_mesh_dims too (an FSDPMeshInfo of the "
            f"parameter's SPMD mesh); got {upstream_info}"
        )
    entry = per_param_infos.get(id(upstream_info))
    if entry is None or entry[0] is not upstream_info:
        mesh = upstream_info.mesh
        if mesh.device_type != info.mesh.device_type:
            raise ValueError(
                f"shard_placement_fn: the mesh of {upstream_info} is on {mesh.device_type}, "
                f"fully_shard's on {info.mesh.device_type}"
            )
        replicate_dim = (upstream_info.replicate_mesh_dim
                         if isinstance(upstream_info, HSDPMeshInfo) else None)
        # The layouts MeshInfo.placements() describes: (Shard,) on a 1-D mesh,
        # (Replicate(), Shard) on a 2-D one.
        layout = (mesh.ndim, upstream_info.shard_mesh_dim, replicate_dim)
        if layout not in ((1, 0, None), (2, 1, 0)):
            raise NotImplementedError(
                "torch_fsdp_ext.fully_shard: a per-parameter mesh must be 1-D and sharded on "
                "dim 0 (FSDPMeshInfo) or 2-D with replicate dim 0 and shard dim 1 "
                f"(HSDPMeshInfo); got {upstream_info}"
            )
        # With dp_mesh_dims (an SPMD mesh: the parameters are DTensors on the
        # full mesh), `mesh` is its data-parallel submesh, as fully_shard's.
        entry = (upstream_info, MeshInfo(mesh, upstream_info.shard_mesh_dim, replicate_dim,
                                         spmd_mesh=upstream_info.spmd_mesh,
                                         dp_mesh_dims=upstream_info.dp_mesh_dims))
        per_param_infos[id(upstream_info)] = entry
    return entry[1]


def group_by_mesh(placements, info: MeshInfo):
    """[(MeshInfo, indices of its parameters)], one entry per (shard group,
    replicate group) in the order their first parameter comes: each becomes
    one C++ parameter group, with its own all-gather and reduce-scatter."""
    groups: dict = {}
    for i, (_, param_info) in enumerate(placements):
        key = (param_info.shard_group, param_info.replicate_group)
        if key not in groups:
            groups[key] = (param_info, [i])
            continue
        if groups[key][0] is not param_info:
            raise ValueError(
                "Params sharing the same process group must use the same FSDPMeshInfo object, "
                f"but got different objects: {groups[key][0]} vs {param_info}"
            )
        groups[key][1].append(i)
    return list(groups.values())


def shard_param(param: nn.Parameter, info: MeshInfo, placement: Shard, fqn: str, slots,
                pin_memory: bool = False):
    """Shards `param` across the shard mesh dim as upstream does. On dim 0
    every rank holds ceil(d0 / W) rows (zero padding at the tail) and the
    DTensor's local tensor is the real rows, a view of the padded buffer the
    all-gather reads; on another dim (resolve_placement checked that it
    divides evenly) each rank holds its chunk along that dim, made contiguous. Under HSDP the DTensor
    is (Replicate(), Shard(d)) on the 2-D mesh."""
    world = info.shard_size
    rank = info.shard_rank
    dim = placement.dim
    # A DTensor (tensor-parallel) parameter: FSDP shards its local tensor.
    tp_spec = param._spec if isinstance(param, DTensor) else None
    data = param._local_tensor if tp_spec is not None else param
    chunk, _, length = _C._fsdp_shard_extent(data.shape[dim], world, rank)
    padded_size = list(data.shape)
    padded_size[dim] = chunk
    with torch.no_grad():
        # new_zeros and copy_ keep a tensor subclass's class (quantised
        # weights), as upstream's (Note [tensor subclass parameters]).
        padded = data.new_zeros(padded_size)
        if length and data.device.type != "meta":
            # The rank's rows through torch.chunk (aten.split), as upstream
            # takes them: NF4 weights split, but refuse a slice not at 0.
            rows = torch.chunk(data, world, dim)[rank]
            padded.narrow(dim, 0, length).copy_(rows)
        if pin_memory and data.device.type != "meta":
            padded = padded.pin_memory()
    if tp_spec is None:
        spec = DTensorSpec(
            info.mesh, info.placements(placement),
            tensor_meta=TensorMeta(param.shape, param.stride(), param.dtype),
        )
    elif info.spmd_mesh is not None:
        spec = _tensor_parallel.spmd_sharded_spec(info, placement, tp_spec)
    else:
        spec = _tensor_parallel.sharded_spec(info.mesh, info.replicate_dim is not None,
                                             placement, tp_spec)
    local = padded.narrow(dim, 0, length)
    sharded = nn.Parameter(
        DTensor(local, spec, requires_grad=False), requires_grad=param.requires_grad
    )
    if getattr(param, "_has_grad_dtype_override", False):
        # torch 2.15's grad_dtype policy stays with the parameter (the C++
        # FsdpParam reads it from the sharded one).
        sharded.grad_dtype = param.grad_dtype
    fsdp_param = _C.FsdpParam(
        fqn, slots, sharded, padded.view(-1), list(data.shape), list(local.shape), world, dim
    )
    fsdp_param.pin_memory = pin_memory
    fsdp_param.shard_mesh = (info.mesh if info.mesh.ndim == 1
                             else info.mesh[info.mesh.mesh_dim_names[-1]])
    if tp_spec is not None:
        fsdp_param.unsharded_spec = tp_spec
        if info.spmd_mesh is not None:
            fsdp_param.grad_dp_dims = _tensor_parallel.dp_dim_indices(tp_spec.mesh,
                                                                      info.dp_mesh_dims)
        fsdp_param.reduces_grad_outside_dp = _tensor_parallel.may_reduce_grad_outside_dp(
            tp_spec, fsdp_param.grad_dp_dims)
    return fsdp_param


def post_forward_specs(params, post_forward_mesh: DeviceMesh):
    """DTensorSpecs of the parameters kept after forward on the smaller mesh."""
    return [
        DTensorSpec(
            post_forward_mesh,
            (Replicate(), Shard(0)),
            tensor_meta=p.sharded_param._spec.tensor_meta,
        )
        for p in params
    ]
