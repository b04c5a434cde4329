"""FSDP over parameters that are already DTensors (tensor or expert
parallelism): what differs from plain parameters, as upstream FSDP2 does it.

FSDP shards the parameter's local (TP) tensor across the data-parallel mesh,
so gathering it back yields the TP-local tensor, which becomes the unsharded
parameter wrapped as a DTensor with the parameter's original (TP) spec. The
sharded parameter is a DTensor on the data-parallel and TP meshes joined
(e.g. (Shard(0), Shard(0)) on a 2-D (dp, tp) mesh, with _StridedShard on the
data-parallel dim where TP already shards the same dim, so full_tensor()
reassembles the right order). Gradients arrive as TP DTensors; their local
tensors, in the parameter's TP placements, are what FSDP reduces."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard


def check_param(param: DTensor, fsdp_mesh: DeviceMesh, hsdp: bool) -> None:
    """What we cannot shard yet, refused at fully_shard."""
    placements = param.placements
    if len(placements) != 1:
        raise NotImplementedError(
            "torch_fsdp_ext.fully_shard: DTensor parameters on a mesh of "
            f"{len(placements)} dims (EP+TP) are not supported yet: {placements}"
        )
    if hsdp:
        raise NotImplementedError(
            "torch_fsdp_ext.fully_shard: DTensor (tensor-parallel) parameters with HSDP "
            "(a 2-D data-parallel mesh) are not supported yet; use a 1-D data-parallel mesh"
        )
    if param.device_mesh.device_type != fsdp_mesh.device_type:
        raise ValueError(
            "Requires DTensor to have mesh of the same type as the FSDP mesh but got "
            f"{param.device_mesh.device_type} for DTensor and {fsdp_mesh.device_type} for FSDP"
        )
    if not param._local_tensor.is_contiguous():
        raise NotImplementedError(
            "FSDP does not support non-contiguous parameters yet: "
            f"{param._local_tensor.shape=} {param._local_tensor.stride()=}"
        )


def sharded_spec(fsdp_mesh: DeviceMesh, placement: Shard, tp_spec: DTensorSpec) -> DTensorSpec:
    """The sharded parameter's spec: the data-parallel and TP meshes joined,
    FSDP's placement first (strided where TP splits the same dim)."""
    mesh = DeviceMesh._concatenate([fsdp_mesh, tp_spec.mesh])
    split_factor = tp_spec.num_shards_map[placement.dim]
    fsdp_placement = (
        _StridedShard(placement.dim, split_factor=split_factor) if split_factor > 1 else placement
    )
    return DTensorSpec(mesh, (fsdp_placement, *tp_spec.placements),
                       tensor_meta=tp_spec.tensor_meta)


def local_grad(grad: torch.Tensor, placements: tuple) -> torch.Tensor:
    """The unsharded gradient's local tensor in the parameter's TP placements
    (a Partial gradient, e.g. of a replicated norm weight, is reduced over
    the TP group first). Called by the C++ runtime for DTensor parameters."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(grad, AsyncCollectiveTensor):
        grad = grad.wait()
    if not isinstance(grad, DTensor):
        raise AssertionError(f"Expected a DTensor gradient, got {type(grad)}")
    if tuple(grad.placements) != tuple(placements):
        grad = grad.redistribute(placements=placements)
    local = grad._local_tensor
    if isinstance(local, AsyncCollectiveTensor):
        local = local.wait()
    return local


__all__ = ["check_param", "sharded_spec", "local_grad"]
