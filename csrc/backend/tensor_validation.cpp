#include "backend/tensor_validation.hpp"

#include <c10/util/Exception.h>

#include "backend/type_mapping.hpp"

namespace fsdp_ext::backend {

void check_tensor(const OpLabel& label, const at::Tensor& tensor, const char* role) {
  TORCH_CHECK_VALUE(tensor.defined(), label.prefix(), role, " is an undefined tensor");
  TORCH_CHECK_VALUE(!tensor.is_meta(), label.prefix(), role,
                    " is a meta tensor; collectives need tensors with data");
  TORCH_CHECK_VALUE(tensor.device().is_cpu() || tensor.device().is_cuda(), label.prefix(), role,
                    " is on device ", tensor.device(), "; fsdp_ext handles CPU and CUDA tensors");
  TORCH_CHECK_VALUE(tensor.layout() == at::kStrided, label.prefix(), role,
                    " has layout ", tensor.layout(), "; only dense (strided) tensors are supported");
  TORCH_CHECK_VALUE(tensor.is_contiguous(), label.prefix(), role,
                    " is not contiguous (sizes ", tensor.sizes(), ", strides ",
                    tensor.strides(), "); call .contiguous() first");
}

void check_tensors(const OpLabel& label, const std::vector<at::Tensor>& tensors,
                   const char* role) {
  for (const at::Tensor& tensor : tensors) check_tensor(label, tensor, role);
}

void check_count(const OpLabel& label, size_t actual, size_t expected, const char* what) {
  TORCH_CHECK_VALUE(actual == expected, label.prefix(), "expected ", expected, " ", what,
                    " but got ", actual);
}

void check_same_dtype(const OpLabel& label, const at::Tensor& a, const char* a_role,
                      const at::Tensor& b, const char* b_role) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), label.prefix(), a_role,
                   " has dtype ", dtype_name(a.scalar_type()), " but ", b_role,
                   " has dtype ", dtype_name(b.scalar_type()), "; they must match");
}

void check_numel(const OpLabel& label, int64_t actual, int64_t expected,
                 const std::string& what) {
  TORCH_CHECK_VALUE(actual == expected, label.prefix(), what, ": expected ", expected,
                    " elements but got ", actual);
}

void check_rank(const OpLabel& label, int64_t rank, const char* role) {
  TORCH_CHECK_VALUE(rank >= 0 && rank < label.size, label.prefix(), "invalid ", role,
                    " rank ", rank, "; the group has ranks 0..", label.size - 1);
}

void check_gather_into_tensor(const OpLabel& label, const at::Tensor& output,
                              const at::Tensor& input, const std::string& which) {
  check_tensor(label, input, "input");
  check_tensor(label, output, "output");
  check_same_dtype(label, output, "output", input, "input");
  check_numel(label, output.numel(), input.numel() * label.size,
              "output" + which + " must hold world_size (" + std::to_string(label.size) +
                  ") x input");
}

void check_scatter_from_tensor(const OpLabel& label, const at::Tensor& output,
                               const at::Tensor& input, const std::string& which) {
  check_tensor(label, input, "input");
  check_tensor(label, output, "output");
  check_same_dtype(label, output, "output", input, "input");
  check_numel(label, input.numel(), output.numel() * label.size,
              "input" + which + " must hold world_size (" + std::to_string(label.size) +
                  ") x output");
}

std::vector<at::Tensor> root_tensor_list(const OpLabel& label,
                                         const std::vector<std::vector<at::Tensor>>& lists,
                                         int root, const at::Tensor& reference,
                                         const char* list_role, const char* reference_role) {
  if (label.rank != root) {
    TORCH_CHECK_VALUE(lists.empty() || lists[0].empty(), label.prefix(), "only the root (rank ",
                      root, ") may pass ", list_role, " tensors");
    return {};
  }
  TORCH_CHECK_VALUE(lists.size() == 1 && lists[0].size() == static_cast<size_t>(label.size),
                    label.prefix(), "the root must pass one list of ", label.size, " ", list_role,
                    " tensors (one per rank)");
  for (const at::Tensor& tensor : lists[0]) {
    check_tensor(label, tensor, list_role);
    check_same_dtype(label, tensor, list_role, reference, reference_role);
    check_numel(label, tensor.numel(), reference.numel(),
                std::string("each ") + list_role + " must match the " + reference_role);
  }
  return lists[0];
}

}  // namespace fsdp_ext::backend
