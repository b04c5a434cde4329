#pragma once
// Note [C++ hooks run outside dynamo]
// Upstream's FSDP hooks are dynamo-disabled functions: nothing they call is
// compiled. Ours are C++ builtins (forward_hook_callables.cpp). Inside a
// compiled module's _call_impl dynamo cannot trace them, so it graph-breaks
// and calls them eagerly with its frame callback still set, and every Python
// frame they call back into would be compiled as a frame of its own: an
// all-gather extension's hooks (torchao's float8 post hook assigns the new
// scale to the unsharded weight, out._scale = scale, which compiled that way
// never reached the weight: each step ran with the previous step's scale),
// custom comm hooks, nn.Parameter's constructor. So each C++ forward hook
// runs with the callback cleared, as torch._dynamo.disable runs a function,
// and restores it on the way out. Outside torch.compile the callback is
// already None and this costs one call of a builtin (11 ns).
#include <torch/csrc/utils/pybind.h>

namespace fsdp_ext::python {

class DynamoFramesOff {
 public:
  // torch._C._dynamo.eval_frame.set_eval_frame (a C builtin: sets the
  // thread's frame callback, returns the one it replaces), looked up once
  // when the extension module is imported: under the GIL on one thread, so
  // no hook ever imports while another waits on it.
  static void look_up() {
    pybind11::object function =
        pybind11::module_::import("torch._C._dynamo.eval_frame").attr("set_eval_frame");
    set_eval_frame_ = function.release().ptr();  // kept for the process's life
  }

  DynamoFramesOff() {
    PyObject* prior = PyObject_CallOneArg(set_eval_frame_, Py_None);
    if (prior == nullptr) throw pybind11::error_already_set();
    if (prior == Py_None) {
      Py_DECREF(prior);  // nothing to restore: the common, eager case
    } else {
      prior_ = prior;
    }
  }

  ~DynamoFramesOff() {
    if (prior_ == nullptr) return;
    // The hook may be returning with a Python error set: keep it aside.
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject* cleared = PyObject_CallOneArg(set_eval_frame_, prior_);
    if (cleared == nullptr) {
      PyErr_WriteUnraisable(set_eval_frame_);  // nothing better in a destructor
    } else {
      Py_DECREF(cleared);
    }
    Py_DECREF(prior_);
    PyErr_Restore(type, value, traceback);
  }

  DynamoFramesOff(const DynamoFramesOff&) = delete;
  DynamoFramesOff& operator=(const DynamoFramesOff&) = delete;

 private:
  static inline PyObject* set_eval_frame_ = nullptr;
  PyObject* prior_ = nullptr;  // owned; null when the callback was None
};

}  // namespace fsdp_ext::python
