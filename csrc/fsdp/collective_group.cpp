#include "fsdp/collective_group.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> Python

#include <vector>

#include "fsdp/host_block_cache.hpp"
#include "torch_compat.hpp"

namespace fsdp_ext::fsdp {

namespace py = pybind11;

namespace {

// Issues `issue()` with the GIL released when the caller holds it, as
// torch's Python collectives do: gloo's worker thread can hold its queue lock
// while it destroys a finished Work whose saved thread-local state owns a
// Python object (so it needs the GIL), and enqueueing takes that lock.
template <typename Issue>
WorkPtr without_gil(Issue&& issue) {
  if (PyGILState_Check()) {
    py::gil_scoped_release no_gil;
    return issue();
  }
  return issue();
}

// torch.distributed.<name>(..., group=group, async_op=True) for Python groups.
WorkPtr call_python(const char* name, const py::object& group, py::args args,
                    py::kwargs kwargs) {
  static py::object* distributed = new py::object(py::module_::import("torch.distributed"));
  kwargs["group"] = group;
  kwargs["async_op"] = true;
  py::object work = distributed->attr(name)(*args, **kwargs);
  return work.is_none() ? WorkPtr() : work.cast<WorkPtr>();
}

// torch.distributed's name for a collective: `preferred` where this torch has
// it (newer releases deprecate the older names), else `fallback`.
const char* distributed_name(const char* preferred, const char* fallback) {
  return py::hasattr(py::module_::import("torch.distributed"), preferred) ? preferred : fallback;
}

py::object sum_op() {
  static py::object* op =
      new py::object(py::module_::import("torch.distributed").attr("ReduceOp").attr("SUM"));
  return *op;
}

// A custom comm's return value: None (it completed) or a Work.
WorkPtr custom_work(const py::object& result) {
  return result.is_none() ? WorkPtr() : result.cast<WorkPtr>();
}

}  // namespace

CollectiveGroup::CollectiveGroup(ProcessGroupPtr group, py::object group_object, bool python_impl)
    : group_(std::move(group)), group_object_(std::move(group_object)), python_impl_(python_impl) {
  TORCH_CHECK_VALUE(group_, "fsdp_ext CollectiveGroup: no process group");
}

// _allgather_base / _reduce_scatter_base are deprecated aliases in newer
// torch but the only names every torch 2.x has; they dispatch the same op.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

WorkPtr CollectiveGroup::all_gather(at::Tensor& output, at::Tensor& input) const {
  if (is_set(custom_all_gather_)) {
    py::gil_scoped_acquire gil;
    return custom_work(custom_all_gather_(py::arg("output_tensor") = output,
                                          py::arg("input_tensor") = input,
                                          py::arg("group") = group_object_,
                                          py::arg("async_op") = false));
  }
  if (python_impl_) {
    py::gil_scoped_acquire gil;
    static const char* name = distributed_name("all_gather_single", "all_gather_into_tensor");
    return call_python(name, group_object_, py::make_tuple(output, input), py::kwargs());
  }
  return without_gil([&] { return group_->_allgather_base(output, input); });
}

bool CollectiveGroup::averages(c10::DeviceType device, Purpose purpose) const {
  if (is_ours(device, purpose)) return true;
  const pybind11::object& custom =
      purpose == Purpose::kReduceScatter ? custom_reduce_scatter_ : custom_all_gather_;
  if (!group_ || python_impl_ || (purpose != Purpose::kAllReduce && is_set(custom))) return false;
  return group_->getBackend(device)->getBackendName() == "nccl";
}

bool CollectiveGroup::is_ours(c10::DeviceType device, Purpose purpose) const {
  if (!group_ || python_impl_) return false;
  // No custom comm for the all-reduce.
  if (purpose == Purpose::kAllGather && is_set(custom_all_gather_)) return false;
  if (purpose == Purpose::kReduceScatter && is_set(custom_reduce_scatter_)) return false;
  return group_->getBackend(device)->getBackendName() == "fsdp_ext";
}

WorkPtr CollectiveGroup::all_gather_coalesced(std::vector<at::Tensor>& outputs,
                                              std::vector<at::Tensor>& inputs) const {
  TORCH_INTERNAL_ASSERT(is_ours(inputs.front().device().type(), Purpose::kAllGather));
  return without_gil([&] { return group_->allgather_into_tensor_coalesced(outputs, inputs); });
}

WorkPtr CollectiveGroup::reduce_scatter_coalesced(std::vector<at::Tensor>& outputs,
                                                  std::vector<at::Tensor>& inputs,
                                                  bool average) const {
  TORCH_INTERNAL_ASSERT(is_ours(inputs.front().device().type(), Purpose::kReduceScatter));
  c10d::ReduceScatterOptions options;
  options.reduceOp = average ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
  return without_gil(
      [&] { return group_->reduce_scatter_tensor_coalesced(outputs, inputs, options); });
}

WorkPtr CollectiveGroup::reduce_scatter(at::Tensor& output, at::Tensor& input,
                                        std::optional<double> premul, bool average) const {
  if (average) {
    TORCH_INTERNAL_ASSERT(!premul && averages(input.device().type(), Purpose::kReduceScatter));
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::AVG;
    return without_gil([&] { return group_->_reduce_scatter_base(output, input, options); });
  }
  bool backend_premul = false;
  if (premul && !is_set(custom_reduce_scatter_) && !python_impl_) {
    const std::string name = group_->getBackend(input.device().type())->getBackendName();
    backend_premul = name == "fsdp_ext" || name == "nccl";
  }
  if (premul && !backend_premul) input.mul_(*premul);
  if (backend_premul) {
    c10d::ReduceScatterOptions options;
    options.reduceOp = torch_compat::make_premul_sum(*premul);
    return without_gil([&] { return group_->_reduce_scatter_base(output, input, options); });
  }
  if (is_set(custom_reduce_scatter_)) {
    py::gil_scoped_acquire gil;
    return custom_work(custom_reduce_scatter_(py::arg("output_tensor") = output,
                                              py::arg("input_tensor") = input,
                                              py::arg("group") = group_object_,
                                              py::arg("op") = sum_op()));
  }
  if (python_impl_) {
    py::gil_scoped_acquire gil;
    py::kwargs kwargs;
    kwargs["op"] = sum_op();
    static const char* name = distributed_name("reduce_scatter_single", "reduce_scatter_tensor");
    return call_python(name, group_object_, py::make_tuple(output, input), kwargs);
  }
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return without_gil([&] { return group_->_reduce_scatter_base(output, input, options); });
}

#pragma GCC diagnostic pop

WorkPtr CollectiveGroup::all_reduce(at::Tensor& tensor, bool average) const {
  if (average) {
    TORCH_INTERNAL_ASSERT(averages(tensor.device().type(), Purpose::kAllReduce));
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::AVG;
    std::vector<at::Tensor> tensors{tensor};
    return without_gil([&] { return group_->allreduce(tensors, options); });
  }
  if (python_impl_) {
    py::gil_scoped_acquire gil;
    py::kwargs kwargs;
    kwargs["op"] = sum_op();
    return call_python("all_reduce", group_object_, py::make_tuple(tensor), kwargs);
  }
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  std::vector<at::Tensor> tensors{tensor};
  return without_gil([&] { return group_->allreduce(tensors, options); });
}

WorkPtr CollectiveGroup::send(at::Tensor& tensor, int64_t peer, int tag) const {
  TORCH_INTERNAL_ASSERT(!python_impl_, "fsdp_ext CollectiveGroup::send on a Python group");
  std::vector<at::Tensor> tensors{tensor};
  return without_gil([&] { return group_->send(tensors, static_cast<int>(peer), tag); });
}

WorkPtr CollectiveGroup::recv(at::Tensor& tensor, int64_t peer, int tag) const {
  TORCH_INTERNAL_ASSERT(!python_impl_, "fsdp_ext CollectiveGroup::recv on a Python group");
  std::vector<at::Tensor> tensors{tensor};
  return without_gil([&] { return group_->recv(tensors, static_cast<int>(peer), tag); });
}

at::Tensor CollectiveGroup::buffer(int64_t numel, const at::TensorOptions& options,
                                   bool from_group, Purpose purpose) const {
  const py::object& custom =
      purpose == Purpose::kAllGather ? custom_all_gather_ : custom_reduce_scatter_;
  if (is_set(custom)) {
    py::gil_scoped_acquire gil;
    at::Tensor out = custom.attr("allocate")(py::make_tuple(numel),
                                             py::arg("dtype") = options.dtype().toScalarType(),
                                             py::arg("device") = options.device())
                         .cast<at::Tensor>();
    TORCH_CHECK_VALUE(out.numel() == numel && out.scalar_type() == options.dtype().toScalarType(),
                      "fsdp_ext fully_shard: custom comm ", py::str(py::type::of(custom)).cast<std::string>(),
                      ".allocate returned ", out.sizes(), " ", out.scalar_type(), ", expected (",
                      numel, ",) ", options.dtype().toScalarType());
    return out.view(-1);
  }
  if (from_group && group_ && !python_impl_) {
    c10::intrusive_ptr<c10d::Backend> backend = group_->getBackend(options.device().type());
    if (backend->supportsTensorAlloc(options.device().index())) {
      return backend->allocateTensor(numel, options);
    }
  }
  // Host buffers from the block cache: each group's collectives take and
  // free the same sizes every step (host_block_cache.hpp).
  if (options.device().is_cpu() && !options.pinned_memory()) {
    return HostBlockCache::empty(numel, options.dtype().toScalarType());
  }
  return at::empty({numel}, options);
}

void wait_releasing_gil(const WorkPtr& work) {
  if (!work) return;
  if (PyGILState_Check()) {
    py::gil_scoped_release no_gil;
    work->wait();
  } else {
    work->wait();
  }
}

}  // namespace fsdp_ext::fsdp
