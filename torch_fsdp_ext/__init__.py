"""torch_fsdp_ext: the ``fsdp_ext`` c10d backend and our FSDP2.

``import torch_fsdp_ext`` registers the backend, after which
``torch.distributed.init_process_group("fsdp_ext")`` runs CPU collectives over
UCX (shared memory on one host, TCP/RDMA across hosts).
``from torch_fsdp_ext import fully_shard`` is a drop-in for
``torch.distributed.fsdp.fully_shard`` over any backend.
"""

import torch
import torch.distributed  # registers c10d's Backend base class before _C loads

from . import _native  # noqa: E402,F401  (loads _C, after checking what it was built against)
from ._registration import BACKEND_NAME, register_backend  # noqa: E402
from ._monitored_barrier import monitored_barrier  # noqa: E402
from ._flight_recorder import dump_flight_recorder, flight_recorder_enabled  # noqa: E402

register_backend()

from . import fsdp  # noqa: E402
from .fsdp import *  # noqa: E402,F401,F403  (fully_shard and the rest of the FSDP API)

__all__ = [
    "BACKEND_NAME",
    "dump_flight_recorder",
    "flight_recorder_enabled",
    "monitored_barrier",
    "register_backend",
] + fsdp.__all__
__version__ = "0.1.0"
