// A parameter group's two collectives, issued from C++ through the
// c10d::ProcessGroup API (so they dispatch through the c10d:: operators like
// upstream FSDP2's: CommDebugMode counts them, and any backend works: gloo,
// fsdp_ext, ...). The copy kernels around them are in copy_kernels.hpp.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <vector>

namespace fsdp_ext::fsdp {

// One flat all_gather_into_tensor / reduce_scatter_tensor (SUM) through the
// c10d ProcessGroup API, returned un-waited. Both release the GIL while they
// enqueue (see group_collectives.cpp).
c10::intrusive_ptr<c10d::Work> all_gather_flat(c10d::ProcessGroup& group, at::Tensor& output,
                                               at::Tensor& input);
c10::intrusive_ptr<c10d::Work> reduce_scatter_flat(c10d::ProcessGroup& group, at::Tensor& output,
                                                   at::Tensor& input);
// One in-place all_reduce (SUM) of `tensor` (HSDP: across the replicas).
c10::intrusive_ptr<c10d::Work> all_reduce_flat(c10d::ProcessGroup& group, at::Tensor& tensor);

// Work::wait() with the GIL released when the caller holds it: a backend
// thread that finishes an op may need the GIL (e.g. to free a tensor whose
// Python object it holds the last reference to), and must not wait for us.
void wait_releasing_gil(const c10::intrusive_ptr<c10d::Work>& work);

}  // namespace fsdp_ext::fsdp
