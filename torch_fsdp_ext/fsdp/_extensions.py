"""All-gather extensions: a parameter whose local tensor defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (a tensor subclass, or
instance methods set on ``param._local_tensor`` after ``fully_shard``) decides
what is all-gathered for it and how the unsharded parameter is built from
the result, as upstream FSDP2 lets it.

This is the one place the per-step path calls the user's Python: the C++
group asks the parameter's ``AllGatherExtension`` for its all-gather inputs
(any number, any dtypes: the flat buffer is then bytes), hands it the
gathered outputs after the copy-out, and has it release their memory on
reshard. Everything else (copy-in, collective, copy-out, reduce-scatter)
stays the group's."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

import torch
import torch.nn as nn


_RELEASE_HOOK = "fsdp_should_release_all_gather_outputs_after_post_all_gather"


def has_extension(local_tensor: torch.Tensor) -> bool:
    """Whether the local tensor defines an all-gather extension; both hooks
    or neither, and the release hook only with them (upstream's
    AssertionErrors otherwise)."""
    pre = hasattr(local_tensor, "fsdp_pre_all_gather")
    post = hasattr(local_tensor, "fsdp_post_all_gather")
    if pre != post:
        raise AssertionError(
            "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined "
            f"if using all-gather extensions: {local_tensor}"
        )
    if hasattr(local_tensor, _RELEASE_HOOK) and not post:
        raise AssertionError(
            f"{_RELEASE_HOOK} requires fsdp_pre_all_gather and fsdp_post_all_gather to be "
            f"defined: {local_tensor}"
        )
    return pre


def _release_outputs_after_post(local_tensor: torch.Tensor) -> bool:
    """The extension's answer to whether the raw all-gather outputs may be
    freed as soon as its post hook has run (its unsharded tensors then do
    not alias them); False when it does not say (torch 2.15's hook)."""
    hook = getattr(local_tensor, _RELEASE_HOOK, None)
    if hook is None:
        return False
    answer = hook()
    if not isinstance(answer, bool):
        raise AssertionError(f"{_RELEASE_HOOK} must return a bool, got {type(answer)}")
    return answer


def _contiguous_stride(size) -> tuple:
    stride, running = [], 1
    for dim in reversed(list(size)):
        stride.append(running)
        running *= dim
    return tuple(reversed(stride))


def _resize_storage(tensor: torch.Tensor, nbytes: int) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


class AllGatherExtension:
    """One parameter's extension, with what passes from its pre- to its
    post-all-gather hook (metadata, the inputs' shapes) and the tensors whose
    memory an unshard allocates and a reshard frees (the all-gather outputs
    and the inner tensors the post hook returned)."""

    def __init__(self, fqn: str, sharded_param: nn.Parameter, shard_mesh, module: nn.Module,
                 mp_policy, orig_size, padded_sharded_size) -> None:
        self._fqn = fqn
        self._sharded_param = sharded_param
        self._shard_mesh = shard_mesh
        self._module = module
        self._mp_policy = mp_policy
        self._orig_size = torch.Size(orig_size)
        self._orig_stride = _contiguous_stride(orig_size)
        self._padded_size = torch.Size(padded_sharded_size)
        self._metadata: Any = None
        self._input_sizes: list = []
        self._outputs: list[torch.Tensor] = []
        self._inner_tensors: list[torch.Tensor] = []
        # Free the outputs right after the post hook rather than at reshard:
        # the gathered bytes' memory is not held while the parameter is
        # unsharded (the extension vouches that nothing views them).
        self._release_outputs_after_post = _release_outputs_after_post(
            sharded_param._local_tensor)

    def inputs(self) -> list[torch.Tensor]:
        """The pre-all-gather hook's inputs, flattened (upstream's arities:
        the shard mesh alone, or mesh, size, stride, module and policy)."""
        local = self._sharded_param._local_tensor
        pre = local.fsdp_pre_all_gather
        arity = len(inspect.signature(pre).parameters)
        if arity == 1:
            inputs, self._metadata = pre(self._shard_mesh)
        elif arity == 5:
            inputs, self._metadata = pre(self._shard_mesh, self._orig_size, self._orig_stride,
                                         self._module, self._mp_policy)
            if local.size() != self._padded_size and any(
                    t.size() != self._padded_size for t in inputs):
                raise AssertionError(
                    "When a parameter is unevenly sharded by FSDP (orig size="
                    f"{self._orig_size}, FSDP world size={self._shard_mesh.size()}), "
                    "fsdp_pre_all_gather must return all-gather inputs with the padded sharded "
                    f"size {self._padded_size} but got {[t.size() for t in inputs]}"
                )
        else:
            raise AssertionError(
                f"Invalid fsdp_pre_all_gather: {inspect.signature(pre)}\n"
                "Expects fsdp_pre_all_gather(self, mesh: DeviceMesh, "
                "outer_size: torch.Size, outer_stride: tuple[int, ...], "
                "module: nn.Module, mp_policy: MixedPrecisionPolicy)"
            )
        self._input_sizes = [t.size() for t in inputs]
        return [t.contiguous().view(-1) for t in inputs]

    def outputs(self, inputs: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
        """One flat output per input (world_size times its elements, its
        dtype), made at the first unshard and given memory again at each."""
        if not self._outputs:
            self._outputs = [torch.empty(t.numel() * world_size, dtype=t.dtype, device=t.device)
                             for t in inputs]
        else:
            for t in self._outputs:
                _resize_storage(t, t.numel() * t.element_size())
        return self._outputs

    @torch.no_grad()
    def unsharded(self, param_dtype: torch.dtype,
                  unsharded_param: Optional[nn.Parameter]) -> Optional[torch.Tensor]:
        """The post-all-gather hook on the gathered outputs: the first time,
        the unsharded tensor (viewed with the original size and contiguous
        strides); afterwards it fills ``unsharded_param`` (out=) and returns
        None."""
        post = self._sharded_param._local_tensor.fsdp_post_all_gather
        outputs = tuple(t.view(-1, *size[1:]) for t, size in zip(self._outputs, self._input_sizes))
        metadata, self._metadata, self._input_sizes = self._metadata, None, []
        if unsharded_param is not None:
            for t in self._inner_tensors:
                _resize_storage(t, t.numel() * t.element_size())
            post(outputs, metadata, param_dtype, out=unsharded_param)
            self._release_outputs_if_asked()
            return None
        tensor, inner = post(outputs, metadata, param_dtype)
        self._inner_tensors = list(inner)
        self._release_outputs_if_asked()
        return torch.as_strided(tensor, self._orig_size, self._orig_stride, storage_offset=0)

    def _release_outputs_if_asked(self) -> None:
        if self._release_outputs_after_post:
            for t in self._outputs:
                _resize_storage(t, 0)

    def release(self) -> None:
        """Reshard: the outputs' and inner tensors' memory is freed (the
        tensors stay, as the unsharded parameter views them)."""
        for t in self._outputs + self._inner_tensors:
            _resize_storage(t, 0)


def attach(groups, mp_policy) -> None:
    """At lazy init: each parameter whose local tensor defines the hooks gets
    its AllGatherExtension (and any other loses a stale one)."""
    for group in groups:
        for param in group.params:
            local = param.sharded_param._local_tensor
            if not has_extension(local):
                param.extension = None
                continue
            if group.uses_post_forward_mesh:
                # Refused for every extension, so also for one that frees its
                # outputs after the post hook (which upstream refuses alone).
                raise NotImplementedError(
                    f"torch_fsdp_ext.fully_shard: {param.fqn} has an all-gather extension; "
                    "reshard_after_forward as an int (a post-forward mesh) does not support "
                    "all-gather extensions, as upstream's")
            padded = _padded_shard_size(param)
            # The hook sees the parameter's own policy (param_dtype_override_fn's
            # answer in param_dtype), as upstream's.
            own_policy = mp_policy
            if param.param_dtype_override is not None:
                own_policy = dataclasses.replace(mp_policy,
                                                 param_dtype=param.param_dtype_override)
            # The hook sees the data-parallel shard mesh (HSDP: its shard
            # dim; a DTensor parameter: not its tensor-parallel dims).
            param.extension = AllGatherExtension(param.fqn, param.sharded_param,
                                                 param.shard_mesh,
                                                 param.owner_module, own_policy, param.orig_size,
                                                 padded)


def _padded_shard_size(param) -> tuple:
    """This rank's padded shard's shape: the original shape with the shard
    dim cut to the padded rows per rank (on dim d > 0 shards are even)."""
    from .. import _C

    size, dim = list(param.orig_size), param.shard_dim
    size[dim] = _C._fsdp_shard_extent(size[dim], param.shard_mesh.size(), 0)[0]
    return tuple(size)
