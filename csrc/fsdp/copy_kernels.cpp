#include "fsdp/copy_kernels.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace fsdp_ext::fsdp {
namespace {

void check_dense(const char* kernel, const at::Tensor& tensor, const std::string& what,
                 c10::ScalarType dtype) {
  TORCH_CHECK_VALUE(tensor.device().is_cpu(), "fsdp_ext ", kernel, ": ", what,
                    " must be a CPU tensor, got ", tensor.device().str());
  TORCH_CHECK_VALUE(tensor.is_contiguous(), "fsdp_ext ", kernel, ": ", what,
                    " must be contiguous");
  TORCH_CHECK_TYPE(tensor.scalar_type() == dtype, "fsdp_ext ", kernel, ": ", what, " has dtype ",
                   tensor.scalar_type(), " but the group's dtype is ", dtype);
}

void check_world(const char* kernel, int64_t world_size) {
  TORCH_CHECK_VALUE(world_size >= 1, "fsdp_ext ", kernel, ": world_size must be >= 1, got ",
                    world_size);
}

char* bytes_of(const at::Tensor& tensor) { return static_cast<char*>(tensor.data_ptr()); }

}  // namespace

int64_t padded_chunk_numel(at::IntArrayRef sizes, int64_t world_size) {
  TORCH_CHECK_VALUE(!sizes.empty(), "fsdp_ext: a 0-dim tensor has no dim 0 to shard");
  const int64_t rows = (sizes[0] + world_size - 1) / world_size;
  int64_t numel = rows;
  for (size_t d = 1; d < sizes.size(); ++d) numel *= sizes[d];
  return numel;
}

at::Tensor all_gather_copy_in(const std::vector<at::Tensor>& shards, const at::Tensor& output,
                              int64_t rank, int64_t world_size) {
  constexpr const char* kKernel = "all_gather_copy_in";
  check_world(kKernel, world_size);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "fsdp_ext ", kKernel, ": rank ", rank,
                    " is outside [0, ", world_size, ")");
  check_dense(kKernel, output, "the output", output.scalar_type());
  int64_t input_numel = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    check_dense(kKernel, shards[i], "shard " + std::to_string(i), output.scalar_type());
    input_numel += shards[i].numel();
  }
  TORCH_CHECK_VALUE(output.numel() == input_numel * world_size, "fsdp_ext ", kKernel,
                    ": the output has ", output.numel(), " elements but world_size * (sum of ",
                    "shard sizes) is ", input_numel * world_size);
  at::Tensor input = output.view({-1}).narrow(0, input_numel * rank, input_numel);
  char* cursor = bytes_of(input);
  for (const at::Tensor& shard : shards) {
    const size_t bytes = shard.nbytes();
    if (bytes != 0 && cursor != bytes_of(shard)) std::memcpy(cursor, bytes_of(shard), bytes);
    cursor += bytes;
  }
  return input;
}

void all_gather_copy_out(const at::Tensor& output, const std::vector<int64_t>& split_sizes,
                         int64_t world_size, const std::vector<at::Tensor>& outputs) {
  constexpr const char* kKernel = "all_gather_copy_out";
  check_world(kKernel, world_size);
  check_dense(kKernel, output, "the all-gather output", output.scalar_type());
  TORCH_CHECK_VALUE(split_sizes.size() == outputs.size(), "fsdp_ext ", kKernel, ": ",
                    split_sizes.size(), " split sizes for ", outputs.size(), " outputs");
  int64_t chunk_numel = 0;
  for (size_t i = 0; i < outputs.size(); ++i) {
    TORCH_CHECK_VALUE(split_sizes[i] >= 0, "fsdp_ext ", kKernel, ": split size ", i,
                      " is negative");
    check_dense(kKernel, outputs[i], "output " + std::to_string(i), output.scalar_type());
    TORCH_CHECK_VALUE(outputs[i].numel() == split_sizes[i] * world_size, "fsdp_ext ", kKernel,
                      ": output ", i, " has ", outputs[i].numel(), " elements, expected ",
                      split_sizes[i] * world_size);
    chunk_numel += split_sizes[i];
  }
  TORCH_CHECK_VALUE(output.numel() == chunk_numel * world_size, "fsdp_ext ", kKernel,
                    ": the all-gather output has ", output.numel(), " elements, expected ",
                    chunk_numel * world_size);
  const size_t element = output.element_size();
  const char* source = bytes_of(output);
  for (int64_t w = 0; w < world_size; ++w) {
    for (size_t i = 0; i < outputs.size(); ++i) {
      const size_t bytes = static_cast<size_t>(split_sizes[i]) * element;
      if (bytes != 0) std::memcpy(bytes_of(outputs[i]) + w * bytes, source, bytes);
      source += bytes;
    }
  }
}

void reduce_scatter_copy_in(const std::vector<at::Tensor>& gradients, int64_t world_size,
                            const at::Tensor& output) {
  constexpr const char* kKernel = "reduce_scatter_copy_in";
  check_world(kKernel, world_size);
  check_dense(kKernel, output, "the output", output.scalar_type());
  int64_t row_numel = 0;
  for (size_t i = 0; i < gradients.size(); ++i) {
    check_dense(kKernel, gradients[i], "gradient " + std::to_string(i), output.scalar_type());
    row_numel += padded_chunk_numel(gradients[i].sizes(), world_size);
  }
  TORCH_CHECK_VALUE(output.numel() == row_numel * world_size, "fsdp_ext ", kKernel,
                    ": the output has ", output.numel(), " elements, expected ",
                    row_numel * world_size);
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
        std::memcpy(destination, bytes_of(gradient) + begin * element, present * element);
      }
      if (present < chunk) std::memset(destination + present * element, 0, (chunk - present) * element);
      destination += chunk * element;
    }
  }
}

}  // namespace fsdp_ext::fsdp
