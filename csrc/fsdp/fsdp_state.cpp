#include "fsdp/fsdp_state.hpp"

#include <torch/csrc/autograd/engine.h>

#include "fsdp/post_backward_registration.hpp"

#include <utility>

namespace fsdp_ext::fsdp {

FsdpStateContext::~FsdpStateContext() {
  if (!final_callback_) return;
  if (!Py_IsInitialized()) {
    final_callback_.release();  // the interpreter is gone: nothing to release it to
    return;
  }
  py::gil_scoped_acquire gil;
  final_callback_ = py::object();
}

void FsdpStateContext::set_final_callback(py::object callback) {
  final_callback_ = std::move(callback);
}

void FsdpStateContext::queue_final_callback() {
  if (final_callback_queued_) return;
  // Weak: the engine runs the callback at the end of this backward, and a
  // context dropped meanwhile (its model deleted) has nothing to finish.
  std::weak_ptr<FsdpStateContext> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    py::gil_scoped_acquire gil;
    if (std::shared_ptr<FsdpStateContext> context = weak.lock()) context->run_final_callback();
  });
  // Only once queued: queue_callback throws outside a backward, and a flag
  // set anyway would make every later backward skip its callback.
  final_callback_queued_ = true;
}

void FsdpStateContext::run_final_callback() {
  if (!final_callback_) {
    final_callback_queued_ = false;
    return;
  }
  py::object callback = final_callback_();
  if (callback.is_none()) {
    final_callback_queued_ = false;
    return;
  }
  // A Python error propagates to backward()'s caller as itself (autograd
  // restores a pybind11 error_already_set).
  callback();
}

void FsdpStateContext::set_states(const std::vector<std::shared_ptr<FsdpState>>& states) {
  states_.assign(states.begin(), states.end());
}

void FsdpStateContext::finish_backward(bool is_last_backward, bool defer_reduction) {
  // A copy: the groups may call Python (comm hooks, a Python process group),
  // which could set the states again meanwhile.
  const std::vector<std::weak_ptr<FsdpState>> states = states_;
  for (const auto& weak : states) {
    if (std::shared_ptr<FsdpState> state = weak.lock()) {
      state->finish_backward(is_last_backward, defer_reduction);
    }
  }
}

void FsdpState::set_groupless_forward_prefetch(
    std::vector<std::shared_ptr<FsdpParamGroup>> targets) {
  groupless_forward_prefetch_.assign(targets.begin(), targets.end());
}

bool FsdpState::enter_forward() {
  const bool first = training_state_ != TrainingState::kForward;
  training_state_ = TrainingState::kForward;
  return first;
}

std::vector<at::Tensor> FsdpState::pre_forward_groups(std::vector<at::Tensor> grad_inputs) {
  for (const auto& group : groups_) {
    const bool entering = group->training_state() != TrainingState::kForward;
    group->pre_forward();
    if (entering && !grad_inputs.empty()) {
      grad_inputs = register_post_backward(shared_from_this(), group, grad_inputs);
    }
  }
  return grad_inputs;
}

void FsdpState::prefetch_forward() {
  for (const auto& group : groups_) group->prefetch_forward_targets();
  for (const auto& weak_target : groupless_forward_prefetch_) {
    if (auto target = weak_target.lock()) target->prefetch_unshard(TrainingState::kForward);
  }
}

void FsdpState::post_forward_groups(bool inside_backward,
                                    const std::vector<at::Tensor>& grad_outputs) {
  for (const auto& group : groups_) group->post_forward(inside_backward);
  register_pre_backward(grad_outputs);
  training_state_ = TrainingState::kIdle;
}

void FsdpState::set_groupless_backward_prefetch(
    std::vector<std::shared_ptr<FsdpParamGroup>> targets) {
  groupless_backward_prefetch_.assign(targets.begin(), targets.end());
}

// Note [a view output loses its hook]
// The pre-backward hook goes on the module's output tensor. When that output
// is a view and the caller then changes it in place (`out += y`), autograd
// rebases the view onto a new grad_fn and the hook registered on it is
// dropped: the module's parameters are not all-gathered before its backward,
// which then fails or computes wrong gradients. Upstream FSDP2 warns about
// every such output; so does this, with the module's class names.
namespace {
void warn_view_output(const std::string& module_classes) {
  const std::string message =
      "torch_fsdp_ext.fully_shard: the FSDP module (" + module_classes +
      ") returned a view tensor. Changing it in place afterwards (e.g. `out += y`) drops "
      "FSDP's pre-backward hook on it, so the module's parameters are not all-gathered for "
      "its backward (an error or wrong gradients). Use out-of-place ops (`out = out + y`) "
      "or `.clone()` the output before changing it in place.";
  if (PyErr_WarnEx(PyExc_UserWarning, message.c_str(), 2) != 0) {
    throw py::error_already_set();  // warnings turned into errors
  }
}
}  // namespace

void FsdpState::register_pre_backward(const std::vector<at::Tensor>& outputs) {
  std::weak_ptr<FsdpState> weak = weak_from_this();
  for (const at::Tensor& output : outputs) {
    if (!output.defined() || !output.requires_grad()) continue;
    if (output.is_view()) warn_view_output(module_classes_);
    output.register_hook([weak](const at::Tensor&) {
      py::gil_scoped_acquire gil;
      if (std::shared_ptr<FsdpState> state = weak.lock()) state->pre_backward();
    });
  }
}

void FsdpState::finish_backward(bool is_last_backward, bool defer_reduction) {
  for (auto group = groups_.rbegin(); group != groups_.rend(); ++group) {
    (*group)->finish_backward(is_last_backward, defer_reduction);
  }
  training_state_ = TrainingState::kIdle;
}

void FsdpState::pre_backward() {
  training_state_ = TrainingState::kPreBackward;
  context_->queue_final_callback();
  for (const auto& group : groups_) group->run_pre_backward();
  for (const auto& weak_target : groupless_backward_prefetch_) {
    if (auto target = weak_target.lock()) target->prefetch_unshard(TrainingState::kPreBackward);
  }
}

}  // namespace fsdp_ext::fsdp
