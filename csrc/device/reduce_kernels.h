// Reductions over device buffers, the device room's kernels: out = the
// contributions of several ranks (mapped peer buffers and this rank's own)
// combined element by element, in the order given.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "comm/reduce_spec.h"

namespace fsdp_ext::device {

// At most this many contributions per launch (the pointers travel in the
// kernel's parameters); more ranks reduce in several launches.
constexpr int kMaxReduceInputs = 32;

// out[i] = inputs[0][i] (op) inputs[1][i] (op) ... for i < count, with the
// rounding of a sequential reduction in the element type: each contribution
// first times spec.pre_scale (PREMUL_SUM), each step rounded to the type, the
// result divided by spec.post_divisor (AVG), as comm's CPU kernels do.
// `out` may be one of the inputs. Enqueued on `stream`; throws CommError
// (kDevice) when the launch fails.
void reduce_on_device(void* out, const void* const* inputs, int input_count, size_t count,
                      const comm::ReduceSpec& spec, cudaStream_t stream);

}  // namespace fsdp_ext::device
