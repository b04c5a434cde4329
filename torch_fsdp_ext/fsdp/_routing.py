"""use_as_fully_shard(): one explicit call that makes
``torch.distributed.fsdp.fully_shard`` ours, so a framework's FSDP2 path
(which calls upstream's by name) runs on our runtime unchanged.

Nothing is routed on import. The call replaces upstream's function where code
finds it by name:

- torch's public paths: ``torch.distributed.fsdp``, its ``_fully_shard``
  package, and the older ``torch.distributed._composable.fsdp`` (and its
  ``fully_shard`` module);
- module globals bound to upstream's function object outside torch, i.e.
  frameworks that ran ``from torch.distributed.fsdp import fully_shard``
  before the call.

torch's own internal modules keep upstream's function: upstream's body reads
its own module global ``fully_shard`` (``fully_shard.state``), and routing it
would break upstream's runtime for modules it shards itself.

Modules imported while routed and binding the name then hold ours after undo;
undo restores exactly what the call replaced.
"""

from __future__ import annotations

import importlib
import logging
import sys

# Upstream's function from the module that defines it, which routing never
# touches (the public attribute could already be someone's patch).
from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as _UPSTREAM_FULLY_SHARD

from ._module import fully_shard as _our_fully_shard

logger = logging.getLogger(__name__)

# Where torch exposes fully_shard publicly (module name, attribute).
_TORCH_PATHS = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)


class FullyShardRouting:
    """What ``use_as_fully_shard()`` returns: ``undo()`` ends the routing, and
    so does leaving a ``with`` block around it. Routings nest: upstream's
    function comes back when the last active one ends."""

    def __init__(self) -> None:
        self._active = False

    def __enter__(self) -> "FullyShardRouting":
        return self

    def __exit__(self, *exc_info) -> None:
        self.undo()

    @property
    def active(self) -> bool:
        return self._active

    def undo(self) -> None:
        """Ends this routing (again: nothing); the last to end restores upstream's."""
        if not self._active:
            return
        self._active = False
        _active_routings.remove(self)
        if not _active_routings:
            _restore()


_active_routings: list[FullyShardRouting] = []
# (module, attribute) pairs the first active routing pointed at ours.
_replaced: list[tuple[object, str]] = []


def use_as_fully_shard() -> FullyShardRouting:
    """Makes ``torch.distributed.fsdp.fully_shard`` (and its older path
    ``torch.distributed._composable.fsdp.fully_shard``) ours until undone::

        torch_fsdp_ext.use_as_fully_shard()            # for the whole program
        with torch_fsdp_ext.use_as_fully_shard():      # or for a block
            trainer.fit(model)

    Our sharded modules are instances of upstream's ``FSDPModule``, so the
    framework's checks and upstream's public functions accept them."""
    routing = FullyShardRouting()
    if not _active_routings:
        _route()
    routing._active = True
    _active_routings.append(routing)
    return routing


def _skipped_by_scan(module_name: str) -> bool:
    """torch's internals (see the module docstring) and this package, whose
    own reference to upstream's function is how routing is undone."""
    return any(module_name == top or module_name.startswith(top + ".")
               for top in ("torch", __name__.split(".")[0]))


def _route() -> None:
    # Imported here if not yet: a torch path imported later, while routed,
    # would bind ours at its import and keep it after undo.
    targets = [(importlib.import_module(name), "fully_shard") for name in _TORCH_PATHS]
    framework_globals = []
    for module_name, module in list(sys.modules.items()):
        if module is None or _skipped_by_scan(module_name):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if value is _UPSTREAM_FULLY_SHARD:
                targets.append((module, attr))
                framework_globals.append(f"{module_name}.{attr}")
    for module, attr in targets:
        if getattr(module, attr, None) is _UPSTREAM_FULLY_SHARD:
            setattr(module, attr, _our_fully_shard)
            _replaced.append((module, attr))
    logger.info(
        "torch_fsdp_ext.use_as_fully_shard: torch.distributed.fsdp.fully_shard is "
        "torch_fsdp_ext's until undone (%d names routed; imported earlier by: %s)",
        len(_replaced), ", ".join(framework_globals) or "none",
    )


def _restore() -> None:
    restored = 0
    while _replaced:
        module, attr = _replaced.pop()
        # Something else may have rebound the name since: leave that alone.
        if getattr(module, attr, None) is _our_fully_shard:
            setattr(module, attr, _UPSTREAM_FULLY_SHARD)
            restored += 1
    logger.info("torch_fsdp_ext.use_as_fully_shard: undone, upstream's fully_shard "
                "restored in %d places", restored)
