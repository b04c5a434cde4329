#include "fsdp/post_backward_registration.hpp"

#include <torch/csrc/autograd/custom_function.h>

#include <utility>

namespace fsdp_ext::fsdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the node's backward acts on, carried in the autograd context (whose
// saved data holds IValues: a capsule is the one that holds a C++ object).
// Weak, as the pre-backward hooks: the graph keeps no model alive, and
// dropping it frees nothing that needs the GIL.
struct PostBackwardTarget : torch::CustomClassHolder {
  PostBackwardTarget(std::weak_ptr<FsdpState> state, std::weak_ptr<FsdpParamGroup> group)
      : state(std::move(state)), group(std::move(group)) {}
  std::weak_ptr<FsdpState> state;
  std::weak_ptr<FsdpParamGroup> group;
};

constexpr const char* kTarget = "fsdp_ext.post_backward_target";

struct PostBackward : torch::autograd::Function<PostBackward> {
  // `inputs` as a TensorList: that is the argument type whose tensors
  // autograd takes as the node's inputs (a vector would be an opaque value).
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs,
                               c10::intrusive_ptr<PostBackwardTarget> target) {
    ctx->saved_data[kTarget] = c10::IValue::make_capsule(std::move(target));
    // Returned as they came: autograd makes each a view of its input whose
    // gradient flows through this node (Note [when a group's backward is over]).
    return inputs.vec();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto target = c10::static_intrusive_pointer_cast<PostBackwardTarget>(
        ctx->saved_data.at(kTarget).toCapsule());
    {
      // The group may call Python (comm hooks, all-gather extensions, a
      // Python process group). Locked under the GIL: if this is the last
      // reference, the group and state are freed with it held.
      py::gil_scoped_acquire gil;
      std::shared_ptr<FsdpState> state = target->state.lock();
      std::shared_ptr<FsdpParamGroup> group = target->group.lock();
      if (state && group) {
        group->run_post_backward();
        // Note [end of backward for a partial grouped forward] (docs/design.md).
        state->context()->queue_final_callback();
      }
    }
    grads.emplace_back();  // none for `target`
    return grads;
  }
};

}  // namespace

std::vector<at::Tensor> register_post_backward(const std::shared_ptr<FsdpState>& state,
                                               const std::shared_ptr<FsdpParamGroup>& group,
                                               const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK_VALUE(state != nullptr && group != nullptr,
                    "register_post_backward: no FSDP state or parameter group (None)");
  return PostBackward::apply(at::TensorList(inputs),
                             c10::make_intrusive<PostBackwardTarget>(state, group));
}

}  // namespace fsdp_ext::fsdp
