"""Registers ``fsdp_ext`` with torch.distributed (once per process)."""

import atexit

import torch.distributed as dist

from . import _C

BACKEND_NAME = "fsdp_ext"


def _create_backend(dist_backend_opts, backend_options):
    """Factory torch.distributed calls for every group that uses fsdp_ext."""
    return _C.FsdpExtBackend(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout,  # a timedelta
        str(dist_backend_opts.group_id),
    )


def register_backend() -> None:
    """Register the backend name; a second call (or import) does nothing."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    # One name for every device: CPU tensors take the UCX path, CUDA tensors
    # get a clear error until the NCCL path exists.
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )
    # Stop progress threads and release UCX before the interpreter tears down.
    atexit.register(_C._shutdown_all)
