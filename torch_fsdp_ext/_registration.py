"""Registers ``fsdp_ext`` with torch.distributed (once per process)."""

import atexit
import warnings

import torch
import torch.distributed as dist

from . import _build_info, _C

BACKEND_NAME = "fsdp_ext"


def _create_backend(dist_backend_opts, backend_options):
    """Factory torch.distributed calls for every group that uses fsdp_ext."""
    if backend_options is not None:
        # pg_options= of init_process_group / new_group: options of another
        # backend's type (gloo's, NCCL's). Nothing in them applies here; the
        # group's timeout comes from timeout=, tuning from FSDP_EXT_* variables.
        warnings.warn(
            f"fsdp_ext group {dist_backend_opts.group_id!r}: pg_options "
            f"({type(backend_options).__name__}) are ignored; the fsdp_ext backend takes its "
            "timeout from timeout= and its tuning from FSDP_EXT_* environment variables "
            "(docs/configuration.md)",
            UserWarning,
            stacklevel=2,
        )
    return _C.FsdpExtBackend(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout,  # a timedelta
        str(dist_backend_opts.group_id),
        _nccl_factory(dist_backend_opts),
        list(dist_backend_opts.global_ranks_in_group),
    )


def _nccl_factory(dist_backend_opts):
    """How the group's CUDA path makes torch's own NCCL group over the same
    ranks, when its ranks have GPUs of their own (backend/cuda/cuda_path.hpp):
    called at the group's first CUDA op, if ever. None where this build or
    this torch has no CUDA or no NCCL."""
    if not (_build_info.WITH_CUDA and torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    store = dist.PrefixStore("fsdp_ext/nccl/", dist_backend_opts.store)
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    timeout = dist_backend_opts.timeout
    # The outer group's identity, as torch gives its own NCCL groups: NCCL's
    # logs and flight recorder then name the group and its global ranks.
    global_ranks = list(dist_backend_opts.global_ranks_in_group)
    group_name = str(dist_backend_opts.group_id)

    def make():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.global_ranks_in_group = global_ranks
        options.group_name = group_name
        return dist.ProcessGroupNCCL(store, rank, size, options)

    return make


def register_backend() -> None:
    """Register the backend name; a second call (or import) does nothing."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    # One name for every device: CPU tensors take the UCX path, CUDA tensors
    # the group's CUDA path (NCCL, CUDA IPC or staged through host memory);
    # a build without CUDA refuses them with a clear error.
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )
    # Stop progress threads and release UCX before the interpreter tears down.
    atexit.register(_C._shutdown_all)
