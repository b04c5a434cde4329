// CollectiveGroup: a process group as the FSDP runtime issues its three
// collectives on it (flat all_gather_into_tensor, reduce_scatter_tensor SUM
// or, over our backend, AVG; in-place all_reduce SUM), each returned un-waited.
//
// A process group backed by C++ (gloo, fsdp_ext, nccl, ...) is called through
// the c10d::ProcessGroup API, so the collectives dispatch through the c10d::
// operators like upstream FSDP2's (CommDebugMode counts them) with no Python
// on the way. A ProcessGroup subclass implemented in Python (torch's threaded
// test group) has no C++ backend to dispatch to; its collectives go through
// torch.distributed's Python functions, as upstream's always do.
//
// FSDPModule.set_custom_all_gather / set_custom_reduce_scatter install
// upstream's Comm objects (`allocate(size, dtype=, device=)` and
// `__call__(output_tensor=, input_tensor=, group=, ...)`): the group's
// buffers for that collective then come from the object's allocate, and the
// collective is the object's call, made synchronously as upstream's are on
// CPU. The reduce-scatter op handed to a custom reduce-scatter is always SUM:
// the runtime divides gradients itself (gradient_divide.hpp).
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <optional>

#include "fsdp/training_state.hpp"  // FSDP_EXT_HIDDEN

namespace fsdp_ext::fsdp {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

class FSDP_EXT_HIDDEN CollectiveGroup {
 public:
  CollectiveGroup() = default;
  // `group_object`: the group's Python object (handed to custom comms);
  // `python_impl`: its collectives must go through torch.distributed.
  CollectiveGroup(ProcessGroupPtr group, pybind11::object group_object, bool python_impl);

  // An empty CollectiveGroup is one rank with no collectives to run (the
  // shard "group" of DDP through dp_mesh_dims); callers never issue one at
  // size 1.
  explicit operator bool() const { return static_cast<bool>(group_); }
  int64_t size() const { return group_ ? group_->getSize() : 1; }
  int64_t rank() const { return group_ ? group_->getRank() : 0; }
  const ProcessGroupPtr& process_group() const { return group_; }

  // Each enqueues with the GIL released where it is held (see the .cpp);
  // a null Work means the collective already completed.
  WorkPtr all_gather(at::Tensor& output, at::Tensor& input) const;
  // `premul`: upstream's PREMUL_SUM(premul). Passed to backends that
  // implement it (fsdp_ext, nccl), so results are theirs bit for bit, as
  // upstream's; elsewhere (gloo has none) the input is multiplied first.
  // `average`: ReduceOp.AVG, only where is_ours(device, kReduceScatter).
  WorkPtr reduce_scatter(at::Tensor& output, at::Tensor& input,
                         std::optional<double> premul = std::nullopt, bool average = false) const;
  // `average`: ReduceOp.AVG, only where averages(device, kAllReduce).
  WorkPtr all_reduce(at::Tensor& tensor, bool average = false) const;
  // Point-to-point, for host-shared parameters' exchange across hosts
  // (host_shared_parameters.hpp); not for Python groups (refused earlier).
  WorkPtr send(at::Tensor& tensor, int64_t peer, int tag) const;
  WorkPtr recv(at::Tensor& tensor, int64_t peer, int tag) const;
  bool python_impl() const { return python_impl_; }

  // One collective over a list of (output, input) pairs, each pair as the
  // flat op above (our backend runs them as one fused operation); only where
  // is_ours(device, purpose). CommDebugMode counts them as
  // c10d::allgather_into_tensor_coalesced_ / reduce_scatter_tensor_coalesced_.
  WorkPtr all_gather_coalesced(std::vector<at::Tensor>& outputs,
                               std::vector<at::Tensor>& inputs) const;
  WorkPtr reduce_scatter_coalesced(std::vector<at::Tensor>& outputs,
                                   std::vector<at::Tensor>& inputs, bool average) const;

  enum class Purpose { kAllGather, kReduceScatter, kAllReduce };
  // Whether this group's collective for `purpose` runs on our backend (no
  // custom comm, not a Python group). Our AVG is SUM then the divide the
  // runtime would make after it (the same bits), fused into the reduction's
  // last pass, so the runtime may ask for it; gloo's reduce-scatter has no
  // AVG and a custom comm is always handed SUM.
  bool is_ours(c10::DeviceType device, Purpose purpose) const;
  // Whether ReduceOp.AVG may be asked for: ours, or NCCL (which divides in
  // its kernel; upstream asks NCCL for AVG, so a device mesh must too for
  // the same bits). Never with a custom comm, which is handed SUM.
  bool averages(c10::DeviceType device, Purpose purpose) const;
  // A 1-D buffer for a collective of `purpose` on this group: from the
  // custom comm's allocate when one is set; else from the group's backend
  // allocator when asked and it has one (fsdp_ext on one host: peers read it
  // in place); else ordinary memory.
  at::Tensor buffer(int64_t numel, const at::TensorOptions& options, bool from_group,
                    Purpose purpose) const;

  // None restores the group's own collective.
  void set_custom_all_gather(pybind11::object comm) { custom_all_gather_ = std::move(comm); }
  void set_custom_reduce_scatter(pybind11::object comm) {
    custom_reduce_scatter_ = std::move(comm);
  }
  bool has_custom_comm() const {
    return is_set(custom_all_gather_) || is_set(custom_reduce_scatter_);
  }

 private:
  static bool is_set(const pybind11::object& o) { return o && !o.is_none(); }

  ProcessGroupPtr group_;
  pybind11::object group_object_;
  bool python_impl_ = false;
  pybind11::object custom_all_gather_;
  pybind11::object custom_reduce_scatter_;
};

// Work::wait() with the GIL released when the caller holds it: a backend
// thread that finishes an op may need the GIL (e.g. to free a tensor whose
// Python object it holds the last reference to), and must not wait for us.
// A null Work is already complete.
void wait_releasing_gil(const WorkPtr& work);

}  // namespace fsdp_ext::fsdp
