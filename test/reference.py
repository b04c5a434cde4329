"""Closed-form inputs and expected results for collective tests.

Every rank builds every rank's input from (rank, element index), so any rank
can compute the exact expected output locally without communication.
"""

import functools

import torch
import torch.distributed as dist

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]
SIZES = [0, 1, 3, 8191]
FLOAT_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM", "PREMUL_SUM_TENSOR"]
INTEGER_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
PREMUL_FACTOR = 0.5


def ops_for(dtype):
    return FLOAT_OPS if dtype.is_floating_point else INTEGER_OPS


def reduce_op(name):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    if name == "PREMUL_SUM_TENSOR":
        return dist._make_nccl_premul_sum(torch.tensor([PREMUL_FACTOR], dtype=torch.float64))
    return getattr(dist.ReduceOp, name)


def make_input(rank, numel, dtype, op_name, salt=0):
    """Small integer-valued data: exact in every dtype, no overflow for 4 ranks."""
    idx = torch.arange(numel, dtype=torch.int64) + salt
    if op_name == "PRODUCT":
        values = 1 + (idx + rank) % 2
    elif op_name in ("MIN", "MAX"):
        values = (idx * 3 + rank * 5) % 11
        if dtype not in (torch.uint8, torch.bool):
            values = values - 5
    elif op_name in ("BAND", "BOR", "BXOR"):
        values = (idx * 7 + rank * 13) % 64
    else:
        values = idx % 5 + rank
    if dtype == torch.bool:
        return (values % 2) == 0
    return values.to(dtype)


def expected_reduction(inputs, op_name, dtype, world_size):
    """Reduce a list of per-rank tensors in float64/int64 and cast back."""
    if dtype == torch.bool:
        stacked = torch.stack(inputs)
        if op_name in ("SUM", "MAX", "BOR"):
            return stacked.any(0)
        if op_name in ("PRODUCT", "MIN", "BAND"):
            return stacked.all(0)
        return functools.reduce(torch.logical_xor, inputs)
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    stacked = torch.stack([t.to(wide) for t in inputs])
    if op_name == "SUM":
        result = stacked.sum(0)
    elif op_name == "AVG":
        result = stacked.sum(0) / world_size
    elif op_name.startswith("PREMUL_SUM"):
        result = stacked.sum(0) * PREMUL_FACTOR
    elif op_name == "PRODUCT":
        result = stacked.prod(0)
    elif op_name == "MIN":
        result = stacked.amin(0)
    elif op_name == "MAX":
        result = stacked.amax(0)
    elif op_name == "BAND":
        result = functools.reduce(torch.bitwise_and, list(stacked))
    elif op_name == "BOR":
        result = functools.reduce(torch.bitwise_or, list(stacked))
    else:
        result = functools.reduce(torch.bitwise_xor, list(stacked))
    return result.to(dtype)


def assert_equal(actual, expected, context):
    """Exact for integer-valued results; AVG/PREMUL round in low precision."""
    assert actual.dtype == expected.dtype, f"{context}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{context}: shape {actual.shape} != {expected.shape}"
    if actual.dtype.is_floating_point:
        tol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(actual.dtype, 1e-6)
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{context}: {m}")
    else:
        mismatch = (actual != expected).nonzero()
        assert mismatch.numel() == 0, (
            f"{context}: {mismatch.shape[0]} elements differ, first at {mismatch[0].tolist()}: "
            f"{actual[tuple(mismatch[0])]} != {expected[tuple(mismatch[0])]}"
        )


def pattern(rank, numel, dtype):
    """Data for movement-only ops: value = index * 10 + rank (mod the dtype's range)."""
    values = (torch.arange(numel, dtype=torch.int64) * 10 + rank) % 127
    if dtype == torch.bool:
        return values % 2 == 1
    return values.to(dtype)
