"""torch_fsdp_ext: the ``fsdp_ext`` c10d backend.

``import torch_fsdp_ext`` registers the backend, after which
``torch.distributed.init_process_group("fsdp_ext")`` runs CPU collectives over
UCX (shared memory on one host, TCP/RDMA across hosts).
"""

import torch
import torch.distributed  # registers c10d's Backend base class before _C loads

from . import _C  # noqa: E402
from ._registration import BACKEND_NAME, register_backend  # noqa: E402

register_backend()

__all__ = ["BACKEND_NAME", "register_backend"]
__version__ = "0.1.0"
