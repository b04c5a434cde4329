"""Which ways of sharing device memory between processes work on this machine,
as the group's IPC route finds them (the GPU script's first step after the
build; a few seconds):

    torchrun --standalone --nproc-per-node 2 test/gpu/probe_sharing.py

Two ranks on the one GPU make a group per FSDP_EXT_CUDA_IPC_HANDLES value
(auto, legacy, descriptors; the variable is read when a group is made), each
all-reduces a buffer allocated from the group, and rank 0 prints the route the
group took (``backend.cuda_route``: which handles, or why it staged), whether
the result was right, and whether the op was read in place (not staged). A
failure is printed, not raised: the probe reports, the tests decide. Exits 1
when no group gave the right result.
"""

import os
import sys
import traceback

import torch
import torch.distributed as dist

import torch_fsdp_ext  # noqa: F401  (registers the backend)


def probe(handles, rank, world, dev):
    os.environ["FSDP_EXT_CUDA_IPC_HANDLES"] = handles
    group = dist.new_group(backend="fsdp_ext")
    try:
        backend = group._get_backend(dev)
        first = torch.ones(1, device=dev)
        dist.all_reduce(first, group=group)  # chooses the route
        if not backend.supports_tensor_alloc(dev):
            return f"route: {backend.cuda_route}; no buffers from the group", first.item() == world
        values = backend.allocate_tensor(8191, dtype=torch.float32, device=dev)
        values.copy_(torch.arange(8191, dtype=torch.float32, device=dev) * (rank + 1))
        before = backend._cuda_counters()["staged_ops"]
        dist.all_reduce(values, group=group)
        staged = backend._cuda_counters()["staged_ops"] - before
        expected = torch.arange(8191, dtype=torch.float32) * (world * (world + 1) // 2)
        right = torch.equal(values.cpu(), expected)
        return (f"route: {backend.cuda_route}; group buffer "
                f"{'staged' if staged else 'read in place'}"), right
    finally:
        dist.destroy_process_group(group)


def main():
    os.environ.setdefault("FSDP_EXT_CUDA_PATH", "ipc")
    dist.init_process_group("fsdp_ext")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    any_right = False
    for handles in ("auto", "legacy", "descriptors"):
        try:
            what, right = probe(handles, rank, world, dev)
        except Exception as error:  # the probe reports every outcome
            what, right = f"{type(error).__name__}: {error}", False
            if rank == 0:
                traceback.print_exc()
        any_right |= right
        if rank == 0:
            print(f"FSDP_EXT_CUDA_IPC_HANDLES={handles}: {'right' if right else 'WRONG'}; {what}",
                  flush=True)
    dist.destroy_process_group()
    sys.exit(0 if any_right else 1)


if __name__ == "__main__":
    main()
