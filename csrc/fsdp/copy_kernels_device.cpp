#include "fsdp/copy_kernels_device.hpp"

#include <algorithm>

#include "fsdp/tensor_subclass.hpp"

namespace fsdp_ext::fsdp::device_kernels {
namespace {

int64_t dim_of(const std::vector<int64_t>& shard_dims, size_t i) {
  return shard_dims.empty() ? 0 : shard_dims[i];
}

// A tensor over `tensor`'s memory with a version counter of its own. The
// device is given, so no driver query asks where the pointer lives (and an
// empty tensor's null pointer is fine). A tensor a Python subclass answers
// has no such memory: written itself (its caller keeps its version).
at::Tensor alias_of(const at::Tensor& tensor) {
  if (is_python_subclass(tensor)) return tensor;
  return at::for_blob(tensor.data_ptr(), tensor.sizes())
      .strides(tensor.strides())
      .options(tensor.options())
      .target_device(tensor.device())
      .make_tensor();
}

// `tensor` flattened and cast to `dtype`, then seen as the flat buffer's
// element type (bytes when parameters of several dtypes share it).
at::Tensor as_buffer_elements(const at::Tensor& tensor, at::ScalarType dtype,
                              at::ScalarType buffer_dtype) {
  at::Tensor flat = tensor.view({-1});
  if (flat.scalar_type() != dtype) flat = flat.to(dtype);
  if (buffer_dtype != dtype) flat = flat.view(buffer_dtype);
  return flat;
}

}  // namespace

void all_gather_copy_in(const std::vector<at::Tensor>& shards,
                        const std::vector<at::ScalarType>& gather_dtypes, const at::Tensor& input) {
  std::vector<at::Tensor> pieces;
  pieces.reserve(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    pieces.push_back(as_buffer_elements(shards[i], gather_dtypes[i], input.scalar_type()));
  }
  at::Tensor destination = input;
  at::cat_out(destination, pieces, 0);
}

void all_gather_copy_out(const at::Tensor& output, const std::vector<int64_t>& split_sizes,
                         int64_t world_size, const std::vector<at::Tensor>& outputs,
                         const std::vector<int64_t>& shard_dims) {
  const at::ScalarType buffer_dtype = output.scalar_type();
  const at::Tensor rows = output.view({world_size, -1});
  // Each parameter's columns in a row, in the buffer's elements.
  std::vector<int64_t> columns;
  columns.reserve(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    const int64_t bytes = split_sizes[i] * static_cast<int64_t>(outputs[i].element_size());
    columns.push_back(bytes / static_cast<int64_t>(c10::elementSize(buffer_dtype)));
  }
  const bool all_dim0 = std::all_of(shard_dims.begin(), shard_dims.end(),
                                    [](int64_t dim) { return dim == 0; });
  if (all_dim0) {
    // One launch: row w's column block i is rank w's piece of parameter i.
    std::vector<at::Tensor> targets;
    targets.reserve(outputs.size());
    for (const at::Tensor& out : outputs) {
      targets.push_back(alias_of(out).view(buffer_dtype).view({world_size, -1}));
    }
    at::split_with_sizes_copy_out(targets, rows, columns, 1);
    return;
  }
  int64_t offset = 0;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const at::Tensor block = rows.narrow(1, offset, columns[i]);
    offset += columns[i];
    const int64_t dim = dim_of(shard_dims, i);
    at::Tensor target = alias_of(outputs[i]);
    if (dim == 0) {
      target.view(buffer_dtype).view({world_size, -1}).copy_(block);
      continue;
    }
    // Rank w's piece is its chunk along dim d: stack the pieces on a new
    // leading dim, then lay each where its chunk belongs.
    std::vector<int64_t> piece_sizes(outputs[i].sizes().begin(), outputs[i].sizes().end());
    piece_sizes[dim] /= world_size;
    std::vector<int64_t> stacked{world_size};
    stacked.insert(stacked.end(), piece_sizes.begin(), piece_sizes.end());
    const at::Tensor pieces = block.contiguous().view(outputs[i].scalar_type()).view(stacked);
    for (int64_t w = 0; w < world_size; ++w) {
      target.narrow(dim, w * piece_sizes[dim], piece_sizes[dim]).copy_(pieces[w]);
    }
  }
}

void reduce_scatter_copy_in(const std::vector<at::Tensor>& gradients, int64_t world_size,
                            const at::Tensor& output, const std::vector<int64_t>& shard_dims) {
  std::vector<at::Tensor> laid_out;
  laid_out.reserve(gradients.size());
  for (size_t i = 0; i < gradients.size(); ++i) {
    at::Tensor gradient = gradients[i];
    // An empty gradient has empty chunks (and _chunk_cat refuses it).
    if (gradient.numel() == 0) continue;
    const int64_t dim = dim_of(shard_dims, i);
    if (dim != 0) {
      // Rank r's chunk along d becomes dim-0 block r, as upstream does.
      gradient = at::cat(gradient.chunk(world_size, dim), 0);
    }
    if (gradient.scalar_type() != output.scalar_type()) {
      gradient = gradient.to(output.scalar_type());
    }
    laid_out.push_back(std::move(gradient));
  }
  if (laid_out.empty()) return;
  at::Tensor destination = output.view({world_size, -1});
  at::_chunk_cat_out(destination, laid_out, 0, world_size);
}

}  // namespace fsdp_ext::fsdp::device_kernels
