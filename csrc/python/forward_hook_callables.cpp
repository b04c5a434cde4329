// The C++ forward hooks (csrc/fsdp/forward_hooks.hpp) as plain CPython
// callables, for module.register_forward_pre_hook / register_forward_hook.
//
// nn.Module calls them once per sharded module and forward. Through a pybind
// method each call went through pybind's dispatcher (a function record, an
// argument loader per parameter, type checks for the tuple and the dict),
// about as long as the hook's own fast path on a small block. Here each hook
// is a builtin function taking its positional arguments as an array
// (METH_FASTCALL), bound to a capsule that owns the ForwardHooks. Errors go
// through torch's own translation (HANDLE_TH_ERRORS, as torch's bindings):
// Python errors raised inside pass through as they are, c10 errors become
// their Python types (ValueError for TORCH_CHECK_VALUE), and TORCH_WARN
// becomes a Python warning.
//
// The capsule is invisible to Python's cycle collector, which is safe only
// because ForwardHooks holds its state and its Python hooks weakly (see
// forward_hooks.hpp); keep it so. Each runs with dynamo's frame callback
// cleared (Note [C++ hooks run outside dynamo]).
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>

#include "fsdp/forward_hooks.hpp"
#include "python/dynamo_frames_off.hpp"

namespace py = pybind11;

namespace fsdp_ext::python {
namespace {

constexpr const char* kCapsuleName = "torch_fsdp_ext.FsdpForwardHooks";

fsdp::ForwardHooks& hooks_of(PyObject* capsule) {
  return *static_cast<fsdp::ForwardHooks*>(PyCapsule_GetPointer(capsule, kCapsuleName));
}

// nn.Module calls both with three positional arguments:
// pre(module, args, kwargs) (with_kwargs=True) and post(module, args, output).
bool three_arguments(const char* hook, Py_ssize_t nargs) {
  if (nargs == 3) return true;
  PyErr_Format(PyExc_TypeError, "fsdp_ext forward %s-hook takes 3 positional arguments (%zd given)",
               hook, nargs);
  return false;
}

PyObject* call_pre(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!three_arguments("pre", nargs)) return nullptr;
  if (!PyTuple_Check(args[1]) || !PyDict_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError,
                    "fsdp_ext forward pre-hook takes (module, args: tuple, kwargs: dict)");
    return nullptr;
  }
  DynamoFramesOff outside_dynamo;
  return hooks_of(capsule)
      .pre(args[0], py::reinterpret_borrow<py::tuple>(args[1]),
           py::reinterpret_borrow<py::dict>(args[2]))
      .release()
      .ptr();
  END_HANDLE_TH_ERRORS
}

PyObject* call_post(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!three_arguments("post", nargs)) return nullptr;
  DynamoFramesOff outside_dynamo;
  return hooks_of(capsule).post(args[0], args[1], args[2]).release().ptr();
  END_HANDLE_TH_ERRORS
}

// METH_FASTCALL functions have another signature than PyCFunction; CPython
// casts them back by the flag. Through void(*)() to say the cast is meant.
template <typename Function>
PyCFunction as_method(Function function) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(function));
}

PyMethodDef kPreDef = {"fsdp_ext_forward_pre_hook", as_method(call_pre), METH_FASTCALL,
                       "fsdp_ext_forward_pre_hook($self, module, args, kwargs, /)\n--\n\n"
                       "fully_shard's forward pre-hook for one module."};
PyMethodDef kPostDef = {"fsdp_ext_forward_hook", as_method(call_post), METH_FASTCALL,
                        "fsdp_ext_forward_hook($self, module, args, output, /)\n--\n\n"
                        "fully_shard's forward post-hook for one module."};

py::object bound(PyMethodDef* def, const py::object& capsule, const py::object& module_name) {
  PyObject* function = PyCFunction_NewEx(def, capsule.ptr(), module_name.ptr());
  if (function == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(function);
}

}  // namespace

void bind_forward_hooks(py::module_& m) {
  DynamoFramesOff::look_up();
  m.def(
      "_fsdp_forward_hooks",
      [](const std::shared_ptr<fsdp::FsdpState>& state, py::object python_pre,
         py::object python_post) {
        auto owner = std::make_unique<fsdp::ForwardHooks>(state, std::move(python_pre),
                                                          std::move(python_post));
        PyObject* capsule = PyCapsule_New(owner.get(), kCapsuleName, [](PyObject* self) {
          delete static_cast<fsdp::ForwardHooks*>(PyCapsule_GetPointer(self, kCapsuleName));
        });
        if (capsule == nullptr) throw py::error_already_set();
        owner.release();  // the capsule's now
        py::object held = py::reinterpret_steal<py::object>(capsule);
        py::object module_name = py::str("torch_fsdp_ext._C");
        return py::make_tuple(bound(&kPreDef, held, module_name),
                              bound(&kPostDef, held, module_name));
      },
      py::arg("state"), py::arg("python_pre"), py::arg("python_post"),
      "(pre, post): a one-module state's forward hooks, C++ for the common case and the given "
      "Python hooks (weakref.WeakMethod) for the rest, as builtin functions for "
      "register_forward_pre_hook(with_kwargs=True) and register_forward_hook.");
}

}  // namespace fsdp_ext::python
