"""The FSDP event trace: what the C++ state machine did, in order.

Upstream's tests patch private methods to see the order of unshard, reshard
and post_backward calls (that is how prefetching is checked). Our runtime
reports those events itself::

    with trace_fsdp_events() as events:
        loss = model(x).sum()
        loss.backward()
    events[0]  # FSDPEvent(event='unshard', module_fqn='', training_state=TrainingState.FORWARD)

Conventions match upstream's test recorders: ``unshard`` is recorded when a
group's unshard starts real work (no all-gather pending, not yet unsharded),
tagged with the group's training state at that moment (a prefetch carries
FORWARD or PRE_BACKWARD); ``reshard`` on every reshard except forward-time
calls of a group that keeps its parameters unsharded after forward;
``post_backward`` when a group's post-backward returns.
"""

import contextlib
from typing import Iterator, NamedTuple

from .. import _C


# The C++ runtime's enums (csrc/fsdp/training_state.hpp), with upstream's
# member names and values: one definition, read and set without conversion.
TrainingState = _C.TrainingState
ShardedState = _C.ShardedState


class FSDPEvent(NamedTuple):
    event: str  # "unshard", "reshard" or "post_backward"
    module_fqn: str  # the group's modules relative to the root ("" for the root)
    training_state: TrainingState


_sinks: list = []


def _install_top_sink() -> None:
    if not _sinks:
        _C._fsdp_set_trace_sink(None)
        return
    events = _sinks[-1]

    def record(event: str, module_fqn: str, state: TrainingState) -> None:
        events.append(FSDPEvent(event, module_fqn, state))

    _C._fsdp_set_trace_sink(record)


@contextlib.contextmanager
def trace_fsdp_events() -> Iterator[list]:
    """Records every FSDP group event inside the block into the yielded list.

    Nested traces record into the innermost list only.
    """
    events: list = []
    _sinks.append(events)
    _install_top_sink()
    try:
        yield events
    finally:
        _sinks.remove(events)
        _install_top_sink()
