"""torch's Flight Recorder for fsdp_ext groups.

With ``TORCH_FR_BUFFER_SIZE`` set (> 0), the last that many ops of every
fsdp_ext group in the process are recorded in torch's dump format. A
collective that fails (timeout, lost peer, size mismatch) writes the dump
once, to torch's file for the rank (``TORCH_FR_DUMP_TEMP_FILE`` followed by
the global rank); ``dump_flight_recorder`` writes or returns it on request.
torch's analyser reads the files of all ranks::

    python -m torch.distributed.flight_recorder.fr_trace DIR --prefix PREFIX
"""

import pickle

import torch.distributed as dist

from . import _C


def flight_recorder_enabled() -> bool:
    """Whether fsdp_ext ops are being recorded (``TORCH_FR_BUFFER_SIZE`` > 0)."""
    return _C._flight_recorder_enabled()


def dump_flight_recorder(write: bool = True, only_active: bool = False):
    """The recorded ops of this process's fsdp_ext groups.

    ``write=True`` writes torch's dump file for this rank and returns its
    path; ``write=False`` returns the dump as a dict (torch's format:
    ``version``, ``pg_config``, ``entries``, ...). ``only_active`` keeps only
    the ops not yet completed.
    """
    if not _C._flight_recorder_enabled():
        raise RuntimeError(
            "torch_fsdp_ext.dump_flight_recorder: the Flight Recorder is off; set "
            "TORCH_FR_BUFFER_SIZE (e.g. 2000) before the process groups are created"
        )
    if not write:
        return pickle.loads(_C._flight_recorder_dump(only_active))
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        return _C._flight_recorder_write(rank)
    except RuntimeError as error:
        raise RuntimeError(f"torch_fsdp_ext.dump_flight_recorder (rank {rank}): {error}") from None
