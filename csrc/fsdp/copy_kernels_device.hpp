// The copy kernels of copy_kernels.hpp on an accelerator, and on tensors a
// Python subclass answers (fake tensors, quantised wrappers: host memory that
// cannot be read in place): the same layouts, written with torch's fused
// ops, one launch per collective where upstream has one (cat for the
// all-gather copy-in, split_with_sizes_copy for the copy-out, _chunk_cat for
// the reduce-scatter copy-in), so the bytes are upstream's. Each runs on the
// caller's current stream. Arguments are checked by the public kernels before
// they get here.
//
// Destinations that belong to the unsharded parameters are written through
// aliases of their memory (tensors of their own), never through the
// parameters' views: autograd's saved tensors must not see a version bump
// (see copy_cast_raw).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fsdp_ext::fsdp::device_kernels {

// `input`: this rank's chunk of the flat all-gather buffer.
void all_gather_copy_in(const std::vector<at::Tensor>& shards,
                        const std::vector<at::ScalarType>& gather_dtypes, const at::Tensor& input);

void all_gather_copy_out(const at::Tensor& output, const std::vector<int64_t>& split_sizes,
                         int64_t world_size, const std::vector<at::Tensor>& outputs,
                         const std::vector<int64_t>& shard_dims);

void reduce_scatter_copy_in(const std::vector<at::Tensor>& gradients, int64_t world_size,
                            const at::Tensor& output, const std::vector<int64_t>& shard_dims);

}  // namespace fsdp_ext::fsdp::device_kernels
