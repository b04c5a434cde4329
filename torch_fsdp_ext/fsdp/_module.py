"""fully_shard and FSDPModule: the public API, as torch.distributed.fsdp's."""

from __future__ import annotations

import copyreg
import functools
import sys
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import contract
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as UpstreamFSDPModule
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, UnshardHandle
from torch.distributed.utils import _get_root_modules

from .. import _C, _compat
from . import _init
from ._state import FSDPState, _disabled_method, get_fsdp_state
from ._trace import TrainingState

_cls_to_fsdp_cls: dict[type, type] = {}
# The other way: the class each FSDP<Orig> was made for.
_fsdp_cls_to_cls: dict[type, type] = {}


@contract(state_cls=FSDPState)
def fully_shard(
    module,
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Union[bool, int, None] = None,
    shard_placement_fn: Optional[Callable] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[set] = None,
    dp_mesh_dims=None,
):
    """Shards ``module``'s parameters across ``mesh`` (FSDP2). Same signature
    and semantics as ``torch.distributed.fsdp.fully_shard``; the parameter
    group state machines and copy loops run in C++. Returns ``module`` (its
    class swapped to ``FSDP<Class>``)."""
    torch._C._log_api_usage_once("torch_fsdp_ext.fully_shard")
    _init.validate_module(module)
    mesh = mesh or _init.default_mesh()
    info = _init.mesh_info(mesh, dp_mesh_dims)
    roots = (module,) if isinstance(module, nn.Module) else tuple(_get_root_modules(list(module)))
    auto_reshard = reshard_after_forward is None
    # None: True until lazy init finds the root, which keeps its parameters.
    reshard_setting = True if auto_reshard else reshard_after_forward
    reshard, post_forward_mesh = _init.post_forward_setting(reshard_setting, info)
    device = _init.mesh_device(mesh)
    if device.type != "cpu" and isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError(
            f"torch_fsdp_ext.fully_shard({type(roots[0]).__name__}): "
            f"CPUOffloadPolicy on a {device.type} mesh is not supported yet (parameters on the "
            "host, gathered to the device each step); use upstream's fully_shard for it")
    _init.check_device_backends(info, device, roots[0])
    managed = _init.managed_modules(roots, ignored_params, get_fsdp_state)
    params, buffers = _init.managed_states(managed, ignored_params)
    slots = _init.module_slots(params, roots)
    names = [s[0][1] for s in slots]
    # "Linear.weight": how FsdpParams and messages name a parameter.
    labels = [f"{type(slot[0][0]).__name__}.{name}" for slot, name in zip(slots, names)]
    dtype_overrides = _init.param_dtype_overrides(mp_policy, params, labels,
                                                  type(roots[0]).__name__)
    _init.move_to_device(params, buffers, device)
    # Every parameter's placement and mesh, then one plan per process group
    # (several when shard_placement_fn returns ShardPlacementResults), each
    # checked before the state and hooks exist.
    per_param_infos: dict = {}
    placements = [_init.resolve_placement(shard_placement_fn, p, info, per_param_infos)
                  for p in params]
    plans = []
    for group_info, members in _init.group_by_mesh(placements, info):
        if group_info is info:
            group_reshard = (reshard, post_forward_mesh)
        else:
            group_reshard = _init.post_forward_setting(reshard_setting, group_info)
        _init.validate_params([params[i] for i in members], [names[i] for i in members],
                              group_info, group_reshard[1])
        plans.append((group_info, members, group_reshard))

    state = fully_shard.state(roots[0])
    state.init(roots, _init.policy_for_state(mp_policy), offload_policy, auto_reshard, device)
    _expose_state_to_upstream_accessor(roots, state)
    pin_memory = _init.pin_offloaded(offload_policy)
    for group_info, members, (group_reshard, group_post_forward_mesh) in plans:
        fsdp_params = [
            _init.shard_param(params[i], group_info, placements[i][0], labels[i], slots[i],
                              pin_memory=pin_memory)
            for i in members
        ]
        for i, fsdp_param in zip(members, fsdp_params):
            fsdp_param.param_dtype_override = dtype_overrides[i]
        group = _C.FsdpParamGroup(fsdp_params, group_info.shard_group,
                                  group_info.replicate_group)
        if group_post_forward_mesh is not None:
            group.set_reshard_after_forward(
                True, group_post_forward_mesh.get_group(1),
                _init.post_forward_specs(fsdp_params, group_post_forward_mesh),
            )
        else:
            group.set_reshard_after_forward(group_reshard)
        state._fsdp_param_groups.append(group)
        state._orig_param_uids += [_init.orig_param_uid(params[i]) for i in members]
    # The hooks' C++ half runs the same groups (csrc/fsdp/fsdp_state.hpp).
    state._hooks.groups = state._fsdp_param_groups
    if state._fsdp_param_groups:
        _register_state_dict_hooks(state, slots)
    for m in managed:
        m._is_fsdp_managed_module = True
        m._fsdp_use_orig_params = True
    for m in roots:
        m.__class__ = _fsdp_class_of(m.__class__)
    return module


def _fsdp_class_of(cls: type) -> type:
    """``FSDP<cls>``, made once per class (dynamo guards on the class)."""
    fsdp_cls = _cls_to_fsdp_cls.get(cls)
    if fsdp_cls is None:
        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls),
                        {"__deepcopy__": _unsupported_deepcopy})
        _cls_to_fsdp_cls[cls] = fsdp_cls
        _fsdp_cls_to_cls[fsdp_cls] = cls
    return fsdp_cls


def _new_fsdp_module(orig_cls: type, *args):
    """Unpickling a sharded module (Note [pickling our sharded modules]):
    ``FSDP<orig_cls>.__new__``, which is upstream's and, as for upstream's
    modules, builds an ``orig_cls``."""
    fsdp_cls = _fsdp_class_of(orig_cls)
    return fsdp_cls.__new__(fsdp_cls, *args)


def _expose_state_to_upstream_accessor(roots, state: FSDPState) -> None:
    """Our modules are upstream FSDPModules, so torch code that holds one asks
    upstream's ``fully_shard.state(module)`` for its state (pipelining's
    REDUCE_GRAD action: ``_state_ctx.all_states``, each group's
    ``post_backward``, ``_root_post_backward_final_callback``, all of which
    ours has). That accessor reads a per-module dict keyed by upstream's
    undecorated function: our state is entered there too, beside ours."""
    from torch.distributed._composable.contract import STATE_KEY
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as upstream

    for module in roots:
        module.__dict__.setdefault(STATE_KEY, {})[upstream.__wrapped__] = state


def _unsupported_deepcopy(*args, **kwargs):
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")


def _register_state_dict_hooks(state: FSDPState, slots) -> None:
    """state_dict() and load_state_dict() always see the sharded DTensors;
    load_state_dict(assign=True) swaps parameter objects, which the groups
    re-read afterwards."""
    groups = list(state._fsdp_param_groups)
    owners = {id(s[0][0]): s[0][0] for s in slots}

    def to_sharded(*args, **kwargs):
        for group in groups:
            group.to_sharded()

    def reread(*args, **kwargs):
        with torch.no_grad():
            for group in groups:
                group.reset_sharded_params()

    for module in owners.values():
        module.register_state_dict_pre_hook(to_sharded)
        module._register_load_state_dict_pre_hook(to_sharded)
        module.register_load_state_dict_post_hook(reread)


def _fsdp_modules(module: nn.Module, recurse: bool):
    modules = module.modules() if recurse else [module]
    return [m for m in modules if isinstance(m, FSDPModule)]


def _set_group_option(module: nn.Module, name: str, value, recurse: bool) -> None:
    """Sets a C++ group knob on ``module``'s groups (and its FSDP submodules')."""
    for m in _fsdp_modules(module, recurse):
        for group in m._groups():
            setattr(group, name, value)


class FSDPModule(UpstreamFSDPModule):
    """Mixed into every module fully_shard was applied to (class swap).

    A subclass of upstream's ``torch.distributed.fsdp.FSDPModule``, so the
    checks frameworks make (``isinstance(m, FSDPModule)``) and upstream's
    functions that take FSDP modules (``share_comm_ctx``,
    ``register_fsdp_forward_method``) accept ours. Every method upstream's
    class defines is defined here again over our state: none of upstream's
    bodies runs on our modules (test_drop_in.py checks that)."""

    # Upstream's __new__ builds the original class when an FSDP class is
    # constructed (e.g. Sequential slicing); it finds it at this index of the
    # MRO: FSDP<Orig>, this class, upstream's FSDPModule, Orig.
    _orig_cls_mro_index: int = 3

    def _get_fsdp_state(self) -> FSDPState:
        state = get_fsdp_state(self)
        if state is None:
            raise AssertionError(f"No FSDP state found on {self}")
        _refuse_upstream_mixing(sys._getframe(1))
        return state

    def _groups(self) -> list:
        return self._get_fsdp_state()._fsdp_param_groups

    def _group(self):
        """The module's only group, None without parameters (AssertionError
        when shard_placement_fn made several: use _groups())."""
        return self._get_fsdp_state()._fsdp_param_group

    def _single_group_setting(self, method: str):
        groups = self._groups()
        if len(groups) > 1:
            raise ValueError(
                f"{method} is not supported with multiple param groups (from per-param mesh via "
                f"shard_placement_fn): {len(groups)} groups on {type(self).__name__}"
            )
        return groups[0] if groups else None

    def reshard(self) -> None:
        """Frees the unsharded parameters and registers the sharded ones."""
        for group in self._groups():
            group.reshard()

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gathers the parameters; with async_op, returns a handle whose
        wait() finishes the unshard, else waits before returning."""
        state = self._get_fsdp_state()
        groups = list(state._fsdp_param_groups)
        if groups:
            state._lazy_init_group()
        for group in groups:
            group.unshard()
        handle = _UnshardHandleImpl(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        self._get_fsdp_state()._state_ctx.is_last_backward = is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """On the root, before forward: backward passes reduce nothing at
        their end; the caller's :meth:`finalize_backward` runs the pending
        reductions and resharding (Note [manual backward finalization] in
        _state.py). Supersedes :meth:`set_is_last_backward`. The mode cannot
        change during a backward, nor between a backward and its
        finalization. As torch 2.15's."""
        state = self._get_fsdp_state()
        if state._is_root is False:
            raise RuntimeError(
                "set_manual_backward_finalization must be called on the root FSDP module, not "
                f"on {type(self).__name__}")
        ctx = state._state_ctx
        if enabled != ctx.manual_backward_finalization \
                and torch._C._current_graph_task_id() != -1:
            raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
        active = ctx.manual_backward_finalization_active
        if active is not None and enabled != active:
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode after backward starts "
                "(finalize_backward or reset_iter_state ends the backward iteration)")
        ctx.manual_backward_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False):
        """Under manual backward finalization, after the backward passes of
        one step: runs the reductions left pending (gradient sync and
        resharding follow their current settings) and waits for them; with
        ``async_op`` returns a :class:`GradientReductionHandle` whose
        ``wait()`` does the waiting, and forward is refused until it has.
        A no-op before the root's first forward. As torch 2.15's."""
        state = self._get_fsdp_state()
        if state._is_root is None:
            return _GradientReductionHandleImpl(None, None) if async_op else None
        reduction = _disabled_method(FSDPState._start_finalize_backward)(state, async_op)
        return _GradientReductionHandleImpl(state, reduction) if async_op else None

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Resharding keeps the unsharded parameters' storage instead of
        freeing it, so their data pointers stay the same from step to step
        (what a captured CUDA graph needs), for the memory they hold. As
        torch 2.15's."""
        for m in _fsdp_modules(self, recurse):
            for group in m._groups():
                for param in group.params:
                    param.keep_unsharded_storage = keep

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Off: no reduce-scatter nor all-reduce; gradients accumulate unsharded."""
        _set_group_option(self, "reduce_grads", requires_gradient_sync, recurse)
        _set_group_option(self, "all_reduce_grads", requires_gradient_sync, recurse)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: off, gradients are reduce-scattered but not all-reduced across
        replicas; the partial sums accumulate until a backward that does."""
        _set_group_option(self, "all_reduce_grads", requires_all_reduce, recurse)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        for m in _fsdp_modules(self, recurse):
            state = m._get_fsdp_state()
            state._auto_reshard_after_forward = False
            for group in state._fsdp_param_groups:
                group.set_reshard_after_forward(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        _set_group_option(self, "reshard_after_backward", reshard_after_backward, recurse)

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        _check_fsdp_modules(modules)
        self._get_fsdp_state()._set_prefetch(list(modules), forward=True)

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        _check_fsdp_modules(modules)
        self._get_fsdp_state()._set_prefetch(list(modules), forward=False)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """On a device mesh, the next forward's all-gathers wait for ``event``
        (recorded after the optimizer step) instead of the whole compute
        stream, as upstream's. CPU collectives are ordered by the host:
        there it is ignored."""
        state = self._get_fsdp_state()
        if state._device.type != "cpu":
            state._state_ctx.post_optim_event = event

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Use :py:meth:`set_gradient_divide_factor` instead."""
        self.set_gradient_divide_factor(factor)

    def set_gradient_divide_factor(self, factor: float) -> None:
        _set_group_option(self, "gradient_divide_factor", factor, recurse=False)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with SUM only and divide around it (upstream's numbers for
        the same setting: the division moves, so the rounding may change)."""
        _set_group_option(self, "force_sum_reduction_for_comms", enable, recurse=False)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Reduce-scatter zeros for parameters that got no gradient, so that
        ranks taking different branches issue the same collectives."""
        _set_group_option(self, "reduce_scatter_unused_params", reduce_scatter_unused_params,
                          recurse)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """How many gradient reduce-scatters (each holding its input buffer)
        may be in flight when the next group issues its own: 1 (the default)
        waits for the previous one first; more overlaps more, for memory."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        _set_group_option(self, "reduce_scatter_max_input_buffers", max_input_buffers, recurse)

    def set_custom_all_gather(self, comm) -> None:
        """Upstream's ``AllGather`` Comm object gathers this group's
        parameters (its ``allocate`` makes the output buffer)."""
        group = self._single_group_setting("set_custom_all_gather")
        if group is not None:
            group.set_custom_all_gather(comm)

    def set_custom_reduce_scatter(self, comm) -> None:
        """Upstream's ``ReduceScatter`` Comm object reduces this group's
        gradients. It is called with ``op=ReduceOp.SUM``: the division by the
        world size happens around it (as with gloo, which has no AVG)."""
        group = self._single_group_setting("set_custom_reduce_scatter")
        if group is not None:
            group.set_custom_reduce_scatter(comm)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """``hook(reduce_output)`` runs on each reduction's output, in place:
        after the reduce-scatter (FSDP) or the replicas' all-reduce (HSDP),
        before the final divide and the cast to the parameters' dtype.

        ``stream``: as upstream's, refused under native HSDP. The hook runs
        with ``stream`` as its device's current stream, or without one with
        the group's own all-reduce stream (one per module, made at the first
        call), as upstream's runs it: on a CPU mesh streams order nothing,
        but a hook that reads ``torch.cpu.current_stream()`` sees the same."""
        group = self._single_group_setting("set_all_reduce_hook")
        if group is None:
            return
        # As upstream: under native HSDP a stream is refused after the hook is
        # set, and the hook keeps the group's own stream.
        refused = stream is not None and group.replicate_group is not None
        group.set_all_reduce_hook(
            _HookOnStream(hook, None if refused else stream, _mesh_device_type(self)))
        if refused:
            raise ValueError("stream cannot be set when using native HSDP")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """All-gather outputs and reduce-scatter buffers come from the process
        group's allocator where its backend has one (fsdp_ext on one host:
        peers read them in place, no staging copy); else ordinary memory."""
        if any(group.has_custom_comm for group in self._groups()):
            raise AssertionError(
                "cannot call set_allocate_memory_from_process_group() when a custom all-gather "
                "or reduce-scatter comm is set"
            )
        _set_group_option(self, "allocate_from_group", enable, recurse=False)

    def set_host_shared_parameters(self, enable: bool = True) -> None:
        """Ours only: one copy per host of every unsharded parameter of this
        module and its FSDP submodules. The ranks of a shard group map the
        same memory (a file in /dev/shm, unlinked once mapped); an unshard
        writes this rank's shard into it and waits until every rank of the
        host has (no all-gather, no copy-out, one copy instead of one per
        rank), and the parameters are views of it. Gradients stay per rank.
        Numbers are unchanged bit for bit.

        Call on every rank, before the first forward (the memory is mapped at
        lazy init, once the parameter dtypes are final). A shard group over
        several hosts needs the same number of its ranks on each, and a
        process group with a C++ backend: each host then holds its own copy,
        and only the other hosts' shards cross the network, straight into it
        (Note [host-shared parameters across hosts]). Parameters must be
        sharded on dim 0. The memory stays mapped while the
        modules live: resharding frees nothing, since the host's copy is
        shared (one copy per host in all, instead of one per rank at peak).
        The ranks' ordering rules: Note [ordering of host-shared unsharded
        parameters] in csrc/fsdp/host_shared_parameters.hpp."""
        states = [m._get_fsdp_state() for m in _fsdp_modules(self, recurse=True)]
        if enable and any(s._device.type != "cpu" for s in states):
            raise NotImplementedError(
                f"set_host_shared_parameters({type(self).__name__}): host-shared parameters "
                "map host memory; this module's mesh is on "
                f"{next(s._device for s in states if s._device.type != 'cpu')}")
        if not enable:
            if any(g.host_shared for s in states for g in s._fsdp_param_groups):
                raise NotImplementedError("host-shared parameters cannot be turned off once mapped")
            for state in states:
                state._host_shared_requested = False
            return
        if any(s._group_initialized for s in states):
            raise RuntimeError(
                "set_host_shared_parameters must be called before the first forward "
                "(the memory is laid out at lazy initialisation)"
            )
        for state in states:
            state._host_shared_requested = True

    def set_per_parameter_collectives(self, enable: bool, *, recurse: bool = True) -> None:
        """Ours only, over the fsdp_ext backend: all-gather every parameter
        straight into its unsharded storage and reduce-scatter every gradient
        where it lies, as one coalesced collective per group with a member
        per parameter. That drops the all-gather copy-out, and the
        reduce-scatter copy-in of gradients already laid out as their padded
        parameter (dim-0 rows divisible by the world size). Results are the
        same bit for bit; CommDebugMode then counts
        ``allgather_into_tensor_coalesced`` / ``reduce_scatter_tensor_coalesced``
        where upstream issues ``all_gather_into_tensor`` /
        ``reduce_scatter_tensor``, hence off by default. Groups on other
        backends or with custom comms, all-gathers of parameters sharded on a
        dim other than 0, and reductions with PREMUL_SUM or a pre-divide keep
        the flat collectives."""
        _set_group_option(self, "per_parameter_collectives", enable, recurse=recurse)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        _set_group_option(self, "unshard_in_backward", unshard_in_backward, recurse=False)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        # On host memory collectives are always issued asynchronously and
        # waited where their result is needed, so both settings behave the
        # same. On a CUDA mesh upstream's True moves the unshard's copy-in,
        # buffer and wait onto the compute stream; ours keeps the side
        # streams either way (same numbers; memory may fragment differently).
        return

    def reset_iter_state(self) -> None:
        """Back to a clean state after an exception mid forward/backward:
        parameters resharded, pending collectives drained, the failed
        iteration's gradients not reduced."""
        self._get_fsdp_state()._reset_iter_state()

    def __reduce_ex__(self, protocol):
        # Note [pickling our sharded modules]
        # Pickle names a class by its module and name, which FSDP<Orig> (made
        # by fully_shard) cannot be found by. Dynamo's guard serialisation
        # (torch.compile's package: caching_precompile, aot_compile) pickles
        # the compiled modules; for upstream's it names FSDP<Orig> by Orig,
        # found at a fixed index of upstream's MRO and looked up in upstream's
        # class map on load, where ours is neither (our FSDPModule sits
        # between). So ours names itself: the same reduction, with Orig and
        # our map in place of the class. Loading then builds what it builds
        # for upstream's modules (FSDP<Orig>.__new__, upstream's: an Orig).
        reduced = super().__reduce_ex__(protocol)
        orig_cls = _fsdp_cls_to_cls.get(type(self))  # None: a class fully_shard did not make
        if (orig_cls is not None and isinstance(reduced, tuple) and len(reduced) >= 2
                and reduced[0] is copyreg.__newobj__ and reduced[1] and reduced[1][0] is type(self)):
            return (_new_fsdp_module, (orig_cls, *reduced[1][1:]), *reduced[2:])
        return reduced

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        self.reshard()
        # nn.Module's _apply, past upstream's (which reads upstream's state).
        out = super(UpstreamFSDPModule, self)._apply(*args, **kwargs)
        with torch.no_grad():
            for group in self._groups():
                group.reset_sharded_params()
        return out

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """Gradient reduce-scatters on their own process group over the shard
        ranks (one per rank set, created here: call it on every shard rank),
        so they progress apart from the all-gathers; False: back to the
        shard group."""
        new_groups: dict = {}
        for group in (g for module in _fsdp_modules(self, recurse) for g in module._groups()):
            if group.shard_group is None:
                continue
            if not enable:
                group.set_reduce_scatter_group(None)
                continue
            ranks = tuple(dist.get_process_group_ranks(group.shard_group))
            if ranks not in new_groups:
                new_groups[ranks] = group.reduce_scatter_group or dist.new_group(
                    list(ranks), use_local_synchronization=True,
                    group_desc="fsdp_reduce_scatter")
            group.set_reduce_scatter_group(new_groups[ranks])

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise NotImplementedError(
            "torch_fsdp_ext FSDPModule.set_symm_mem_for_comm: symmetric memory is NCCL's "
            "(CUDA meshes); on a CPU mesh use set_allocate_memory_from_process_group_for_comm, "
            "which lets fsdp_ext peers read the buffers in place"
        )


class _HookOnStream:
    """An all-reduce hook run as upstream runs it: under its stream (the
    user's, else one of its own, as upstream's all-reduce stream), which
    first waits for the stream the reduction finished on; that stream waits
    for it afterwards. On CPU all of it orders nothing and costs a few
    attribute look-ups; what a hook can see is the current stream."""

    def __init__(self, hook, stream, device_type: str):
        self._hook = hook
        self._stream = stream
        self._device = torch.get_device_module(device_type)

    def __call__(self, output: torch.Tensor) -> None:
        if self._stream is None:
            self._stream = self._device.Stream()
        reduced_on = self._device.current_stream()
        self._stream.wait_stream(reduced_on)
        with self._device.stream(self._stream):
            self._hook(output)
        reduced_on.wait_stream(self._stream)


# Note [upstream's functions given our modules and theirs]
# Our modules are upstream FSDPModules, so upstream's share_comm_ctx and its
# modules' prefetch setters take them in a list, ask each for its state, and
# then mix the two runtimes' objects (a C++ comm context handed to upstream's
# groups, our groups as upstream's prefetch targets), failing later with an
# AttributeError deep in one of them. Both ask every module for its state
# before they change anything, so that first call is refused here, naming the
# function, when the list mixes the runtimes (upstream's share_comm_ctx over
# our modules alone works: the objects it moves are all ours). The caller is
# recognised by its code object: cheap on every other call.
_UPSTREAM_MIXERS = {"share_comm_ctx", "set_modules_to_forward_prefetch",
                    "set_modules_to_backward_prefetch"}


def _upstream_frame(frame):
    """The upstream mixer `frame` runs in (or its comprehension's parent), or None."""
    from torch.distributed.fsdp._fully_shard import _fully_shard as upstream_module

    for candidate in (frame, frame.f_back):
        if (candidate is not None and candidate.f_globals is upstream_module.__dict__
                and candidate.f_code.co_name in _UPSTREAM_MIXERS):
            return candidate
    return None


def _refuse_upstream_mixing(frame) -> None:
    if frame.f_code.co_name not in _UPSTREAM_MIXERS and frame.f_code.co_name != "<listcomp>":
        return
    caller = _upstream_frame(frame)
    if caller is None:
        return
    name = caller.f_code.co_name
    if name == "share_comm_ctx":
        modules = list(caller.f_locals.get("modules") or ())
        if all(isinstance(m, FSDPModule) for m in modules):
            return
        what = "torch.distributed.fsdp.share_comm_ctx"
    else:
        what = f"upstream's FSDPModule.{name} (on {type(caller.f_locals.get('self')).__name__})"
    raise ValueError(
        f"{what} was given modules sharded by torch_fsdp_ext.fully_shard together with modules "
        "sharded by torch.distributed.fsdp.fully_shard; the two runtimes cannot share a comm "
        "context or prefetch each other. Shard all of them with one fully_shard, or use "
        "torch_fsdp_ext.share_comm_ctx / our modules' setters on our modules."
    )


def _mesh_device_type(module: nn.Module) -> str:
    """The device type of the mesh the module's parameters are sharded on."""
    for param in module.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            return mesh.device_type
    return "cpu"


def share_comm_ctx(modules: list) -> None:
    """Makes several FSDP roots (pipeline-parallel stages) share one comm
    context: backward-prefetch order and the reductions in flight. Call it
    before their first forward, as upstream's."""
    if not modules:
        return
    _check_fsdp_modules(modules, "Expects list of FSDPModules but got")
    states = [module._get_fsdp_state() for module in modules]
    shared = states[0]._comm_ctx
    for state in states[1:]:
        state._comm_ctx = shared
        for group in state._fsdp_param_groups:
            group.comm_ctx = shared


def _check_fsdp_modules(modules, what: str = "Expects FSDPModule but got") -> None:
    for module in modules:
        if isinstance(module, FSDPModule):
            continue
        if isinstance(module, UpstreamFSDPModule):
            # Two runtimes cannot share prefetch order or a comm context.
            raise ValueError(
                f"{what} {type(module)}: sharded by torch.distributed.fsdp.fully_shard, not "
                "torch_fsdp_ext's (use one fully_shard for the whole model, e.g. through "
                "torch_fsdp_ext.use_as_fully_shard())"
            )
        raise ValueError(f"{what} {type(module)}: {module}")


if _compat.GradientReductionHandle is not None:
    GradientReductionHandle = _compat.GradientReductionHandle
else:
    class GradientReductionHandle:
        """What ``FSDPModule.finalize_backward(async_op=True)`` returns (torch
        2.15's class, defined here for the torch versions before it)."""

        def wait(self) -> None:
            return


class _GradientReductionHandleImpl(GradientReductionHandle):
    """An asynchronous finalize_backward in flight: wait() completes the
    reductions and ends the backward iteration, once."""

    def __init__(self, state: Optional[FSDPState], reduction) -> None:
        self._state = state
        self._reduction = reduction

    def wait(self) -> None:
        if self._state is None or self._reduction is None:
            return
        state, reduction = self._state, self._reduction
        _disabled_method(FSDPState._wait_for_gradient_reduction)(state, reduction)
        self._state = self._reduction = None


class _UnshardHandleImpl(UnshardHandle):
    """Returned by ``FSDPModule.unshard(async_op=True)``; a subclass of
    upstream's UnshardHandle, which ours exports as its own."""

    def __init__(self, groups: list) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Runs FSDP's pre/post-forward around ``module.<method_name>`` too (for
    entry points other than ``forward``). No-op for non-FSDP modules."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    orig = getattr(module, method_name).__func__

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        state = self._get_fsdp_state()
        args, kwargs = state._pre_forward(self, args, kwargs)
        out = orig(self, *args, **kwargs)
        return state._post_forward(self, args, out)

    setattr(module, method_name, wrapped.__get__(module, type(module)))


__all__ = ["fully_shard", "FSDPModule", "GradientReductionHandle", "UnshardHandle",
           "register_fsdp_forward_method", "share_comm_ctx", "TrainingState"]
