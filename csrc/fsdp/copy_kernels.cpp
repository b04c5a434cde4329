#include "fsdp/copy_kernels.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/copy_kernels_device.hpp"
#include "fsdp/shard_extent.hpp"
#include "fsdp/tensor_subclass.hpp"

namespace fsdp_ext::fsdp {
namespace {

// `device`: where the kernel runs (its flat buffer's device); every tensor
// must be there.
void check_dense(const char* kernel, const at::Tensor& tensor, const std::string& what,
                 c10::Device device) {
  TORCH_CHECK_VALUE(tensor.device() == device, "fsdp_ext ", kernel, ": ", what,
                    " must be on ", device.str(), " (the flat buffer's device), got ",
                    tensor.device().str());
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

// Where a kernel runs with ATen ops (device_kernels) rather than on host
// memory: device tensors, and tensors a Python subclass answers (fake
// tensors, quantised wrappers), whose data pointer may be null or not theirs.
bool needs_aten_ops(const at::Tensor& tensor, const std::vector<at::Tensor>& others) {
  if (!tensor.is_cpu() || is_python_subclass(tensor)) return true;
  return std::any_of(others.begin(), others.end(),
                     [](const at::Tensor& t) { return is_python_subclass(t); });
}

// Restores the version counters of the subclass tensors among `tensors` on
// scope exit. The copy-out writes the unsharded parameters' memory, which
// must not look like an in-place change to autograd's saved tensors: plain
// tensors are written through aliases (see copy_cast_raw), which a subclass
// tensor cannot have (upstream's _unsafe_preserve_version_counter).
class SubclassVersionsKept {
 public:
  explicit SubclassVersionsKept(const std::vector<at::Tensor>& tensors) {
    for (const at::Tensor& tensor : tensors) {
      if (!is_python_subclass(tensor)) continue;
      const c10::VariableVersion& counter = tensor.unsafeGetTensorImpl()->version_counter();
      if (counter.enabled()) kept_.emplace_back(counter, counter.current_version());
    }
  }
  ~SubclassVersionsKept() {
    for (auto& [counter, version] : kept_) counter.set_version(version);
  }
  SubclassVersionsKept(const SubclassVersionsKept&) = delete;
  SubclassVersionsKept& operator=(const SubclassVersionsKept&) = delete;

 private:
  std::vector<std::pair<c10::VariableVersion, uint32_t>> kept_;
};

int64_t byte_size(int64_t numel, at::ScalarType dtype) {
  return numel * static_cast<int64_t>(c10::elementSize(dtype));
}

}  // namespace

void copy_cast_raw(void* destination, at::ScalarType dtype, const at::Tensor& source) {
  const int64_t numel = source.numel();
  if (numel == 0) return;
  const bool subclass = is_python_subclass(source);  // its data pointer is not its data
  if (!subclass && destination == source.data_ptr()) return;
  if (!source.is_cpu() || subclass) {
    // Through an alias: a device copy (a kernel on the current stream), or
    // the subclass's own copy.
    at::for_blob(destination, {numel})
        .options(source.options().dtype(dtype))
        .target_device(source.device())
        .make_tensor()
        .copy_(source.view({numel}));
    return;
  }
  if (source.scalar_type() == dtype) {
    std::memcpy(destination, source.data_ptr(), source.nbytes());
    return;
  }
  at::Tensor target = at::from_blob(destination, {numel}, at::TensorOptions().dtype(dtype));
  target.copy_(source.view({numel}));
}

void copy_cast_into(const at::Tensor& destination, const at::Tensor& source) {
  TORCH_CHECK_VALUE(destination.numel() == source.numel(), "fsdp_ext copy_cast_into: ",
                    source.numel(), " elements into ", destination.numel());
  if (!is_python_subclass(destination)) {
    copy_cast_raw(destination.data_ptr(), destination.scalar_type(), source);
    return;
  }
  if (source.numel() == 0) return;
  SubclassVersionsKept version({destination});
  destination.view({-1}).copy_(source.reshape({-1}));
}

bool equals_cast_raw(const void* destination, at::ScalarType dtype, const at::Tensor& source) {
  TORCH_CHECK_VALUE(source.is_cpu(), "fsdp_ext equals_cast_raw: host memory only, got ",
                    source.device().str());
  const int64_t numel = source.numel();
  if (numel == 0 || destination == source.data_ptr()) return true;
  if (source.scalar_type() == dtype) {
    return std::memcmp(destination, source.data_ptr(), source.nbytes()) == 0;
  }
  at::Tensor cast = source.view({numel}).to(dtype);
  return std::memcmp(destination, cast.data_ptr(), cast.nbytes()) == 0;
}

int64_t padded_chunk_numel(at::IntArrayRef sizes, int64_t world_size, int64_t shard_dim) {
  TORCH_CHECK_VALUE(!sizes.empty(), "fsdp_ext: a 0-dim tensor has no dim 0 to shard");
  TORCH_CHECK_VALUE(shard_dim >= 0 && shard_dim < static_cast<int64_t>(sizes.size()),
                    "fsdp_ext: shard dim ", shard_dim, " is invalid for a ", sizes.size(),
                    "-D tensor");
  TORCH_CHECK_VALUE(shard_dim == 0 || sizes[shard_dim] % world_size == 0,
                    "fsdp_ext: Shard(", shard_dim, ") needs dim ", shard_dim, " (size ",
                    sizes[shard_dim], ") divisible by the world size ", world_size);
  int64_t numel = shard_extent(sizes[shard_dim], world_size, 0).padded;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (static_cast<int64_t>(d) != shard_dim) numel *= sizes[d];
  }
  return numel;
}

namespace {

int64_t dim_of(const std::vector<int64_t>& shard_dims, size_t i) {
  return shard_dims.empty() ? 0 : shard_dims[i];
}

void check_shard_dims(const char* kernel, const std::vector<int64_t>& shard_dims, size_t count) {
  TORCH_CHECK_VALUE(shard_dims.empty() || shard_dims.size() == count, "fsdp_ext ", kernel, ": ",
                    shard_dims.size(), " shard dims for ", count, " tensors");
}

// Rank `rank`'s chunk along dim d > 0 of `full` (sizes evenly divisible).
at::Tensor chunk_along(const at::Tensor& full, int64_t dim, int64_t rank, int64_t world_size) {
  const int64_t size = full.size(dim) / world_size;
  return full.narrow(dim, rank * size, size);
}

}  // namespace

at::Tensor all_gather_copy_in(const std::vector<at::Tensor>& shards,
                              const std::vector<at::ScalarType>& gather_dtypes,
                              const at::Tensor& output, int64_t rank, int64_t world_size) {
  constexpr const char* kKernel = "all_gather_copy_in";
  check_world(kKernel, world_size);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "fsdp_ext ", kKernel, ": rank ", rank,
                    " is outside [0, ", world_size, ")");
  TORCH_CHECK_VALUE(shards.size() == gather_dtypes.size(), "fsdp_ext ", kKernel, ": ",
                    shards.size(), " shards but ", gather_dtypes.size(), " all-gather dtypes");
  check_dense(kKernel, output, "the output", output.device());
  int64_t chunk_bytes = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string what = "shard " + std::to_string(i);
    check_dense(kKernel, shards[i], what, output.device());
    check_dtype(kKernel, gather_dtypes[i], what + "'s all-gather dtype", output.scalar_type());
    chunk_bytes += byte_size(shards[i].numel(), gather_dtypes[i]);
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(output.nbytes()) == chunk_bytes * world_size,
                    "fsdp_ext ", kKernel, ": the output has ", output.nbytes(),
                    " bytes but world_size * (sum of shard sizes) is ", chunk_bytes * world_size);
  const int64_t chunk_numel = chunk_bytes / static_cast<int64_t>(output.element_size());
  at::Tensor input = output.view({-1}).narrow(0, chunk_numel * rank, chunk_numel);
  if (needs_aten_ops(output, shards)) {
    device_kernels::all_gather_copy_in(shards, gather_dtypes, input);
    return input;
  }
  char* cursor = bytes_of(input);
  for (size_t i = 0; i < shards.size(); ++i) {
    copy_cast_raw(cursor, gather_dtypes[i], shards[i]);
    cursor += byte_size(shards[i].numel(), gather_dtypes[i]);
  }
  return input;
}

void all_gather_copy_out(const at::Tensor& output, const std::vector<int64_t>& split_sizes,
                         int64_t world_size, const std::vector<at::Tensor>& outputs,
                         const std::vector<int64_t>& shard_dims) {
  constexpr const char* kKernel = "all_gather_copy_out";
  check_world(kKernel, world_size);
  check_shard_dims(kKernel, shard_dims, outputs.size());
  check_dense(kKernel, output, "the all-gather output", output.device());
  TORCH_CHECK_VALUE(split_sizes.size() == outputs.size(), "fsdp_ext ", kKernel, ": ",
                    split_sizes.size(), " split sizes for ", outputs.size(), " outputs");
  int64_t chunk_bytes = 0;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const std::string what = "output " + std::to_string(i);
    TORCH_CHECK_VALUE(split_sizes[i] >= 0, "fsdp_ext ", kKernel, ": split size ", i,
                      " is negative");
    check_dense(kKernel, outputs[i], what, output.device());
    check_dtype(kKernel, outputs[i].scalar_type(), what, output.scalar_type());
    TORCH_CHECK_VALUE(outputs[i].numel() == split_sizes[i] * world_size, "fsdp_ext ", kKernel,
                      ": output ", i, " has ", outputs[i].numel(), " elements, expected ",
                      split_sizes[i] * world_size);
    const int64_t dim = dim_of(shard_dims, i);
    TORCH_CHECK_VALUE(dim == 0 || (dim < outputs[i].dim() && outputs[i].size(dim) % world_size == 0),
                      "fsdp_ext ", kKernel, ": output ", i, " of shape ", outputs[i].sizes(),
                      " cannot be split evenly along dim ", dim, " over ", world_size, " ranks");
    chunk_bytes += byte_size(split_sizes[i], outputs[i].scalar_type());
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(output.nbytes()) == chunk_bytes * world_size,
                    "fsdp_ext ", kKernel, ": the all-gather output has ", output.nbytes(),
                    " bytes, expected ", chunk_bytes * world_size);
  if (needs_aten_ops(output, outputs)) {
    SubclassVersionsKept versions(outputs);
    device_kernels::all_gather_copy_out(output, split_sizes, world_size, outputs, shard_dims);
    return;
  }
  // Destinations sharded on dim d > 0 are written through tensors of their
  // own (not views of outputs[i]): the unsharded parameter's version counter
  // must not move (see copy_cast_raw).
  std::vector<at::Tensor> strided_targets(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (dim_of(shard_dims, i) != 0) {
      strided_targets[i] = at::from_blob(outputs[i].data_ptr(), outputs[i].sizes(),
                                         outputs[i].options());
    }
  }
  char* source = bytes_of(output);
  for (int64_t w = 0; w < world_size; ++w) {
    for (size_t i = 0; i < outputs.size(); ++i) {
      const size_t bytes = static_cast<size_t>(split_sizes[i]) * outputs[i].element_size();
      if (bytes != 0) {
        const int64_t dim = dim_of(shard_dims, i);
        if (dim == 0) {
          std::memcpy(bytes_of(outputs[i]) + w * bytes, source, bytes);
        } else {
          at::Tensor target = chunk_along(strided_targets[i], dim, w, world_size);
          target.copy_(at::from_blob(source, target.sizes(), outputs[i].options()));
        }
      }
      source += bytes;
    }
  }
}

void reduce_scatter_copy_in(const std::vector<at::Tensor>& gradients, int64_t world_size,
                            const at::Tensor& output, const std::vector<int64_t>& shard_dims) {
  constexpr const char* kKernel = "reduce_scatter_copy_in";
  check_world(kKernel, world_size);
  check_shard_dims(kKernel, shard_dims, gradients.size());
  check_dense(kKernel, output, "the output", output.device());
  TORCH_CHECK_TYPE(output.scalar_type() != at::kByte, "fsdp_ext ", kKernel,
                   ": the output must have the reduce dtype, not uint8");
  int64_t row_numel = 0;
  for (size_t i = 0; i < gradients.size(); ++i) {
    check_dense(kKernel, gradients[i], "gradient " + std::to_string(i), output.device());
    row_numel += padded_chunk_numel(gradients[i].sizes(), world_size, dim_of(shard_dims, i));
  }
  TORCH_CHECK_VALUE(output.numel() == row_numel * world_size, "fsdp_ext ", kKernel,
                    ": the output has ", output.numel(), " elements, expected ",
                    row_numel * world_size);
  if (needs_aten_ops(output, gradients)) {
    device_kernels::reduce_scatter_copy_in(gradients, world_size, output, shard_dims);
    return;
  }
  const at::ScalarType dtype = output.scalar_type();
  const size_t element = output.element_size();
  char* destination = bytes_of(output);
  for (int64_t r = 0; r < world_size; ++r) {
    for (size_t i = 0; i < gradients.size(); ++i) {
      const at::Tensor& gradient = gradients[i];
      const int64_t dim = dim_of(shard_dims, i);
      if (dim != 0) {
        // Rank r's chunk along dim d, made contiguous (even sizes: no padding).
        at::Tensor piece = chunk_along(gradient, dim, r, world_size);
        if (piece.numel() != 0) {
          at::from_blob(destination, piece.sizes(), output.options()).copy_(piece);
        }
        destination += piece.numel() * element;
        continue;
      }
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
