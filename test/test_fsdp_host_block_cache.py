"""The host block cache behind fully_shard's host buffers
(csrc/fsdp/host_block_cache.hpp): a freed block is kept for the next
allocation of its size, idle memory stays under its limit, and blocks are
given back from any thread."""

import gc
import threading

import torch

import torch_fsdp_ext._C as _C


def _fresh_cache():
    gc.collect()  # blocks of tensors an earlier test left for the collector
    _C._fsdp_host_cache_release_idle()
    assert _C._fsdp_host_cache_idle_bytes() == 0


def test_a_freed_block_is_reused_by_the_next_allocation_of_its_size():
    _fresh_cache()
    first = _C._fsdp_host_cache_empty(8191, torch.float32)
    address = first.data_ptr()
    first.fill_(3.0)
    del first
    assert _C._fsdp_host_cache_idle_bytes() == 8191 * 4
    other_size = _C._fsdp_host_cache_empty(3, torch.float32)  # a size of its own
    assert other_size.data_ptr() != address
    again = _C._fsdp_host_cache_empty(8191 * 2, torch.bfloat16)  # the same bytes
    assert again.data_ptr() == address, (hex(again.data_ptr()), hex(address))
    assert _C._fsdp_host_cache_idle_bytes() == 0
    again.copy_(torch.arange(8191 * 2, dtype=torch.bfloat16))  # writable, the right size
    assert again[-1].item() == torch.tensor(8191 * 2 - 1, dtype=torch.bfloat16).item()


def test_idle_memory_stays_under_the_limit_the_oldest_going_first():
    _fresh_cache()
    limit = _C._fsdp_host_cache_idle_limit
    large = _C._fsdp_host_cache_empty(limit // 4 + 1, torch.float32)  # just over the limit
    del large
    assert _C._fsdp_host_cache_idle_bytes() == 0
    third = limit // 3 // 4  # float32 elements of a block a third of the limit
    blocks = [_C._fsdp_host_cache_empty(third, torch.float32) for _ in range(3)]
    del blocks  # all three fit
    assert _C._fsdp_host_cache_idle_bytes() == 3 * third * 4
    # A fourth, of another size (one element more), pushes out the oldest.
    newcomer = _C._fsdp_host_cache_empty(third + 1, torch.float32)
    address = newcomer.data_ptr()
    del newcomer
    idle = _C._fsdp_host_cache_idle_bytes()
    assert idle == 2 * third * 4 + (third + 1) * 4, (idle, limit)
    assert _C._fsdp_host_cache_empty(third + 1, torch.float32).data_ptr() == address
    _C._fsdp_host_cache_release_idle()
    assert _C._fsdp_host_cache_idle_bytes() == 0


def test_blocks_freed_on_other_threads_come_back():
    _fresh_cache()
    tensors = [_C._fsdp_host_cache_empty(1, torch.int64) for _ in range(64)]

    def drop(chunk):
        chunk.clear()

    chunks = [tensors[i::4] for i in range(4)]
    del tensors
    threads = [threading.Thread(target=drop, args=(chunk,)) for chunk in chunks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert _C._fsdp_host_cache_idle_bytes() == 64 * 8
    _C._fsdp_host_cache_release_idle()
