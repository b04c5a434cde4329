#include "fsdp/group_collectives.hpp"

#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <vector>

namespace fsdp_ext::fsdp {

// _allgather_base / _reduce_scatter_base are deprecated aliases in newer
// torch but the only names every torch 2.x has; they dispatch the same op.
namespace {

// Issues `issue()` with the GIL released when the caller holds it, as
// torch's Python collectives do: gloo's worker thread can hold its queue lock
// while it destroys a finished Work whose saved thread-local state owns a
// Python object (so it needs the GIL), and enqueueing takes that lock.
template <typename Issue>
c10::intrusive_ptr<c10d::Work> without_gil(Issue&& issue) {
  if (PyGILState_Check()) {
    pybind11::gil_scoped_release no_gil;
    return issue();
  }
  return issue();
}

}  // namespace

c10::intrusive_ptr<c10d::Work> all_gather_flat(c10d::ProcessGroup& group, at::Tensor& output,
                                               at::Tensor& input) {
  return without_gil([&] {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return group._allgather_base(output, input);
#pragma GCC diagnostic pop
  });
}

c10::intrusive_ptr<c10d::Work> reduce_scatter_flat(c10d::ProcessGroup& group, at::Tensor& output,
                                                   at::Tensor& input) {
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return without_gil([&] {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return group._reduce_scatter_base(output, input, options);
#pragma GCC diagnostic pop
  });
}

c10::intrusive_ptr<c10d::Work> all_reduce_flat(c10d::ProcessGroup& group, at::Tensor& tensor) {
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  std::vector<at::Tensor> tensors{tensor};
  return without_gil([&] { return group.allreduce(tensors, options); });
}

void wait_releasing_gil(const c10::intrusive_ptr<c10d::Work>& work) {
  if (PyGILState_Check()) {
    pybind11::gil_scoped_release no_gil;
    work->wait();
  } else {
    work->wait();
  }
}

}  // namespace fsdp_ext::fsdp
