#include "fsdp/forward_hooks.hpp"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <utility>
#include <vector>

#include "fsdp/profiler_range.hpp"

namespace fsdp_ext::fsdp {

namespace {

// torch.Tensor itself, not a subclass (a subclass may be a pytree node or
// carry its own dispatch: the Python hook handles it, as upstream's would).
bool is_plain_tensor(py::handle object) {
  return Py_TYPE(object.ptr()) == reinterpret_cast<PyTypeObject*>(THPVariableClass);
}

// Mixed precision's cast of a floating-point tensor (none: as it is).
at::Tensor cast_floating(const at::Tensor& tensor, std::optional<at::ScalarType> dtype) {
  if (!dtype || !tensor.is_floating_point() || tensor.scalar_type() == *dtype) return tensor;
  return tensor.to(*dtype);
}

py::object wrap(at::Tensor tensor) {
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(tensor)));
}

// The tensors of a forward output the C++ post-hook handles: a plain tensor,
// or a tuple or list of them. False for anything else (the Python hook's).
bool output_tensors(py::handle output, std::vector<at::Tensor>& tensors) {
  if (is_plain_tensor(output)) {
    tensors.push_back(THPVariable_Unpack(output.ptr()));
    return true;
  }
  if (!PyTuple_CheckExact(output.ptr()) && !PyList_CheckExact(output.ptr())) return false;
  py::sequence items = py::reinterpret_borrow<py::sequence>(output);
  tensors.reserve(py::len(items));
  for (py::handle item : items) {
    if (!is_plain_tensor(item)) return false;
    tensors.push_back(THPVariable_Unpack(item.ptr()));
  }
  return true;
}

}  // namespace

ForwardHooks::ForwardHooks(const std::shared_ptr<FsdpState>& state, py::object python_pre,
                           py::object python_post)
    : state_(state), python_pre_(std::move(python_pre)), python_post_(std::move(python_post)) {}

bool ForwardHooks::takes_the_call() const {
  std::shared_ptr<FsdpState> state = state_.lock();
  if (!state || !state->forward_setup().ready || state->in_pre_backward()) return false;
  // The root's own hooks start and end the forward: Python's.
  std::shared_ptr<FsdpState> root = state->context()->forward_root();
  return root != nullptr && root != state;
}

py::object ForwardHooks::call_python(const py::object& weak_method, py::handle module,
                                     py::handle first, py::handle second) const {
  py::object method = weak_method();
  if (method.is_none()) return py::none();  // the state is gone with its module
  return method(module, first, second);
}

py::object ForwardHooks::pre(py::handle module, py::tuple args, py::dict kwargs) {
  if (!takes_the_call() || py::len(kwargs) != 0) {
    return call_python(python_pre_, module, args, kwargs);
  }
  for (py::handle arg : args) {
    if (!is_plain_tensor(arg)) return call_python(python_pre_, module, args, kwargs);
  }
  std::shared_ptr<FsdpState> state = state_.lock();
  const std::optional<at::ScalarType> input_dtype = state->forward_setup().input_dtype;
  const bool first_in_pass = state->enter_forward();
  // The inputs cast before the post-backward node wraps them, so that it
  // sees the gradients of the tensors the module really receives.
  const size_t count = args.size();
  std::vector<at::Tensor> inputs;
  inputs.reserve(count);
  bool changed = false;
  {
    // Upstream records the range wherever the policy casts inputs.
    std::optional<ProfilerRange> range;
    if (input_dtype) range.emplace([] { return "FSDP::cast_forward_inputs"; });
    for (py::handle arg : args) {
      const at::Tensor& tensor = THPVariable_Unpack(arg.ptr());
      inputs.push_back(cast_floating(tensor, input_dtype));
      changed = changed || !inputs.back().is_same(tensor);
    }
  }
  std::vector<at::Tensor> grad_inputs;
  if (at::GradMode::is_enabled()) {
    for (const at::Tensor& input : inputs) {
      if (input.requires_grad()) grad_inputs.push_back(input);
    }
  }
  const bool wraps = !grad_inputs.empty();
  std::vector<at::Tensor> wrapped = state->pre_forward_groups(std::move(grad_inputs));
  if (first_in_pass) state->prefetch_forward();
  if (!changed && !wraps) return py::none();
  py::tuple new_args(count);
  size_t next_wrapped = 0;
  for (size_t i = 0; i < count; ++i) {
    if (wraps && inputs[i].requires_grad()) {
      new_args[i] = wrap(wrapped[next_wrapped++]);
    } else if (inputs[i].is_same(THPVariable_Unpack(args[i].ptr()))) {
      new_args[i] = args[i];
    } else {
      new_args[i] = wrap(inputs[i]);
    }
  }
  return py::make_tuple(std::move(new_args), kwargs);
}

py::object ForwardHooks::post(py::handle module, py::handle input, py::handle output) {
  std::vector<at::Tensor> tensors;
  if (!takes_the_call() || !output_tensors(output, tensors)) {
    return call_python(python_post_, module, input, output);
  }
  std::shared_ptr<FsdpState> state = state_.lock();
  std::vector<at::Tensor> grad_outputs;
  if (at::GradMode::is_enabled()) {
    for (const at::Tensor& tensor : tensors) {
      if (tensor.requires_grad()) grad_outputs.push_back(tensor);
    }
  }
  const bool inside_backward = torch::autograd::get_current_graph_task_id() != -1;
  state->post_forward_groups(inside_backward, grad_outputs);
  const std::optional<at::ScalarType> output_dtype = state->forward_setup().output_dtype;
  if (!output_dtype) return py::none();
  ProfilerRange range([] { return "FSDP::cast_forward_outputs"; });
  if (is_plain_tensor(output)) return wrap(cast_floating(tensors.front(), output_dtype));
  py::list cast(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    cast[i] = wrap(cast_floating(tensors[i], output_dtype));
  }
  if (PyList_CheckExact(output.ptr())) return std::move(cast);
  return py::tuple(cast);
}

}  // namespace fsdp_ext::fsdp
