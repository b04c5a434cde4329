// The post-backward registration: an identity autograd node on a module's
// forward inputs whose backward tells the module's parameter group that its
// gradients are complete.
//
// Note [when a group's backward is over]: autograd runs a node once every
// gradient flowing into it has arrived. A node placed on the inputs of a
// module's forward (the tensors among them that need gradients) therefore
// runs after the module's whole backward: every gradient of the module's
// parameters has been accumulated by then, so the group may reduce them.
// Upstream FSDP2 places a Python autograd.Function there; this is the same
// node in C++ (torch::autograd::Function), so neither the forward nor the
// backward runs a Python frame for it (step 4 of Note [the hook layer's
// order in one step], fsdp_state.hpp). Its outputs are the inputs as autograd returns inputs of a
// custom function (views of them, made without grad), as upstream's are.
//
// Modules whose inputs need no gradient (the root's, usually) get no node:
// the root's end-of-backward callback runs their post_backward instead.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "fsdp/fsdp_param_group.hpp"
#include "fsdp/fsdp_state.hpp"

namespace fsdp_ext::fsdp {

// `inputs`, each of which requires grad, wrapped by one node whose backward
// calls group->run_post_backward() and queues the state's end-of-backward
// callback (with the GIL). Returns the wrapped tensors, in order.
std::vector<at::Tensor> register_post_backward(const std::shared_ptr<FsdpState>& state,
                                               const std::shared_ptr<FsdpParamGroup>& group,
                                               const std::vector<at::Tensor>& inputs);

}  // namespace fsdp_ext::fsdp
