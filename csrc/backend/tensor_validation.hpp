// Argument checks run on the calling thread before anything is queued, so a
// bad call raises immediately (ValueError / TypeError / NotImplementedError)
// and never reaches the transport.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "backend/op_label.hpp"

namespace fsdp_ext::backend {

// CPU or CUDA, strided, contiguous, with storage (not meta). That an op's
// tensors share one device is FsdpExtBackend::cuda_route's check.
void check_tensor(const OpLabel& label, const at::Tensor& tensor, const char* role);
void check_tensors(const OpLabel& label, const std::vector<at::Tensor>& tensors,
                   const char* role);
void check_count(const OpLabel& label, size_t actual, size_t expected, const char* what);
void check_same_dtype(const OpLabel& label, const at::Tensor& a, const char* a_role,
                      const at::Tensor& b, const char* b_role);
void check_numel(const OpLabel& label, int64_t actual, int64_t expected,
                 const std::string& what);
void check_rank(const OpLabel& label, int64_t rank, const char* role);

// all_gather_into_tensor layout: output holds world_size x input. `which`
// names the pair inside a coalesced call ("" for a single op).
void check_gather_into_tensor(const OpLabel& label, const at::Tensor& output,
                              const at::Tensor& input, const std::string& which);
// reduce_scatter_tensor layout: input holds world_size x output.
void check_scatter_from_tensor(const OpLabel& label, const at::Tensor& output,
                               const at::Tensor& input, const std::string& which);

// gather's outputs / scatter's inputs: on the root, one tensor per rank, each
// like `reference` (the tensor every rank passes); elsewhere none. Returns
// the root's list, or an empty one.
std::vector<at::Tensor> root_tensor_list(const OpLabel& label,
                                         const std::vector<std::vector<at::Tensor>>& lists,
                                         int root, const at::Tensor& reference,
                                         const char* list_role, const char* reference_role);

}  // namespace fsdp_ext::backend
