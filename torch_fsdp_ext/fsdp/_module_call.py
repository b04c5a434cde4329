"""A sharded module's call when its only hooks are its state's C++ forward
hooks: the hooks and forward called straight, not through
``nn.Module._call_impl``'s general path.

Note [our modules' forward call]
torch takes ``_call_impl``'s general path for any module with a hook: it
builds a closure, walks the global and the module's hook dicts (merging them
into tuples), looks each hook up in the with-kwargs and always-called dicts
and wraps the call in a try. For a one-module state, whose only hooks are
the C++ pre/post forward hooks (csrc/fsdp/forward_hooks.hpp), that is several
microseconds per module and step for two calls. ``FSDPModule._call_impl``
(this function) makes exactly those two calls, in ``_call_impl``'s order and
with its handling of their results, when nothing else could observe the
difference: no other hook on the module (its four hook dicts hold our two and
nothing else), no global module hook, no keyword arguments, no TorchScript
tracing and no dynamo (which traces ``nn.Module._call_impl`` itself, so the
compiled graph is the one upstream's modules give). Anything else goes to
``nn.Module._call_impl`` unchanged. Grouped states (``fully_shard([a, b])``)
keep Python hooks and the general path.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.modules.module as _nn_module

_is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state
_general_call = nn.Module._call_impl


class ForwardHookPair(NamedTuple):
    """The hooks a state registered on its module, as registered (the
    objects, so the check is by identity), with their handles' ids."""

    pre_id: int
    pre: Callable
    post_id: int
    post: Callable


def _only_these_hooks(module: nn.Module, hooks: ForwardHookPair) -> bool:
    pre_hooks = module._forward_pre_hooks
    post_hooks = module._forward_hooks
    return (len(pre_hooks) == 1 and len(post_hooks) == 1
            and pre_hooks.get(hooks.pre_id) is hooks.pre
            and post_hooks.get(hooks.post_id) is hooks.post
            and not module._backward_hooks and not module._backward_pre_hooks
            and not (_nn_module._global_forward_pre_hooks or _nn_module._global_forward_hooks
                     or _nn_module._global_backward_pre_hooks
                     or _nn_module._global_backward_hooks))


def call_impl(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``FSDPModule._call_impl`` (Note [our modules' forward call])."""
    # Dynamo first: it traces this function, and must see nothing of the
    # hooks here (its package would pickle what it reads: the C++ hooks).
    if _is_compiling():
        return _general_call(module, *args, **kwargs)
    hooks = module._fsdp_forward_hook_pair
    if hooks is None or kwargs or _tracing_state() or not _only_these_hooks(module, hooks):
        return _general_call(module, *args, **kwargs)
    # The pre hook was registered with_kwargs: (module, args, kwargs), and
    # it may return None or (args, kwargs), as _call_impl checks.
    changed = hooks.pre(module, args, kwargs)
    if changed is not None:
        if not (isinstance(changed, tuple) and len(changed) == 2):
            raise RuntimeError("forward pre-hook must return None or a tuple "
                               f"of (new_args, new_kwargs), but got {changed}.")
        args, kwargs = changed
    result = module.forward(*args, **kwargs)
    replaced = hooks.post(module, args, result)
    return result if replaced is None else replaced
