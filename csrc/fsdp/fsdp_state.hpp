// The hook layer's state of one fully_shard call (upstream FSDP2's
// FSDPState): which hook ran last, the call's parameter groups, and the
// backward hooks, which run in C++ with no Python frame.
//
// Note [the hook layer's order in one step]: per module, as upstream's:
//  1. forward pre-hook (C++, forward_hooks.hpp; Python for the root, and
//     wherever the C++ one hands over, torch_fsdp_ext/fsdp/_state.py): lazy init at
//     the root, training state FORWARD, each group's pre_forward (unshard),
//     then the post-backward node on the forward inputs that need gradients
//     (post_backward_registration.hpp), then the forward prefetches;
//  2. forward post-hook (the same split): each group's post_forward (reshard), then
//     the pre-backward hook on the outputs that need gradients (here),
//     training state IDLE;
//  3. pre-backward (here, a C++ tensor hook: autograd calls it when the
//     gradient of one of the module's outputs is ready, before the module's
//     backward): training state PRE_BACKWARD, the end-of-backward callback
//     queued, each group's pre_backward (unshard, backward prefetch);
//  4. post-backward (the node's backward, after the module's whole
//     backward): the group's post_backward (reshard, reduce-scatter), and the
//     callback queued in case no pre-backward hook ran (Note [end of backward
//     for a partial grouped forward] in docs/design.md);
//  5. the end-of-backward callback (once per backward, queued on autograd's
//     engine, run after the last node): the root's Python callback, which
//     finishes every state's groups (FsdpStateContext::finish_backward, one
//     C++ call for all of them) and the reductions in flight.
// Steps 3 and 4 hold the GIL while they call the groups: a group may call
// Python (comm hooks, all-gather extensions, a Python process group).
//
// Ownership: the Python state owns this object, and this object its groups.
// The hooks in the autograd graph hold it weakly, so a graph that outlives
// its model keeps nothing alive and frees nothing that needs the GIL.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <optional>
#include <vector>

#include "fsdp/fsdp_param_group.hpp"
#include "fsdp/training_state.hpp"

namespace fsdp_ext::fsdp {

class FsdpState;

// Shared by the states under one root (from its lazy init on): whether the
// end-of-backward callback is queued for the current backward, and what it
// runs.
class FSDP_EXT_HIDDEN FsdpStateContext : public std::enable_shared_from_this<FsdpStateContext> {
 public:
  FsdpStateContext() = default;
  ~FsdpStateContext();
  FsdpStateContext(const FsdpStateContext&) = delete;
  FsdpStateContext& operator=(const FsdpStateContext&) = delete;

  // `callback`: a Python callable returning the callable to run, or None
  // when its owner is gone (a weakref.WeakMethod of the root's
  // _root_post_backward_final_callback: a strong reference from here would
  // close a cycle through C++ that Python's collector cannot see).
  void set_final_callback(py::object callback);
  // Once per backward: queue the callback on autograd's engine. Inside a
  // backward only (as autograd's queue_callback); needs the GIL.
  void queue_final_callback();
  bool final_callback_queued() const { return final_callback_queued_; }
  // The state whose pre-forward started the current forward (upstream's
  // iter_forward_root, which the Python state context sets through here);
  // null between forwards. The C++ forward hooks leave its hooks to Python.
  std::shared_ptr<FsdpState> forward_root() const { return forward_root_.lock(); }
  void set_forward_root(const std::shared_ptr<FsdpState>& root) { forward_root_ = root; }
  // The callback ran (or the iteration was reset): the next backward queues
  // it again.
  void final_callback_done() { final_callback_queued_ = false; }

  // Every state under the root, in the root's module order (set at its lazy
  // init; weak: each state holds this context).
  void set_states(const std::vector<std::shared_ptr<FsdpState>>& states);
  // The end-of-backward callback's per-state part: each state's
  // finish_backward, in order (a group's error stops it there, as a loop
  // over the states in Python would).
  void finish_backward(bool is_last_backward, bool defer_reduction);

 private:
  void run_final_callback();

  py::object final_callback_;
  bool final_callback_queued_ = false;
  std::weak_ptr<FsdpState> forward_root_;
  std::vector<std::weak_ptr<FsdpState>> states_;
};

class FSDP_EXT_HIDDEN FsdpState : public std::enable_shared_from_this<FsdpState> {
 public:
  FsdpState() : context_(std::make_shared<FsdpStateContext>()) {}

  TrainingState training_state() const { return training_state_; }
  void set_training_state(TrainingState state) { training_state_ = state; }

  const std::shared_ptr<FsdpStateContext>& context() const { return context_; }
  void set_context(std::shared_ptr<FsdpStateContext> context) { context_ = std::move(context); }

  const std::vector<std::shared_ptr<FsdpParamGroup>>& groups() const { return groups_; }
  void set_groups(std::vector<std::shared_ptr<FsdpParamGroup>> groups) {
    groups_ = std::move(groups);
  }
  // set_modules_to_forward_prefetch / _backward_prefetch on a state
  // without parameters: the targets it unshards itself when its forward or
  // backward starts (a state with parameters leaves them to its first group).
  void set_groupless_forward_prefetch(std::vector<std::shared_ptr<FsdpParamGroup>> targets);
  void set_groupless_backward_prefetch(std::vector<std::shared_ptr<FsdpParamGroup>> targets);

  // Steps 1 and 2 of Note [the hook layer's order in one step], past the
  // Python hooks' handling of arguments and outputs (which may be any
  // pytree; these take the tensors among them that need gradients).
  // Forward pre-hook: activation-checkpoint recomputation inside backward
  // (the state's pre-backward ran) only unshards, so the hook asks first.
  bool in_pre_backward() const { return training_state_ == TrainingState::kPreBackward; }
  // FORWARD; true when the state was not in FORWARD yet (the first forward
  // hook of this state in the pass: a grouped state runs several).
  bool enter_forward();
  // Each group's pre_forward; each group that entered FORWARD here wraps
  // `grad_inputs` (empty when grad mode is off) in its post-backward node.
  // Returns them as wrapped.
  std::vector<at::Tensor> pre_forward_groups(std::vector<at::Tensor> grad_inputs);
  // The first forward hook of the pass: the explicit forward prefetches.
  void prefetch_forward();
  // Forward post-hook: each group's post_forward, the pre-backward hook on
  // `grad_outputs`, then IDLE.
  void post_forward_groups(bool inside_backward, const std::vector<at::Tensor>& grad_outputs);

  // What the C++ forward hooks (forward_hooks.hpp) need of the Python
  // state, set at the root's lazy init: whether they may take this state's
  // forwards at all (one module, lazily initialized), and the mixed-precision
  // casts of its inputs and outputs (none: nullopt).
  struct ForwardSetup {
    bool ready = false;
    std::optional<at::ScalarType> input_dtype;
    std::optional<at::ScalarType> output_dtype;
  };
  const ForwardSetup& forward_setup() const { return forward_setup_; }
  void set_forward_setup(ForwardSetup setup) { forward_setup_ = setup; }

  // Step 3 of Note [the hook layer's order in one step]: a C++ hook on each
  // of `outputs` that requires grad. An output that is a view gets a
  // UserWarning first, as upstream gives (Note [a view output loses its hook]).
  // Needs the GIL.
  void register_pre_backward(const std::vector<at::Tensor>& outputs);
  // The class names of the state's modules, for that warning.
  const std::string& module_classes() const { return module_classes_; }
  void set_module_classes(std::string names) { module_classes_ = std::move(names); }
  // What that hook does (needs the GIL).
  void pre_backward();
  // Step 5's share of this state: each group's finish_backward, the last
  // group first (autograd's order within one module), then IDLE.
  void finish_backward(bool is_last_backward, bool defer_reduction);

 private:
  TrainingState training_state_ = TrainingState::kIdle;
  std::shared_ptr<FsdpStateContext> context_;
  std::vector<std::shared_ptr<FsdpParamGroup>> groups_;
  std::vector<std::weak_ptr<FsdpParamGroup>> groupless_forward_prefetch_;
  std::vector<std::weak_ptr<FsdpParamGroup>> groupless_backward_prefetch_;
  ForwardSetup forward_setup_;
  std::string module_classes_ = "?";
};

}  // namespace fsdp_ext::fsdp
