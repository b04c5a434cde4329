"""FSDP over parameters that are already DTensors (tensor or expert
parallelism, or every parameter on a full SPMD mesh with dp_mesh_dims): what
differs from plain parameters, as upstream FSDP2 does it.

FSDP shards the parameter's local (TP) tensor across the data-parallel mesh,
so gathering it back yields the TP-local tensor, which becomes the unsharded
parameter wrapped as a DTensor with the parameter's original (TP) spec. The
sharded parameter is a DTensor on the data-parallel and TP meshes joined
(e.g. (Shard(0), Shard(0)) on a 2-D (dp, tp) mesh, with _StridedShard on the
data-parallel dim where TP already shards the same dim, so full_tensor()
reassembles the right order). Gradients arrive as TP DTensors; their local
tensors, in the parameter's TP placements, are what FSDP reduces.

With dp_mesh_dims the parameters live on the full mesh, Replicate() on its
data-parallel dims; FSDP shards over those dims, so the sharded spec is the
same mesh with Shard (or _StridedShard) there, and gradients keep whatever
placement they have on the data-parallel dims (Partial: the reduce-scatter
sums it) while the other dims are brought to the parameter's placements."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard


def check_param(param: DTensor) -> None:
    """Upstream's limits: TP or EP (1-D) or EP+TP (2-D) parameter meshes.
    (A mesh of another device type was refused by _init.move_to_device.)"""
    placements = param.placements
    if len(placements) > 2:
        raise NotImplementedError(
            f"FSDP only supports 1D TP/EP or 2D EP+TP, not {placements}"
        )


def check_spmd_param(param, name: str, spmd_mesh: DeviceMesh, dims) -> None:
    """dp_mesh_dims: every parameter a DTensor on the full mesh, replicated
    over the data-parallel dims (upstream's errors)."""
    if not isinstance(param, DTensor):
        raise ValueError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD "
            f"mesh (e.g. via distribute_module). Got plain tensor for parameter '{name}'."
        )
    # Equal, not necessarily the same object: DTensor reuses cached specs,
    # whose mesh may be an earlier, equal DeviceMesh.
    if param.device_mesh != spmd_mesh:
        raise ValueError(
            "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got "
            f"{param.device_mesh} for '{name}' and {spmd_mesh}"
        )
    names = spmd_mesh.mesh_dim_names
    for kind, dim_names in (("shard", dims.shard_names), ("replicate", dims.replicate_names)):
        for dim_name in dim_names:
            index = names.index(dim_name)
            if not isinstance(param.placements[index], Replicate):
                raise ValueError(
                    f"Expected Replicate() on DP {kind} dim '{dim_name}' (index {index}) "
                    f"but got {param.placements[index]}"
                )


def dp_dim_indices(spmd_mesh: DeviceMesh, dims) -> tuple:
    names = spmd_mesh.mesh_dim_names
    return tuple(sorted(names.index(n) for n in (*dims.shard_names, *dims.replicate_names)))


def may_reduce_grad_outside_dp(spec: DTensorSpec, dp_dims: tuple) -> bool:
    """Whether the parameter's gradient may be reduced over a mesh dim outside
    data parallelism before FSDP reduces it: a Replicate placement there (a
    SequenceParallel norm's weight) can come back Partial, and local_grad's
    redistribution then all-reduces it in the gradient's dtype. Such a
    parameter takes its gradients in the wider reduce dtype from autograd
    (Note [a wider gradient dtype], csrc/fsdp/fsdp_param.cpp)."""
    return any(isinstance(placement, Replicate)
               for i, placement in enumerate(spec.placements) if i not in dp_dims)


def spmd_sharded_spec(info, placement: Shard, spec: DTensorSpec) -> DTensorSpec:
    """dp_mesh_dims: the parameter's placements with FSDP's on the shard
    dims, strided by the sharding of the same tensor dim on later mesh dims;
    several shard dims are joined into the flattened data-parallel dim."""
    mesh = spec.mesh
    names = mesh.mesh_dim_names
    shard_names = info.dp_mesh_dims.shard_names
    placements = list(spec.placements)
    for name in shard_names:
        index = names.index(name)
        split_factor = 1
        for later in range(index + 1, mesh.ndim):
            p = spec.placements[later]
            if isinstance(p, (Shard, _StridedShard)) and p.dim == placement.dim:
                split_factor *= mesh.size(later)
        placements[index] = (_StridedShard(placement.dim, split_factor=split_factor)
                             if split_factor > 1 else placement)
    if len(shard_names) <= 1:  # none: DDP, the parameter's own placements
        return DTensorSpec(mesh, tuple(placements), tensor_meta=spec.tensor_meta)
    # Several shard dims: one flattened data-parallel dim where they were
    # (with HSDP's replicate dim just before it), the other dims as they are.
    submeshes, spec_placements, done = [], [], False
    hsdp = info.replicate_dim is not None
    for index, name in enumerate(names):
        if name in shard_names:
            if not done:
                submeshes.append(info.mesh)
                if hsdp:
                    spec_placements.append(Replicate())
                spec_placements.append(placements[index])
                done = True
        elif hsdp and name in info.dp_mesh_dims.replicate_names:
            continue
        else:
            submeshes.append(mesh[name])
            spec_placements.append(placements[index])
    return DTensorSpec(DeviceMesh._concatenate(submeshes), tuple(spec_placements),
                       tensor_meta=spec.tensor_meta)


def sharded_spec(fsdp_mesh: DeviceMesh, hsdp: bool, placement: Shard,
                 tp_spec: DTensorSpec) -> DTensorSpec:
    """The sharded parameter's spec: the data-parallel mesh (1-D, or HSDP's
    (replicate, shard)) and the TP/EP mesh joined, FSDP's placement before
    the parameter's own (strided where those split the same dim)."""
    mesh = DeviceMesh._concatenate([fsdp_mesh, tp_spec.mesh])
    split_factor = tp_spec.num_shards_map[placement.dim]
    fsdp_placement = (
        _StridedShard(placement.dim, split_factor=split_factor) if split_factor > 1 else placement
    )
    placements = (fsdp_placement, *tp_spec.placements)
    if hsdp:
        placements = (Replicate(),) + placements
    return DTensorSpec(mesh, placements, tensor_meta=tp_spec.tensor_meta)


def local_grad(grad: torch.Tensor, placements: tuple, dp_dims: tuple = ()) -> torch.Tensor:
    """The unsharded gradient's local tensor in the parameter's TP placements
    (a Partial gradient, e.g. of a replicated norm weight, is reduced over
    the TP group first); on the data-parallel dims of a full SPMD mesh
    (`dp_dims`) the gradient's own placements stay. Called by the C++
    runtime for DTensor parameters."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(grad, AsyncCollectiveTensor):
        grad = grad.wait()
    if not isinstance(grad, DTensor):
        raise AssertionError(f"Expected a DTensor gradient, got {type(grad)}")
    target = tuple(grad.placements[i] if i in dp_dims else p for i, p in enumerate(placements))
    if tuple(grad.placements) != target:
        grad = grad.redistribute(placements=target)
    local = grad._local_tensor
    if isinstance(local, AsyncCollectiveTensor):
        local = local.wait()
    return local


__all__ = ["check_param", "check_spmd_param", "dp_dim_indices", "local_grad", "sharded_spec",
           "spmd_sharded_spec"]
