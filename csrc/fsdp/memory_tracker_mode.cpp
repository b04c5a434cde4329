#include "fsdp/memory_tracker_mode.hpp"

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/utils/pybind.h>

namespace fsdp_ext::fsdp {

bool memory_tracker_active() {
  if (c10::impl::TorchDispatchModeTLS::stack_len() == 0) return false;
  py::gil_scoped_acquire gil;
  // Leaked on purpose: released after the interpreter, a static py::object
  // would touch a finalized Python.
  static const py::object* tracker_class = [] {
    try {
      return new py::object(
          py::module_::import("torch.distributed._tools.mem_tracker").attr("MemTracker"));
    } catch (const py::error_already_set&) {
      return new py::object();  // no such tracker in this torch
    }
  }();
  if (!*tracker_class) return false;
  py::list stack = py::module_::import("torch.utils._python_dispatch")
                       .attr("_get_current_dispatch_mode_stack")();
  for (py::handle mode : stack) {
    if (py::isinstance(mode, *tracker_class)) return true;
  }
  return false;
}

}  // namespace fsdp_ext::fsdp
