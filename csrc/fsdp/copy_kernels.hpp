// The per-parameter copies around FSDP's two collectives, as single C++ loops
// over a parameter group (upstream runs them as torch ops dispatched from a
// Python loop). Layouts match upstream FSDP2 exactly:
//
//   all-gather input : this rank's chunk of the flat output, holding every
//                      parameter's (padded, flattened) local shard in order;
//   all-gather output: world_size chunks of that layout, one per rank;
//   reduce-scatter input: world_size rows; row r holds, for every gradient
//                      in order, its r-th dim-0 chunk (dim 0 zero-padded to a
//                      multiple of world_size), flattened (torch._chunk_cat).
//
// A parameter sharded on another dim d (shard_placement_fn's Shard(d), even
// sizes only, as upstream) contributes its r-th chunk along d instead: rank
// r's shard is that chunk made contiguous, and the copy-out writes each
// rank's piece back into dim d of the unsharded tensor.
//
// Dtypes. The flat all-gather buffer has one dtype: the parameters' common
// all-gather dtype, or uint8 when they differ (upstream's rule; each
// parameter then occupies its own bytes in the chunk). Copy-in casts a shard
// to its all-gather dtype on the way (mixed precision: fp32 shard, bf16
// gather); the reduce-scatter copy-in casts gradients to the buffer's dtype
// (reduce_dtype). Every tensor must be contiguous and on the flat buffer's
// device; violations raise ValueError / TypeError naming the kernel and the
// offending tensor.
//
// On the host these are loops of memcpy and casts. On an accelerator they
// are torch's fused device ops, one launch each where upstream has one
// (copy_kernels_device.hpp), on the caller's current stream.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fsdp_ext::fsdp {

// Copies shards[i] (any shape; flattened), cast to gather_dtypes[i], into
// consecutive slices of the rank-th chunk of `output`. `output` holds
// world_size chunks of sum(shard numel * gather element size) bytes; its
// dtype is gather_dtypes' common dtype or uint8. Returns that chunk (the
// all-gather input, a view of `output`).
at::Tensor all_gather_copy_in(const std::vector<at::Tensor>& shards,
                              const std::vector<at::ScalarType>& gather_dtypes,
                              const at::Tensor& output, int64_t rank, int64_t world_size);

// The inverse layout after the all-gather: for every rank w and parameter i,
// outputs[i] viewed as (world_size, split_sizes[i]) gets row w from the
// parameter's slice of `output`'s w-th chunk. split_sizes count elements of
// outputs[i]'s dtype, which must be `output`'s unless that is uint8.
// shard_dims (empty: all 0): where shard_dims[i] = d > 0, outputs[i] has the
// unsharded shape and rank w's piece fills chunk w along d.
void all_gather_copy_out(const at::Tensor& output, const std::vector<int64_t>& split_sizes,
                         int64_t world_size, const std::vector<at::Tensor>& outputs,
                         const std::vector<int64_t>& shard_dims = {});

// Writes the reduce-scatter input layout of `gradients`, cast to `output`'s
// dtype, into `output` (numel world_size * sum(chunk numels)); padding is
// zero. shard_dims (empty: all 0) as for the copy-out.
void reduce_scatter_copy_in(const std::vector<at::Tensor>& gradients, int64_t world_size,
                            const at::Tensor& output, const std::vector<int64_t>& shard_dims = {});

// Elements of one chunk of a tensor of `sizes` split world_size ways along
// `shard_dim`: dim 0 is rounded up to a multiple of world_size (padding);
// another dim must divide evenly. The reduce-scatter output numel per
// gradient. Tensors must have at least one dimension.
int64_t padded_chunk_numel(at::IntArrayRef sizes, int64_t world_size, int64_t shard_dim = 0);

// Copies `source` (contiguous, flattened), cast to `dtype`, to the raw memory
// at `destination`. Writes through a tensor of its own, so the version
// counter of whatever tensor owns that memory is left alone (autograd's
// saved views of an unsharded parameter must not see a new version).
void copy_cast_raw(void* destination, at::ScalarType dtype, const at::Tensor& source);
// Copies `source` into `destination` (same number of elements, cast to its
// dtype) leaving `destination`'s version counter as it was: copy_cast_raw
// into its memory, or, where `destination` is a tensor a Python subclass
// answers (a fake tensor: no memory to write), its own copy_ with the
// version restored.
void copy_cast_into(const at::Tensor& destination, const at::Tensor& source);
// Whether copy_cast_raw(destination, dtype, source) would leave every byte
// at `destination` as it is (host memory only).
bool equals_cast_raw(const void* destination, at::ScalarType dtype, const at::Tensor& source);

}  // namespace fsdp_ext::fsdp
