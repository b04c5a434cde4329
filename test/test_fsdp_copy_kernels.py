"""The C++ FSDP copy kernels produce exactly upstream FSDP2's layouts: checked
against the torch ops upstream uses (narrow + foreach copy for the all-gather
copy-in, split_with_sizes_copy for the copy-out, _chunk_cat for the
reduce-scatter input), for uneven dim-0 sizes, awkward shapes and dtypes."""

import pytest
import torch

from torch_fsdp_ext import _C

SHAPES = [(5, 3), (1,), (7,), (8191,), (4, 2, 3), (0, 4), (3, 1)]
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def values(shape, dtype, salt):
    numel = 1
    for size in shape:
        numel *= size
    return (torch.arange(numel) * 7 + salt).remainder(251).to(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_gather_copy_in_and_out_match_upstream(dtype, world_size):
    for rank in range(world_size):
        shards = [values(shape, dtype, salt=10 * i + rank) for i, shape in enumerate(SHAPES)]
        splits = [s.numel() for s in shards]
        total = sum(splits)
        ours = torch.full((total * world_size,), -1).to(dtype)
        chunk = _C._fsdp_all_gather_copy_in(shards, ours, rank, world_size)
        expected = torch.full((total * world_size,), -1).to(dtype)
        upstream_input = expected.narrow(0, total * rank, total)
        torch._foreach_copy_(list(torch.split(upstream_input, splits)),
                             [s.reshape(-1) for s in shards])
        assert torch.equal(ours, expected)
        assert chunk.data_ptr() == ours.data_ptr() + total * rank * ours.element_size()
    # Copy-out of a full all-gather output (every rank's chunk filled).
    gathered = values((sum(s.numel() for s in shards) * world_size,), dtype, salt=3)
    outs = [torch.empty(world_size, n, dtype=dtype) for n in splits]
    _C._fsdp_all_gather_copy_out(gathered, splits, world_size, outs)
    expected = [torch.empty(world_size, n, dtype=dtype) for n in splits]
    torch.split_with_sizes_copy(gathered.view(world_size, -1), splits, dim=1, out=expected)
    for mine, theirs in zip(outs, expected):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reduce_scatter_copy_in_matches_chunk_cat(dtype, world_size):
    # torch._chunk_cat rejects empty tensors, so the reference case leaves them out.
    grads = [values(shape, dtype, salt=i) for i, shape in enumerate(SHAPES) if 0 not in shape]
    row = sum(_padded_chunk(g.shape, world_size) for g in grads)
    ours = torch.full((world_size * row,), -1).to(dtype)
    _C._fsdp_reduce_scatter_copy_in(grads, world_size, ours)
    expected = torch.empty(world_size, row, dtype=dtype)
    torch._chunk_cat(grads, dim=0, num_chunks=world_size, out=expected)
    assert torch.equal(ours.view(world_size, row), expected)


def test_reduce_scatter_copy_in_of_an_empty_gradient_is_empty():
    out = torch.full((4,), 7.0)
    _C._fsdp_reduce_scatter_copy_in([torch.empty(0, 4), torch.ones(2)], 4, out)
    assert torch.equal(out, torch.tensor([1.0, 1.0, 0.0, 0.0]))


def _padded_chunk(shape, world_size):
    rows = -(-shape[0] // world_size)
    numel = rows
    for size in shape[1:]:
        numel *= size
    return numel


def test_bad_input_is_a_clear_error():
    shards = [torch.ones(3), torch.ones(2)]
    with pytest.raises(ValueError, match="all_gather_copy_in: the output has 36 bytes but "
                       r"world_size \* \(sum of shard sizes\) is 40"):
        _C._fsdp_all_gather_copy_in(shards, torch.empty(9), 0, 2)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        _C._fsdp_all_gather_copy_in(shards, torch.empty(10), 2, 2)
    with pytest.raises(TypeError, match="shard 1's all-gather dtype has dtype Int but the flat "
                       "buffer's dtype is Float"):
        _C._fsdp_all_gather_copy_in([torch.ones(3), torch.ones(2, dtype=torch.int32)],
                                    torch.empty(10), 0, 2)
    with pytest.raises(ValueError, match="must be contiguous"):
        _C._fsdp_all_gather_copy_in([torch.ones(4, 4).t()], torch.empty(32), 0, 2)
    with pytest.raises(ValueError, match="output 0 has 5 elements, expected 6"):
        _C._fsdp_all_gather_copy_out(torch.empty(10), [3, 2], 2, [torch.empty(5), torch.empty(4)])
    with pytest.raises(ValueError, match="reduce_scatter_copy_in: the output has 4 elements"):
        _C._fsdp_reduce_scatter_copy_in([torch.ones(5)], 2, torch.empty(4))
    with pytest.raises(ValueError, match="0-dim"):
        _C._fsdp_reduce_scatter_copy_in([torch.tensor(1.0)], 2, torch.empty(2))
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        _C._fsdp_reduce_scatter_copy_in([torch.ones(2)], 0, torch.empty(2))


def test_subclass_tensors_are_copied_through_their_own_ops():
    """Tensors a Python subclass answers (fake tensors, quantised wrappers)
    have no data where their data pointer says (a wrapper's is null): the
    kernels copy them with ATen ops, which the subclass answers, and the
    bytes are those of the plain tensors. Subclass outputs of the copy-out
    keep their version (they are the unsharded parameters' memory)."""
    from fsdp_testing import WrapperWeight

    shards = [values((5, 3), torch.float32, salt=1), values((7,), torch.float32, salt=2)]
    plain = torch.zeros(44)
    _C._fsdp_all_gather_copy_in(shards, plain, 1, 2)
    wrapped = torch.zeros(44)
    _C._fsdp_all_gather_copy_in([WrapperWeight(s) for s in shards], wrapped, 1, 2)
    assert torch.equal(wrapped, plain) and plain.abs().sum() > 0

    reference = [torch.empty(30), torch.empty(14)]
    _C._fsdp_all_gather_copy_out(plain, [15, 7], 2, reference)
    outputs = [WrapperWeight(torch.zeros(30)), WrapperWeight(torch.zeros(14))]
    versions = [out._version for out in outputs]
    _C._fsdp_all_gather_copy_out(plain, [15, 7], 2, outputs)
    for out, expected in zip(outputs, reference):
        assert torch.equal(out._data, expected)
    assert [out._version for out in outputs] == versions

    grads = [values((5, 3), torch.float32, salt=3), values((3,), torch.float32, salt=4)]
    plain = torch.empty(2 * (9 + 2))
    _C._fsdp_reduce_scatter_copy_in(grads, 2, plain)
    wrapped = torch.empty(22)
    _C._fsdp_reduce_scatter_copy_in([WrapperWeight(g) for g in grads], 2, wrapped)
    assert torch.equal(wrapped, plain)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_copy_in_casts_to_the_all_gather_dtype(world_size):
    """Mixed precision: fp32 shards gathered in bf16 land as shard.to(bf16)."""
    shards = [values(shape, torch.float32, salt=i) / 7 for i, shape in enumerate(SHAPES)]
    total = sum(s.numel() for s in shards)
    rank = world_size - 1
    out = torch.zeros(total * world_size, dtype=torch.bfloat16)
    _C._fsdp_all_gather_copy_in(shards, out, rank, world_size,
                                [torch.bfloat16] * len(shards))
    expected = torch.cat([s.reshape(-1).to(torch.bfloat16) for s in shards])
    assert torch.equal(out.narrow(0, total * rank, total), expected)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parameters_of_several_dtypes_travel_as_bytes(world_size):
    """A uint8 flat buffer carries fp32, bf16 and int64 parameters: each rank's
    chunk holds their bytes back to back, and copy-out restores every dtype."""
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bfloat16]
    shapes = [(5, 3), (7,), (3,), (1,)]
    per_rank = [[values(shape, dtype, salt=10 * i + r) for i, (shape, dtype) in
                 enumerate(zip(shapes, dtypes))] for r in range(world_size)]
    chunk_bytes = sum(s.numel() * s.element_size() for s in per_rank[0])
    flat = torch.zeros(chunk_bytes * world_size, dtype=torch.uint8)
    for r in range(world_size):
        _C._fsdp_all_gather_copy_in(per_rank[r], flat, r, world_size, dtypes)
    outs = [torch.empty(world_size * s.numel(), dtype=s.dtype) for s in per_rank[0]]
    _C._fsdp_all_gather_copy_out(flat, [s.numel() for s in per_rank[0]], world_size, outs)
    for i, out in enumerate(outs):
        expected = torch.cat([per_rank[r][i].reshape(-1) for r in range(world_size)])
        assert out.dtype == dtypes[i] and torch.equal(out, expected), i
    with pytest.raises(TypeError, match="output 0 has dtype Float but the flat buffer's dtype "
                       "is BFloat16"):
        _C._fsdp_all_gather_copy_out(torch.empty(2, dtype=torch.bfloat16), [1], 2,
                                     [torch.empty(2)])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.float16])
def test_reduce_scatter_copy_in_casts_to_the_reduce_dtype(world_size, reduce_dtype):
    """bf16 gradients written into a reduce-dtype buffer: the same bytes as
    torch._chunk_cat of the gradients cast first (casting is exact per element)."""
    # torch._chunk_cat rejects empty tensors: the reference case leaves them out.
    grads = [values(shape, torch.bfloat16, salt=i) for i, shape in enumerate(SHAPES)
             if 0 not in shape]
    numel = sum(-(-g.shape[0] // world_size) * (g.numel() // g.shape[0]) for g in grads)
    ours = torch.full((numel * world_size,), -1.0, dtype=reduce_dtype)
    _C._fsdp_reduce_scatter_copy_in(grads, world_size, ours)
    expected = torch._chunk_cat([g.to(reduce_dtype) for g in grads], 0, world_size)
    assert torch.equal(ours, expected.reshape(-1))


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("shape,dim", [((4, 6), 1), ((2, 3, 12), 2), ((5, 6, 2), 1)])
def test_layouts_of_a_parameter_sharded_on_another_dim(world_size, shape, dim):
    """Shard(d > 0): rank r's shard is chunk r along d; the copy-out rebuilds
    the tensor along d (torch.cat of the chunks) and the reduce-scatter input
    row r holds chunk r along d, flattened. A dim-0 neighbour keeps its layout."""
    full = values(shape, torch.float32, salt=5)
    other = values((5, 2), torch.float32, salt=9)
    chunks = [c.contiguous() for c in full.chunk(world_size, dim)]
    other_rows = -(-other.shape[0] // world_size)
    padded_other = torch.zeros(other_rows * world_size, 2)
    padded_other[:other.shape[0]] = other
    gathered = torch.cat([torch.cat([chunks[r].reshape(-1),
                                     padded_other[r * other_rows:(r + 1) * other_rows].reshape(-1)])
                          for r in range(world_size)])
    out_full = torch.empty(shape)
    out_other = torch.empty(other_rows * world_size * 2)
    _C._fsdp_all_gather_copy_out(gathered, [chunks[0].numel(), other_rows * 2], world_size,
                                 [out_full, out_other], [dim, 0])
    assert torch.equal(out_full, full)
    assert torch.equal(out_other.view(-1, 2)[:other.shape[0]], other)
    rs_input = torch.empty(gathered.numel())
    _C._fsdp_reduce_scatter_copy_in([full, other], world_size, rs_input, [dim, 0])
    assert torch.equal(rs_input, gathered)


# The device implementations (torch's fused ops: cat, split_with_sizes_copy,
# _chunk_cat), which a CUDA mesh runs, are callable on host tensors: here they
# must write exactly the host loops' bytes, at the matrix's corners (mixed
# dtypes in a byte buffer, a cast, a dim-1 shard, an empty and a 1-element
# parameter, world sizes 1 and 3).
DEVICE_CASES = [
    # (shapes, parameter dtypes, gather dtypes, shard dims)
    ([(5, 3), (1,), (0, 4), (7,)], [torch.float32] * 4, [torch.float32] * 4, [0, 0, 0, 0]),
    ([(5, 3), (7,), (3,)], [torch.float32, torch.bfloat16, torch.int64],
     [torch.float32, torch.bfloat16, torch.int64], [0, 0, 0]),
    ([(4, 6), (3,)], [torch.float32] * 2, [torch.bfloat16] * 2, [0, 0]),
    ([(3, 6), (5,), (2, 3, 6)], [torch.float32] * 3, [torch.float32] * 3, [1, 0, 2]),
]


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("case", range(len(DEVICE_CASES)))
def test_device_implementations_write_the_host_layouts(case, world_size):
    shapes, dtypes, gather_dtypes, dims = DEVICE_CASES[case]
    # Rank r's shard of each parameter: its r-th chunk along its shard dim
    # (dim 0 padded to the chunk size, as the runtime pads it).
    full = [values(shape, dtype, salt=3 * i + 1) for i, (shape, dtype) in
            enumerate(zip(shapes, dtypes))]

    def shard(t, dim, r):
        if dim == 0:
            rows = -(-t.shape[0] // world_size) if t.shape[0] else 0
            padded = torch.zeros((rows * world_size, *t.shape[1:]), dtype=t.dtype)
            padded[: t.shape[0]] = t
            return padded.narrow(0, rows * r, rows).contiguous()
        return t.chunk(world_size, dim)[r].contiguous()

    if any(d and s[d] % world_size for s, d in zip(shapes, dims)):
        pytest.skip("uneven Shard(d > 0) is not a valid layout")
    buffer_dtype = gather_dtypes[0] if len(set(gather_dtypes)) == 1 else torch.uint8
    chunk_bytes = sum(shard(t, d, 0).numel() * g.itemsize
                      for t, d, g in zip(full, dims, gather_dtypes))
    elements = chunk_bytes // buffer_dtype.itemsize
    host = torch.full((elements * world_size,), 0).to(buffer_dtype)
    device = host.clone()
    for r in range(world_size):
        shards = [shard(t, d, r) for t, d in zip(full, dims)]
        _C._fsdp_all_gather_copy_in(shards, host, r, world_size, gather_dtypes)
        _C._fsdp_device_all_gather_copy_in(shards, gather_dtypes,
                                           device.narrow(0, elements * r, elements))
    assert torch.equal(host.view(torch.uint8), device.view(torch.uint8))

    splits = [shard(t, d, 0).numel() for t, d in zip(full, dims)]

    def outputs():
        # A dim-0 parameter's output is flat (world x split); a Shard(d > 0)
        # one has the unsharded shape.
        return [torch.zeros(t.shape if d else (s * world_size,), dtype=g)
                for s, g, t, d in zip(splits, gather_dtypes, full, dims)]

    host_outs, device_outs = outputs(), outputs()
    _C._fsdp_all_gather_copy_out(host, splits, world_size, host_outs, dims)
    _C._fsdp_device_all_gather_copy_out(device, splits, world_size, device_outs, dims)
    for mine, theirs in zip(device_outs, host_outs):
        assert torch.equal(mine, theirs)

    grads = [values(shape, dtypes[0], salt=5 * i + 2) for i, shape in enumerate(shapes)]
    row = sum(shard(g, d, 0).numel() for g, d in zip(grads, dims))
    reduce_dtype = torch.bfloat16 if case == 2 else dtypes[0]
    host_in = torch.full((row * world_size,), 0).to(reduce_dtype)
    device_in = torch.full((row * world_size,), 9).to(reduce_dtype)
    _C._fsdp_reduce_scatter_copy_in(grads, world_size, host_in, dims)
    _C._fsdp_device_reduce_scatter_copy_in(grads, world_size, device_in, dims)
    assert torch.equal(host_in, device_in)
