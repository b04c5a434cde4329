"""FSDPState: the Python side of one fully_shard call -- the forward hooks
for what the C++ ones hand over (the root's forward, activation-checkpoint
recomputation, keyword arguments and other pytrees, states of several
modules; csrc/fsdp/forward_hooks.hpp), the root's lazy initialisation and its
end-of-backward callback. The state's C++ half (csrc/fsdp/fsdp_state.hpp)
holds the training state and runs the backward hooks: the post-backward
node on forward inputs and the pre-backward hook on outputs run no Python.
Per step, for a model whose blocks take and return plain tensors, Python
runs the root's two forward hooks and its end-of-backward callback; every
per-module and per-parameter step is C++."""

from __future__ import annotations

import contextlib
import functools
import os
import types
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed._composable_state import _get_module_state, _insert_module_state, _State
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from .. import _C, _compat
from . import _extensions, _host_shared, _init
from ._trace import ShardedState, TrainingState

_NO_RANGE = contextlib.nullcontext()


def _profiler_range(name: str):
    """A torch.profiler range named as upstream's state-level phases
    ("FSDP::root_pre_forward", ...); the groups' phases come from C++
    (csrc/fsdp/profiler_range.hpp). Nothing is entered unless a profiler
    is recording: these run for every module of every step."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NO_RANGE


def get_fsdp_state(module: nn.Module) -> Optional["FSDPState"]:
    state = _get_module_state(module)
    return state if isinstance(state, FSDPState) else None


# Note [our hooks run outside dynamo]
# Upstream FSDP2 runs its hooks with dynamo disabled (its _dynamo_disable on
# _pre_forward, _post_forward, the end-of-backward callback, ...), so that
# torch.compile of a model with fully_shard modules never traces FSDP's
# bookkeeping. Ours need the same, for a reason of their own: dynamo cannot
# trace our C++ hooks, so it graph-breaks at them and runs them eagerly with
# its frame callback still set, and every Python frame they call back into
# (the root's forward hooks: lazy init, the end of the forward) was compiled
# as a frame of its own -- 43 frames and 10 graph breaks for a 3-block MLP
# compiled whole, where upstream's compiles 3 and breaks none -- and dynamo
# once failed a rank's first compiled step in CI (an IndexError while
# guarding id(state) in _lazy_init). So every Python hook entry point is a
# dynamo-disabled function: the C++ hooks and autograd reach the Python ones
# through WeakMethods bound to disabled functions (_weak_hook), the hooks of a
# state of several modules are registered disabled, and the C++ forward hooks
# clear dynamo's frame callback while they run (Note [C++ hooks run outside
# dynamo], csrc/python/dynamo_frames_off.hpp). Dynamo is imported at the
# first fully_shard, not with the package: the import takes about a second.
def _outside_dynamo(function: Callable) -> Callable:
    """`function` with dynamo disabled for it and all it calls (Note [our
    hooks run outside dynamo])."""
    import torch._dynamo

    return torch._dynamo.disable(function, recursive=True)


@functools.cache
def _disabled_method(method: Callable) -> Callable:
    """One of FSDPState's hook methods, disabled once and kept here: a
    WeakMethod holds its function weakly, so something must hold these."""
    return _outside_dynamo(method)


def _weak_hook(state: "FSDPState", method: Callable) -> weakref.WeakMethod:
    """What C++ calls back into: `method` of FSDPState bound to `state`, run
    outside dynamo, weakly (the module holds its hooks, and a strong reference
    from C++ to the state would close a cycle Python's collector cannot see)."""
    return weakref.WeakMethod(types.MethodType(_disabled_method(method), state))


def _inside_backward() -> bool:
    """True while the autograd engine runs a graph (checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


class StateContext:
    """Shared by every state under one root after lazy init."""

    def __init__(self) -> None:
        self.all_states: list[FSDPState] = []
        # The states of fully_shard([a, b, ...]): only they track which of
        # their modules have yet to run forward (_modules_to_run_forward).
        self.grouped_states: list[FSDPState] = []
        # Whether the end-of-backward callback is queued, and queuing it
        # (csrc/fsdp/fsdp_state.hpp): the backward hooks are C++.
        self.hooks = _C.FsdpStateContext()
        self._iter_forward_root: Optional[FSDPState] = None
        self.is_last_backward = True
        # FSDPModule.set_post_optim_event (device meshes): waited on by the
        # all-gather streams at the next root pre-forward, then forgotten.
        self.post_optim_event = None
        # Manual backward finalization (FSDPModule.set_manual_backward_
        # finalization, torch 2.15's): the mode the user set, and the mode of
        # the backward iteration in progress, taken at its first end-of-
        # backward callback and kept until the iteration is finalized or
        # reset (None between iterations), so that the mode cannot change
        # halfway through one.
        self.manual_backward_finalization = False
        self.manual_backward_finalization_active: Optional[bool] = None
        # finalize_backward(async_op=True) returned a handle not yet waited on.
        self.gradient_reduction_pending = False

    @property
    def iter_forward_root(self) -> Optional["FSDPState"]:
        """The state whose pre-forward started the current forward; the C++
        half keeps the same (the C++ forward hooks leave its hooks to Python)."""
        return self._iter_forward_root

    @iter_forward_root.setter
    def iter_forward_root(self, state: Optional["FSDPState"]) -> None:
        self._iter_forward_root = state
        self.hooks.set_forward_root(None if state is None else state._hooks)


def _upstream_hook_handle(index: int, attribute: str) -> property:
    """FSDPState's `attribute`: the handle of its forward pre-hook (index 0)
    or post-hook (1), under upstream's name (Note [upstream's hook handles
    and hooks, for the tools that re-wire them])."""

    def get_handle(state: "FSDPState"):
        return state._forward_hook_handle(index, attribute)

    def set_handle(state: "FSDPState", handle) -> None:
        state._forward_hook_handle(index, attribute)
        state._hook_handles[index] = handle
        state._restore_cpp_hook(handle, index)

    return property(get_handle, set_handle)


class FSDPState(_State):
    def __init__(self) -> None:
        super().__init__()
        # One C++ group per process group of the parameters (several when
        # shard_placement_fn puts some of them on another mesh), in the order
        # fully_shard made them.
        self._fsdp_param_groups: list[_C.FsdpParamGroup] = []
        self._is_root: Optional[bool] = None
        self._state_ctx = StateContext()
        # The hook layer's C++ half: training state, groups, backward hooks
        # (Note [the hook layer's order in one step], csrc/fsdp/fsdp_state.hpp).
        self._hooks = _C.FsdpState()
        self._hooks.context = self._state_ctx.hooks
        self._comm_ctx = _C.FsdpCommContext()
        self._modules_to_run_forward: set[nn.Module] = set()
        self._auto_reshard_after_forward = True
        self._group_initialized = False
        # set_host_shared_parameters: map the memory at lazy init.
        self._host_shared_requested = False
        self._modules: tuple[nn.Module, ...] = ()
        self._device = torch.device("cpu")
        self._hook_handles: list = []
        self._orig_param_uids: list[int] = []

    @property
    def _training_state(self) -> TrainingState:
        """Which hook ran last (upstream's FSDPState._training_state); held
        by the C++ half, whose backward hooks set it."""
        return self._hooks.training_state

    @_training_state.setter
    def _training_state(self, state: TrainingState) -> None:
        self._hooks.training_state = state

    @property
    def _fsdp_param_group(self) -> Optional[_C.FsdpParamGroup]:
        """The one group of a state that has at most one (upstream's accessor)."""
        groups = self._fsdp_param_groups
        if len(groups) > 1:
            raise AssertionError(
                f"FSDP state has {len(groups)} parameter groups (a mesh per parameter via "
                f"shard_placement_fn; modules: {', '.join(g.module_fqn for g in groups)}): "
                "use _fsdp_param_groups"
            )
        return groups[0] if groups else None

    # Note [upstream's hook handles and hooks, for the tools that re-wire them]:
    # torch's FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker)
    # removes a state's forward hooks through these handles, registers
    # wrappers around `_pre_forward` / `_post_forward` (upstream's signatures,
    # which ours share) in their place, and on exit registers those two
    # methods again and assigns the new handles here. Registered as they are,
    # the Python hooks would take every forward from then on; the C++ hooks
    # do the same steps and hand every case they do not take to these same
    # methods (csrc/fsdp/forward_hooks.hpp), so where a handle assigned here
    # holds one of those methods, its C++ hook takes its place under the same
    # handle. Backward: csrc/fsdp/replaceable_method.hpp.
    _pre_forward_hook_handle = _upstream_hook_handle(0, "_pre_forward_hook_handle")
    _post_forward_hook_handle = _upstream_hook_handle(1, "_post_forward_hook_handle")

    def _forward_hook_handle(self, index: int, attribute: str):
        if len(self._modules) != 1:
            # Upstream's tools swap the hooks of each module for ungrouped
            # ones, which would end the group's forward after its first module.
            names = ", ".join(type(m).__name__ for m in self._modules)
            raise NotImplementedError(
                f"{attribute} of the fully_shard state of several modules ({names}): tools that "
                "re-register FSDP's forward hooks per module (torch.distributed._tools."
                "fsdp2_mem_tracker.FSDPMemTracker) are supported on states of one module only; "
                "torch.distributed._tools.mem_tracker.MemTracker works on these modules")
        return self._hook_handles[index]

    def _restore_cpp_hook(self, handle, index: int) -> None:
        method = FSDPState._pre_forward if index == 0 else FSDPState._post_forward
        module = self._modules[0]
        hooks = handle.hooks_dict_ref()
        if hooks is not (module._forward_pre_hooks if index == 0 else module._forward_hooks):
            return  # a handle to another module's hooks (or to none left)
        hook = hooks.get(handle.id)
        if getattr(hook, "__self__", None) is not self or getattr(hook, "__func__", None) \
                is not method:
            return  # a tool's wrapper: it runs as registered
        # The C++ pre-hook takes keyword arguments, the post-hook does not.
        kwargs_flags = module._forward_pre_hooks_with_kwargs if index == 0 \
            else module._forward_hooks_with_kwargs
        if (handle.id in kwargs_flags) != (index == 0):
            return
        # In place: the same position among the module's hooks, the same
        # handle and flags (always_call); only the callable changes.
        hooks[handle.id] = self._cpp_forward_hooks[index]

    # Set-up ------------------------------------------------------------------

    def init(self, modules: tuple[nn.Module, ...], mp_policy, offload_policy,
             auto_reshard_after_forward: bool, device: torch.device) -> None:
        for module in modules:
            _insert_module_state(module, self)
        self._modules = modules
        self._hooks.module_classes = ", ".join(type(m).__name__ for m in modules) or "?"
        self._device = device
        self._mp_policy = mp_policy
        self._offload_policy = offload_policy
        # The casts the hooks apply (None: none), decided once.
        self._input_dtype = mp_policy.param_dtype if mp_policy.cast_forward_inputs else None
        self._output_dtype = mp_policy.output_dtype
        self._auto_reshard_after_forward = auto_reshard_after_forward
        if len(modules) == 1:
            # C++ hooks for the common case, these Python ones for the rest
            # (csrc/fsdp/forward_hooks.hpp). Weak: the module holds the hooks.
            pre, post = _C._fsdp_forward_hooks(self._hooks,
                                               _weak_hook(self, FSDPState._pre_forward),
                                               _weak_hook(self, FSDPState._post_forward))
            self._cpp_forward_hooks = (pre, post)
            self._hook_handles = [
                modules[0].register_forward_pre_hook(pre, prepend=True, with_kwargs=True),
                modules[0].register_forward_hook(post, prepend=False),
            ]
        else:
            self._register_grouped_hooks(modules)

    def _register_grouped_hooks(self, modules) -> None:
        """fully_shard([a, b, ...]): the state's pre-forward runs for each
        module, its post-forward once the last module that started finishes."""
        to_run = self._modules_to_run_forward

        def pre_hook(module, args, kwargs):
            if not to_run:
                to_run.update(modules)
            return self._pre_forward(module, args, kwargs)

        def post_hook(module, args, output):
            to_run.discard(module)
            if to_run:
                return _cast_floating(output, self._output_dtype)
            return self._post_forward(module, args, output)

        pre_hook, post_hook = _outside_dynamo(pre_hook), _outside_dynamo(post_hook)
        for module in modules:
            self._hook_handles.append(
                module.register_forward_pre_hook(pre_hook, prepend=True, with_kwargs=True))
            self._hook_handles.append(
                module.register_forward_hook(post_hook, prepend=False, always_call=True))

    def _lazy_init(self) -> None:
        """Runs at the first forward of a tree: this state becomes the root,
        the states below share its contexts, groups learn their names."""
        if self._is_root is not None:
            return
        if len(self._modules) > 1:
            raise RuntimeError(f"FSDP requires a single root module but got {self._modules}")
        root = self._modules[0]
        for module in root.modules():
            state = get_fsdp_state(module)
            if state is not None and state is not self \
                    and state._state_ctx.manual_backward_finalization:
                raise RuntimeError(
                    "set_manual_backward_finalization must be called on the root FSDP module "
                    f"({type(root).__name__}), not on {type(module).__name__}")
        self._is_root = True
        ctx = self._state_ctx
        seen: set = set()
        for name, module in root.named_modules():
            state = get_fsdp_state(module)
            if state is None or id(state) in seen:
                continue
            if state is not self:
                if state._is_root is not None:
                    raise RuntimeError(
                        f"FSDP state has already been lazily initialized for {name}\n"
                        "FSDP requires running forward through the root module first"
                    )
                state._is_root = False
            seen.add(id(state))
            ctx.all_states.append(state)
        if self._auto_reshard_after_forward:
            # The root's parameters are needed first in backward: keep them.
            for group in self._fsdp_param_groups:
                group.set_reshard_after_forward(False)
        self._init_fqns(root)
        self._validate_no_duplicate_params()
        # Weak: the C++ context must not keep this state (and its model) alive.
        ctx.hooks.set_final_callback(
            _weak_hook(self, FSDPState._root_post_backward_final_callback))
        ctx.hooks.set_states([state._hooks for state in ctx.all_states])
        ctx.grouped_states = [state for state in ctx.all_states if len(state._modules) > 1]
        for state in ctx.all_states:
            state._state_ctx = ctx
            state._hooks.context = ctx.hooks
            state._comm_ctx = self._comm_ctx
            for group in state._fsdp_param_groups:
                group.comm_ctx = self._comm_ctx
        if self._device.type != "cpu":
            # The side streams (csrc/fsdp/fsdp_streams.hpp); FSDP_EXT_FSDP_STREAMS=0
            # keeps every collective on the compute stream (for debugging).
            self._comm_ctx.use_device(
                self._device, os.environ.get("FSDP_EXT_FSDP_STREAMS", "1") != "0")
        # One queue of reductions, so one cap: the most any group allows.
        self._comm_ctx.max_reduces_in_flight = max(
            (g.reduce_scatter_max_input_buffers
             for s in ctx.all_states for g in s._fsdp_param_groups), default=1)
        for state in ctx.all_states:
            state._lazy_init_group()
        for state in ctx.all_states:
            # From here the C++ forward hooks may take the state's forwards.
            state._hooks.set_forward_setup(True, state._input_dtype, state._output_dtype)

    def _init_fqns(self, root: nn.Module) -> None:
        param_to_fqn = {id(p): n for n, p in root.named_parameters()}
        module_to_fqn = {id(m): n for n, m in root.named_modules()}
        for state in self._state_ctx.all_states:
            several = len(state._fsdp_param_groups) > 1
            for group in state._fsdp_param_groups:
                group.module_fqn = ", ".join(
                    module_to_fqn[id(m)] for m in state._modules if id(m) in module_to_fqn
                )
                # Upstream tells a module's groups apart by their shard mesh size.
                if several and group.shard_group is not None:
                    group.profile_label_suffix = f" [pg={group.shard_group.size()}]"
                for param in group.params:
                    param.fqn = param_to_fqn.get(id(param.sharded_param), param.fqn)

    def _set_prefetch(self, modules: list, forward: bool) -> None:
        """set_modules_to_forward_prefetch / _backward_prefetch: the targets'
        groups go to this state's C++ group, which issues the prefetches."""
        targets = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
        groups = self._fsdp_param_groups
        if not groups:
            # No group to issue them: the C++ state does.
            if forward:
                self._hooks.set_groupless_forward_prefetch(targets)
            else:
                self._hooks.set_groupless_backward_prefetch(targets)
            return
        # The first group issues the prefetches (once per pass of the state).
        if forward:
            groups[0].set_forward_prefetch(targets)
            return
        for i, group in enumerate(groups):
            # Naming modules turns the implicit prefetch off, as upstream's,
            # even if none of them has parameters.
            group.set_backward_prefetch(targets if i == 0 else [], bool(modules))

    def _validate_no_duplicate_params(self) -> None:
        """A parameter tied between two fully_shard calls would be sharded,
        gathered and reduced twice, its gradient split between two copies."""
        seen: set[int] = set()
        for state in self._state_ctx.all_states:
            params = [p for group in state._fsdp_param_groups for p in group.params]
            for param, uid in zip(params, state._orig_param_uids):
                if uid in seen:
                    raise ValueError(
                        f"Parameter '{param.fqn}' is shared with a parameter already managed "
                        "by another FSDP group. For shared/tied parameters, use "
                        "fully_shard([module_a, module_b]) to place them in the same FSDP group."
                    )
                seen.add(uid)

    def _lazy_init_group(self) -> None:
        groups = self._fsdp_param_groups
        if not groups or self._group_initialized:
            return
        policy = self._mp_policy
        for group in groups:
            with torch.no_grad():
                group.reset_sharded_params()
            group.init_mp_dtypes(policy.param_dtype, policy.reduce_dtype)
        on_meta = [p.fqn for group in groups for p in group.params if p.is_meta]
        if on_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {on_meta}\n"
                "For example, call module.to_empty(device) to materialize to device and "
                "call module.reset_parameters() on each module to initialize values."
            )
        # fsdp_pre/post_all_gather on local tensors (set after fully_shard
        # too, as long as it is before the first forward).
        _extensions.attach(groups, policy)
        if isinstance(self._offload_policy, CPUOffloadPolicy):
            for group in groups:
                _init.validate_offloaded_on_cpu(group)
        elif self._device.type != "cpu":
            _init.check_params_on_device(groups, self._device, type(self._modules[0]).__name__)
        if self._host_shared_requested:
            # Now that the parameter dtypes are final: the memory's layout.
            _host_shared.share_groups(groups, type(self._modules[0]).__name__)
        self._group_initialized = True

    # Forward -----------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self._state_ctx.gradient_reduction_pending \
                or _active_gradient_reduction(self._comm_ctx) is not None:
            raise RuntimeError("The previous gradient reduction must be waited on before forward "
                               "(GradientReductionHandle.wait())")
        hooks = self._hooks
        if hooks.in_pre_backward:
            # Activation-checkpoint recomputation inside backward: parameters
            # must be unsharded (a later module's post_backward may have
            # resharded them), nothing else.
            for group in self._fsdp_param_groups:
                if group.sharded_state != ShardedState.UNSHARDED:
                    group.unshard()
                    group.wait_for_unshard()
            return _cast_floating((args, kwargs), self._input_dtype)
        first_in_pass = hooks.enter_forward()
        if first_in_pass:
            with _profiler_range("FSDP::root_pre_forward") if self._is_root is not False \
                    else _NO_RANGE:
                self._lazy_init()
                if self._state_ctx.iter_forward_root is None and self._device.type != "cpu":
                    args, kwargs = self._root_pre_forward_on_device(args, kwargs)
            if self._state_ctx.iter_forward_root is None:
                self._state_ctx.iter_forward_root = self
        # Cast before the post-backward node wraps the inputs, so that it sees
        # the gradients of the tensors the module really receives.
        if self._input_dtype is not None:
            with _profiler_range("FSDP::cast_forward_inputs"):
                args, kwargs = _cast_floating((args, kwargs), self._input_dtype)
        if torch.is_grad_enabled():
            args, kwargs = _pre_forward_groups(hooks, args, kwargs)
        else:
            hooks.pre_forward_groups([])
        if first_in_pass:
            hooks.prefetch_forward()
        return args, kwargs

    def _post_forward(self, module: nn.Module, input: Any, output: Any):
        if self._hooks.in_pre_backward:
            return _cast_floating(output, self._output_dtype)
        self._hooks.post_forward_groups(_inside_backward(), _tensors_needing_grad(output))
        if self._state_ctx.iter_forward_root is self:
            output = self._force_complete_incomplete_states(output)
            # Note [keeping collective buffers alive across streams]: the last
            # forward all-gather output is released with the forward.
            self._comm_ctx.release_all_gather_state()
            self._state_ctx.iter_forward_root = None
        if self._output_dtype is None:
            return output
        with _profiler_range("FSDP::cast_forward_outputs"):
            return _cast_floating(output, self._output_dtype)

    def _root_pre_forward_on_device(self, args: tuple, kwargs: dict):
        """The root's forward on an accelerator, as upstream's: the all-gather
        streams wait for the compute stream (the optimizer step's updates to
        the shards), or for the user's post-optimizer event if one was set,
        and the inputs move to the device as DDP moves them."""
        event = self._state_ctx.post_optim_event
        if event is None:
            self._comm_ctx.root_pre_forward()
        else:
            self._state_ctx.post_optim_event = None
            handle = torch.get_device_module(self._device.type)
            for stream in self._comm_ctx.all_gather_streams():
                event.wait(handle.Stream(stream_id=stream.stream_id,
                                         device_index=stream.device_index,
                                         device_type=stream.device_type))
        if not (args or kwargs):
            return args, kwargs
        from torch.distributed.utils import _to_kwargs

        with _profiler_range("FSDP::inputs_to_device"):
            args_tuple, kwargs_tuple = _to_kwargs(args, kwargs, self._device, False)
        return args_tuple[0], kwargs_tuple[0]

    def _force_complete_incomplete_states(self, output: Any) -> Any:
        """Grouped states whose forward ran only some of their modules
        finish their post-forward with the root's."""
        for state in reversed(self._state_ctx.grouped_states):
            if state is self or not state._modules_to_run_forward:
                continue
            state._hooks.post_forward_groups(_inside_backward(), _tensors_needing_grad(output))
            output = _cast_floating(output, state._output_dtype)
            state._modules_to_run_forward.clear()
        return output

    # Backward ----------------------------------------------------------------

    def _root_post_backward_final_callback(self) -> None:
        """After autograd finishes: post_backward for groups autograd did not
        reach (the root, whose input needs no grad; unused modules), then
        complete every reduce-scatter so gradients are ready for the optimizer.
        Under manual finalization the groups that would reduce are left
        pending and nothing is waited for: the caller's finalize_backward
        does both."""
        ctx = self._state_ctx
        try:
            with _profiler_range("FSDP::root_post_backward_callback"):
                ctx.iter_forward_root = None
                for state in ctx.grouped_states:
                    state._modules_to_run_forward.clear()
                manual = ctx.manual_backward_finalization_active
                if manual is None:
                    manual = ctx.manual_backward_finalization_active = \
                        ctx.manual_backward_finalization
                finalize = ctx.is_last_backward and not manual
                # Every state's groups (the last first), then IDLE: one C++ call.
                ctx.hooks.finish_backward(finalize, manual)
                if manual:
                    # A grouped module's partial forward may hold the last
                    # all-gather output until here: not across microbatches.
                    self._comm_ctx.release_all_gather_state()
                else:
                    self._comm_ctx.finish_backward(finalize)
                    if finalize:
                        ctx.manual_backward_finalization_active = None
        finally:
            ctx.hooks.final_callback_done()

    # Note [manual backward finalization]
    # torch 2.15's pipelining schedules run a stage's microbatch backwards
    # with gradient sync off, then reduce as an action of their own: sync
    # on, FSDPModule.finalize_backward(), the optimizer. In that mode (set on
    # the root before forward) the end-of-backward callback reduces nothing:
    # a group autograd did not reach is marked post_backward-pending, as is
    # every group whose post_backward ran without sync. finalize_backward
    # then runs, for every state and group in reverse (autograd's order),
    # the pending post_backwards (reduce-scatter, all-reduce) or the
    # resharding, and ends the backward iteration: every reduction
    # completed, prefetch and forward-order bookkeeping dropped. With
    # async_op the end is left to the returned handle's wait(); until then
    # no forward and no second finalize may start, on this root or on any
    # root sharing its comm context (share_comm_ctx), which is why the
    # reduction in flight is kept on the comm context.

    def _start_finalize_backward(self, async_op: bool) -> Optional["GradientReduction"]:
        """FSDPModule.finalize_backward on the root after its lazy init: the
        reduction left in flight with async_op (its handle's to end), else None."""
        if self._state_ctx.gradient_reduction_pending:
            raise RuntimeError(
                "The previous gradient reduction must be waited on before finalizing backward "
                "again")
        if _active_gradient_reduction(self._comm_ctx) is not None:
            raise RuntimeError(
                "Another gradient reduction sharing this communication context must be waited "
                "on before finalizing backward")
        self._validate_finalize_backward()
        if not async_op:
            self._finalize_backward(wait=True)
            return None
        # Left in flight, this root's reductions would interleave with those
        # of another root sharing the comm context (share_comm_ctx), whose
        # end of backward completes every reduction on the context.
        groups = [group for state in self._state_ctx.all_states
                  for group in state._fsdp_param_groups]
        if self._comm_ctx.holds_groups_other_than(groups):
            raise RuntimeError(
                "Asynchronous gradient finalization cannot overlap work from another FSDP root "
                "sharing the communication context")
        reduction = GradientReduction(self._state_ctx)
        self._comm_ctx.active_gradient_reduction = reduction
        try:
            self._finalize_backward(wait=False)
        except BaseException:
            self._comm_ctx.active_gradient_reduction = None
            raise
        self._state_ctx.gradient_reduction_pending = True
        return reduction

    def _finalize_backward(self, wait: bool) -> None:
        """FSDPModule.finalize_backward's work (Note [manual backward
        finalization]), validated; with `wait` False the caller ends the
        iteration."""
        with _profiler_range("FSDP::finalize_backward"):
            for state in reversed(self._state_ctx.all_states):
                for group in reversed(state._fsdp_param_groups):
                    if group.post_backward_pending:
                        group.post_backward()
                    elif group.reshard_after_backward:
                        group.reshard()
                    group.training_state = TrainingState.IDLE
            if wait:
                self._end_backward_iteration()

    def _validate_finalize_backward(self) -> None:
        ctx = self._state_ctx
        if not self._is_root:
            raise RuntimeError("finalize_backward must be called on the root FSDP module")
        manual = ctx.manual_backward_finalization_active
        if manual is None:
            manual = ctx.manual_backward_finalization
        if not manual:
            raise RuntimeError(
                "FSDP finalize_backward requires manual backward finalization. Call "
                "set_manual_backward_finalization(True) before forward")
        if ctx.hooks.final_callback_queued:
            raise RuntimeError("FSDP finalize_backward must be called after backward completes")
        groups = [g for state in ctx.all_states for g in state._fsdp_param_groups]
        partial = next((g for g in groups if g.has_partial_reduce_output), None)
        if partial is not None:
            raise RuntimeError(
                "FSDP manual backward finalization does not support partial gradient "
                f"reductions for parameter group {partial.module_fqn or '<root>'!r}. Use "
                "automatic backward finalization for this configuration")
        no_all_reduce = next(
            (g for g in groups if g.post_backward_pending and g.reduce_grads
             and g.replicate_group is not None and not g.all_reduce_grads), None)
        if no_all_reduce is not None:
            raise RuntimeError(
                "FSDP manual backward finalization requires all-reduce for parameter group "
                f"{no_all_reduce.module_fqn or '<root>'!r}. Call set_requires_all_reduce(True) "
                "before finalization")

    def _end_backward_iteration(self) -> None:
        """Every reduction completed (the gradients are ready), then what the
        iteration kept for prefetching and ordering dropped."""
        self._comm_ctx.finish_backward(True)
        for state in self._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.finalize_backward()
        self._comm_ctx.release_all_gather_state()
        self._state_ctx.manual_backward_finalization_active = None

    def _wait_for_gradient_reduction(self, reduction: "GradientReduction") -> None:
        """A finalize_backward(async_op=True) handle's wait()."""
        if _active_gradient_reduction(self._comm_ctx) is not reduction:
            raise RuntimeError(
                "This gradient reduction handle was invalidated (reset_iter_state ran since "
                "finalize_backward)")
        self._end_backward_iteration()
        self._state_ctx.gradient_reduction_pending = False
        self._comm_ctx.active_gradient_reduction = None

    def _reset_iter_state(self) -> None:
        if self._is_root is False:
            raise RuntimeError("reset_iter_state() must be called on the root FSDP module")
        ctx = self._state_ctx
        reduction = _active_gradient_reduction(self._comm_ctx)
        if reduction is not None and reduction.owner is not ctx:
            raise RuntimeError(
                "reset_iter_state cannot reset a gradient reduction owned by another FSDP root "
                "sharing the communication context")
        self._comm_ctx.drop_reduces()
        for state in ctx.all_states or [self]:
            state._modules_to_run_forward.clear()
            state._training_state = TrainingState.IDLE
            for group in state._fsdp_param_groups:
                group.reset_iter_state()
                if _compat.RESET_ITER_STATE_DROPS_SHARDED_GRADS:
                    for param in group.params:
                        param.sharded_param.grad = None
        self._comm_ctx.finish_backward(True)
        ctx.iter_forward_root = None
        ctx.hooks.final_callback_done()
        ctx.manual_backward_finalization_active = None
        ctx.gradient_reduction_pending = False
        self._comm_ctx.active_gradient_reduction = None


class GradientReduction:
    """An asynchronous finalize_backward in flight: which root's it is (a
    root sharing the comm context may not reset it)."""

    def __init__(self, owner: StateContext) -> None:
        self.owner = owner


def _active_gradient_reduction(comm_ctx) -> Optional[GradientReduction]:
    """The comm context's asynchronous gradient reduction in flight, if any."""
    return getattr(comm_ctx, "active_gradient_reduction", None)


def _cast_floating(tree: Any, dtype: Optional[torch.dtype]) -> Any:
    """Floating-point tensors in ``tree`` cast to ``dtype`` (mixed precision's
    input and output casts); ``tree`` itself when dtype is None."""
    if dtype is None:
        return tree

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and tensor.dtype != dtype:
            return tensor.to(dtype)
        return tensor

    return tree_map_only(torch.Tensor, cast, tree)


def _tensors_needing_grad(output: Any) -> list:
    """The tensors of a module's output that the pre-backward hook goes on
    (none outside grad mode)."""
    if not torch.is_grad_enabled():
        return []
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    return [leaf for leaf in tree_flatten(output)[0]
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad]


def _pre_forward_groups(hooks, args: tuple, kwargs: dict):
    """The groups' pre_forward (C++), with the forward inputs that need
    gradients wrapped in each entering group's post-backward node
    (csrc/fsdp/post_backward_registration.hpp); the arguments rebuilt."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        # The common case, a few plain tensors: no pytree round trip.
        grad_args = [a for a in args if a.requires_grad]
        wrapped = hooks.pre_forward_groups(grad_args)
        if not grad_args:
            return args, kwargs
        outs = iter(wrapped)
        return tuple(next(outs) if a.requires_grad else a for a in args), kwargs
    leaves, spec = tree_flatten((args, kwargs))
    positions = [
        i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad
    ]
    wrapped = hooks.pre_forward_groups([leaves[i] for i in positions])
    if not positions:
        return args, kwargs
    for i, out in zip(positions, wrapped):
        leaves[i] = out
    return tree_unflatten(leaves, spec)
