// Element-wise reduction kernels used by the collective algorithms.
#pragma once

#include <cstddef>

#include "comm/data_type.h"

namespace fsdp_ext::comm {

// accumulator[i] = accumulator[i] (op) contribution[i] for i < count.
void reduce_into(void* accumulator, const void* contribution, size_t count,
                 DataType type, ReduceKind kind);

// data[i] *= factor for floating-point types (PREMUL_SUM's multiply).
// Integer types are rejected by the caller before they get here.
void scale_in_place(void* data, size_t count, DataType type, double factor);

// data[i] /= divisor for floating-point types, rounded as torch's div_ rounds
// (fp32/fp64 in their own precision, fp16/bf16 through float): AVG's divide.
void divide_in_place(void* data, size_t count, DataType type, double divisor);

// out[i] = in[i] * factor; lets PREMUL_SUM scale without touching the input.
void scale_copy(void* out, const void* in, size_t count, DataType type,
                double factor);

}  // namespace fsdp_ext::comm
