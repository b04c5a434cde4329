#include "fsdp/copy_kernels.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace fsdp_ext::fsdp {
namespace {

void check_dense(const char* kernel, const at::Tensor& tensor, const std::string& what) {
  TORCH_CHECK_VALUE(tensor.device().is_cpu(), "fsdp_ext ", kernel, ": ", what,
                    " must be a CPU tensor, got ", tensor.device().str());
  TORCH_CHECK_VALUE(tensor.is_contiguous(), "fsdp_ext ", kernel, ": ", what,
                    " must be contiguous");
}

// A tensor whose dtype must be the flat buffer's, unless the buffer carries
// bytes (uint8: parameters of several dtypes gathered together).
void check_dtype(const char* kernel, at::ScalarType dtype, const std::string& what,
                 at::ScalarType buffer_dtype) {
  TORCH_CHECK_TYPE(buffer_dtype == at::kByte || dtype == buffer_dtype, "fsdp_ext ", kernel, ": ",
                   what, " has dtype ", dtype, " but the flat buffer's dtype is ", buffer_dtype);
}

void check_world(const char* kernel, int64_t world_size) {
  TORCH_CHECK_VALUE(world_size >= 1, "fsdp_ext ", kernel, ": world_size must be >= 1, got ",
                    world_size);
}

char* bytes_of(const at::Tensor& tensor) { return static_cast<char*>(tensor.data_ptr()); }

int64_t byte_size(int64_t numel, at::ScalarType dtype) {
  return numel * static_cast<int64_t>(c10::elementSize(dtype));
}

}  // namespace

void copy_cast_raw(void* destination, at::ScalarType dtype, const at::Tensor& source) {
  const int64_t numel = source.numel();
  if (numel == 0 || destination == source.data_ptr()) return;
  if (source.scalar_type() == dtype) {
    std::memcpy(destination, source.data_ptr(), source.nbytes());
    return;
  }
  at::Tensor target = at::from_blob(destination, {numel}, at::TensorOptions().dtype(dtype));
  target.copy_(source.view({numel}));
}

int64_t padded_chunk_numel(at::IntArrayRef sizes, int64_t world_size) {
  TORCH_CHECK_VALUE(!sizes.empty(), "fsdp_ext: a 0-dim tensor has no dim 0 to shard");
  const int64_t rows = (sizes[0] + world_size - 1) / world_size;
  int64_t numel = rows;
  for (size_t d = 1; d < sizes.size(); ++d) numel *= sizes[d];
  return numel;
}

at::Tensor all_gather_copy_in(const std::vector<at::Tensor>& shards,
                              const std::vector<at::ScalarType>& gather_dtypes,
                              const at::Tensor& output, int64_t rank, int64_t world_size) {
  constexpr const char* kKernel = "all_gather_copy_in";
  check_world(kKernel, world_size);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "fsdp_ext ", kKernel, ": rank ", rank,
                    " is outside [0, ", world_size, ")");
  TORCH_CHECK_VALUE(shards.size() == gather_dtypes.size(), "fsdp_ext ", kKernel, ": ",
                    shards.size(), " shards but ", gather_dtypes.size(), " all-gather dtypes");
  check_dense(kKernel, output, "the output");
  int64_t chunk_bytes = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string what = "shard " + std::to_string(i);
    check_dense(kKernel, shards[i], what);
    check_dtype(kKernel, gather_dtypes[i], what + "'s all-gather dtype", output.scalar_type());
    chunk_bytes += byte_size(shards[i].numel(), gather_dtypes[i]);
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(output.nbytes()) == chunk_bytes * world_size,
                    "fsdp_ext ", kKernel, ": the output has ", output.nbytes(),
                    " bytes but world_size * (sum of shard sizes) is ", chunk_bytes * world_size);
  const int64_t chunk_numel = chunk_bytes / static_cast<int64_t>(output.element_size());
  at::Tensor input = output.view({-1}).narrow(0, chunk_numel * rank, chunk_numel);
  char* cursor = bytes_of(input);
  for (size_t i = 0; i < shards.size(); ++i) {
    copy_cast_raw(cursor, gather_dtypes[i], shards[i]);
    cursor += byte_size(shards[i].numel(), gather_dtypes[i]);
  }
  return input;
}

void all_gather_copy_out(const at::Tensor& output, const std::vector<int64_t>& split_sizes,
                         int64_t world_size, const std::vector<at::Tensor>& outputs) {
  constexpr const char* kKernel = "all_gather_copy_out";
  check_world(kKernel, world_size);
  check_dense(kKernel, output, "the all-gather output");
  TORCH_CHECK_VALUE(split_sizes.size() == outputs.size(), "fsdp_ext ", kKernel, ": ",
                    split_sizes.size(), " split sizes for ", outputs.size(), " outputs");
  int64_t chunk_bytes = 0;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const std::string what = "output " + std::to_string(i);
    TORCH_CHECK_VALUE(split_sizes[i] >= 0, "fsdp_ext ", kKernel, ": split size ", i,
                      " is negative");
    check_dense(kKernel, outputs[i], what);
    check_dtype(kKernel, outputs[i].scalar_type(), what, output.scalar_type());
    TORCH_CHECK_VALUE(outputs[i].numel() == split_sizes[i] * world_size, "fsdp_ext ", kKernel,
                      ": output ", i, " has ", outputs[i].numel(), " elements, expected ",
                      split_sizes[i] * world_size);
    chunk_bytes += byte_size(split_sizes[i], outputs[i].scalar_type());
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(output.nbytes()) == chunk_bytes * world_size,
                    "fsdp_ext ", kKernel, ": the all-gather output has ", output.nbytes(),
                    " bytes, expected ", chunk_bytes * world_size);
  const char* source = bytes_of(output);
  for (int64_t w = 0; w < world_size; ++w) {
    for (size_t i = 0; i < outputs.size(); ++i) {
      const size_t bytes = static_cast<size_t>(split_sizes[i]) * outputs[i].element_size();
      if (bytes != 0) std::memcpy(bytes_of(outputs[i]) + w * bytes, source, bytes);
      source += bytes;
    }
  }
}

void reduce_scatter_copy_in(const std::vector<at::Tensor>& gradients, int64_t world_size,
                            const at::Tensor& output) {
  constexpr const char* kKernel = "reduce_scatter_copy_in";
  check_world(kKernel, world_size);
  check_dense(kKernel, output, "the output");
  TORCH_CHECK_TYPE(output.scalar_type() != at::kByte, "fsdp_ext ", kKernel,
                   ": the output must have the reduce dtype, not uint8");
  int64_t row_numel = 0;
  for (size_t i = 0; i < gradients.size(); ++i) {
    check_dense(kKernel, gradients[i], "gradient " + std::to_string(i));
    row_numel += padded_chunk_numel(gradients[i].sizes(), world_size);
  }
  TORCH_CHECK_VALUE(output.numel() == row_numel * world_size, "fsdp_ext ", kKernel,
                    ": the output has ", output.numel(), " elements, expected ",
                    row_numel * world_size);
  const at::ScalarType dtype = output.scalar_type();
  const size_t element = output.element_size();
  char* destination = bytes_of(output);
  for (int64_t r = 0; r < world_size; ++r) {
    for (const at::Tensor& gradient : gradients) {
      const size_t chunk = static_cast<size_t>(padded_chunk_numel(gradient.sizes(), world_size));
      const size_t total = static_cast<size_t>(gradient.numel());
      // Rank r's chunk covers [r * chunk, (r + 1) * chunk) of the flattened
      // gradient; whatever lies past its end is dim-0 padding (zeros).
      const size_t begin = std::min(total, static_cast<size_t>(r) * chunk);
      const size_t end = std::min(total, begin + chunk);
      const size_t present = end - begin;
      if (present != 0) {
        copy_cast_raw(destination, dtype,
                      gradient.view({-1}).narrow(0, static_cast<int64_t>(begin),
                                                 static_cast<int64_t>(present)));
      }
      if (present < chunk) std::memset(destination + present * element, 0, (chunk - present) * element);
      destination += chunk * element;
    }
  }
}

}  // namespace fsdp_ext::fsdp
