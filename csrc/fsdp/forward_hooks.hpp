// The forward pre- and post-hooks of a fully_shard state over one module,
// registered on the module as C++ callables (steps 1 and 2 of Note [the hook
// layer's order in one step], fsdp_state.hpp).
//
// Each hook takes the common case itself: a state below the root of the
// current forward, its arguments plain tensors, its output a tensor or a
// tuple or list of them. Everything else goes to the Python hook it was
// built with (torch_fsdp_ext/fsdp/_state.py): the root's forward (lazy
// init, inputs to the device, the end of the forward), activation-checkpoint
// recomputation, keyword arguments and other pytrees, states made of several
// modules. Both paths do the same steps in the same order; the C++ one saves
// the Python frames of a hook per module and forward.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <optional>

#include "fsdp/fsdp_state.hpp"

namespace fsdp_ext::fsdp {

class FSDP_EXT_HIDDEN ForwardHooks {
 public:
  // `python_pre` / `python_post`: the Python hooks, as weakref.WeakMethod
  // objects (the module holds these hooks; a strong reference to its state
  // from here would close a cycle that Python's collector cannot see).
  ForwardHooks(const std::shared_ptr<FsdpState>& state, py::object python_pre,
               py::object python_post);

  // register_forward_pre_hook(..., with_kwargs=True): None (unchanged) or
  // (args, kwargs).
  py::object pre(py::handle module, py::tuple args, py::dict kwargs);
  // register_forward_hook: None (unchanged) or the output.
  py::object post(py::handle module, py::handle input, py::handle output);

 private:
  // Whether this call is the C++ path's: set up, below the forward's root,
  // not a recomputation.
  bool takes_the_call() const;
  py::object call_python(const py::object& weak_method, py::handle module, py::handle first,
                         py::handle second) const;

  std::weak_ptr<FsdpState> state_;
  py::object python_pre_;
  py::object python_post_;
};

}  // namespace fsdp_ext::fsdp
