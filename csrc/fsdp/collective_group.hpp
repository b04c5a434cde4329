// CollectiveGroup: a process group as the FSDP runtime issues its three
// collectives on it (flat all_gather_into_tensor, reduce_scatter_tensor SUM,
// in-place all_reduce SUM), each returned un-waited.
//
// A process group backed by C++ (gloo, fsdp_ext, nccl, ...) is called through
// the c10d::ProcessGroup API, so the collectives dispatch through the c10d::
// operators like upstream FSDP2's (CommDebugMode counts them) with no Python
// on the way. A ProcessGroup subclass implemented in Python (torch's threaded
// test group) has no C++ backend to dispatch to; its collectives go through
// torch.distributed's Python functions, as upstream's always do.
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "fsdp/training_state.hpp"  // FSDP_EXT_HIDDEN

namespace fsdp_ext::fsdp {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

class FSDP_EXT_HIDDEN CollectiveGroup {
 public:
  CollectiveGroup() = default;
  // `python_group` is the group's Python object when its collectives must go
  // through torch.distributed (see the file comment); None otherwise.
  CollectiveGroup(ProcessGroupPtr group, pybind11::object python_group);

  explicit operator bool() const { return static_cast<bool>(group_); }
  int64_t size() const { return group_->getSize(); }
  int64_t rank() const { return group_->getRank(); }
  const ProcessGroupPtr& process_group() const { return group_; }

  // Each enqueues with the GIL released where it is held (see the .cpp);
  // a null Work means the collective already completed.
  WorkPtr all_gather(at::Tensor& output, at::Tensor& input) const;
  WorkPtr reduce_scatter(at::Tensor& output, at::Tensor& input) const;
  WorkPtr all_reduce(at::Tensor& tensor) const;

  // A 1-D buffer for a collective on this group: from the group's backend
  // allocator when asked and it has one (fsdp_ext on one host: peers read it
  // in place), else ordinary memory.
  at::Tensor buffer(int64_t numel, const at::TensorOptions& options, bool from_group) const;

 private:
  ProcessGroupPtr group_;
  pybind11::object python_group_;  // None: the C++ path
};

// Work::wait() with the GIL released when the caller holds it: a backend
// thread that finishes an op may need the GIL (e.g. to free a tensor whose
// Python object it holds the last reference to), and must not wait for us.
// A null Work is already complete.
void wait_releasing_gil(const WorkPtr& work);

}  // namespace fsdp_ext::fsdp
