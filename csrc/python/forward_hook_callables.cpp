// The C++ forward hooks (csrc/fsdp/forward_hooks.hpp) as plain CPython
// callables, for module.register_forward_pre_hook / register_forward_hook.
//
// nn.Module calls them once per sharded module and forward. Through a pybind
// method each call went through pybind's dispatcher (a function record, an
// argument loader per parameter, type checks for the tuple and the dict),
// about as long as the hook's own fast path on a small block. Here each hook
// is a builtin function taking its positional arguments as an array
// (METH_FASTCALL), bound to a capsule that owns the ForwardHooks; torch's
// HANDLE_TH_ERRORS turns C++ errors into the Python exceptions pybind would
// have raised.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>

#include "fsdp/forward_hooks.hpp"

namespace py = pybind11;

namespace fsdp_ext::python {
namespace {

constexpr const char* kCapsuleName = "torch_fsdp_ext.FsdpForwardHooks";

fsdp::ForwardHooks& hooks_of(PyObject* capsule) {
  return **static_cast<std::shared_ptr<fsdp::ForwardHooks>*>(
      PyCapsule_GetPointer(capsule, kCapsuleName));
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
  return hooks_of(capsule).post(args[0], args[1], args[2]).release().ptr();
  END_HANDLE_TH_ERRORS
}

PyMethodDef kPreDef = {"fsdp_ext_forward_pre_hook", reinterpret_cast<PyCFunction>(call_pre),
                       METH_FASTCALL, "fully_shard's forward pre-hook for one module."};
PyMethodDef kPostDef = {"fsdp_ext_forward_hook", reinterpret_cast<PyCFunction>(call_post),
                        METH_FASTCALL, "fully_shard's forward post-hook for one module."};

py::object bound(PyMethodDef* def, const py::object& capsule) {
  PyObject* function = PyCFunction_NewEx(def, capsule.ptr(), nullptr);
  if (function == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(function);
}

}  // namespace

void bind_forward_hooks(py::module_& m) {
  m.def(
      "_fsdp_forward_hooks",
      [](const std::shared_ptr<fsdp::FsdpState>& state, py::object python_pre,
         py::object python_post) {
        auto* owner = new std::shared_ptr<fsdp::ForwardHooks>(std::make_shared<fsdp::ForwardHooks>(
            state, std::move(python_pre), std::move(python_post)));
        PyObject* capsule = PyCapsule_New(owner, kCapsuleName, [](PyObject* self) {
          delete static_cast<std::shared_ptr<fsdp::ForwardHooks>*>(
              PyCapsule_GetPointer(self, kCapsuleName));
        });
        if (capsule == nullptr) {
          delete owner;
          throw py::error_already_set();
        }
        py::object held = py::reinterpret_steal<py::object>(capsule);
        return py::make_tuple(bound(&kPreDef, held), bound(&kPostDef, held));
      },
      py::arg("state"), py::arg("python_pre"), py::arg("python_post"),
      "(pre, post): a one-module state's forward hooks, C++ for the common case and the given "
      "Python hooks (weakref.WeakMethod) for the rest, as builtin functions for "
      "register_forward_pre_hook(with_kwargs=True) and register_forward_hook.");
}

}  // namespace fsdp_ext::python
