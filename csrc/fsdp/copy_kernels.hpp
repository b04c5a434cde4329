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
// All tensors must be contiguous CPU tensors of one dtype; violations raise
// ValueError / TypeError naming the kernel and the offending tensor.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fsdp_ext::fsdp {

// Copies shards[i] (any shape; flattened) into consecutive slices of the
// rank-th chunk of `output`, whose numel is world_size * sum(shard numels).
// Returns that chunk (the all-gather input, a view of `output`).
at::Tensor all_gather_copy_in(const std::vector<at::Tensor>& shards, const at::Tensor& output,
                              int64_t rank, int64_t world_size);

// The inverse layout after the all-gather: for every rank w and parameter i,
// outputs[i] viewed as (world_size, split_sizes[i]) gets row w from the
// slice [offset_i, offset_i + split_sizes[i]) of `output`'s w-th chunk.
void all_gather_copy_out(const at::Tensor& output, const std::vector<int64_t>& split_sizes,
                         int64_t world_size, const std::vector<at::Tensor>& outputs);

// Writes the reduce-scatter input layout of `gradients` into `output`
// (numel world_size * sum(padded chunk numels)); padding is zero.
void reduce_scatter_copy_in(const std::vector<at::Tensor>& gradients, int64_t world_size,
                            const at::Tensor& output);

// Elements of one dim-0 chunk of a tensor of `sizes` split world_size ways
// (dim 0 rounded up to a multiple of world_size): the reduce-scatter output
// numel per gradient. Tensors must have at least one dimension.
int64_t padded_chunk_numel(at::IntArrayRef sizes, int64_t world_size);

}  // namespace fsdp_ext::fsdp
