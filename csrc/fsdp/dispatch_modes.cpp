#include "fsdp/dispatch_modes.hpp"

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/utils/pybind.h>

namespace fsdp_ext::fsdp {

bool memory_tracker_active() {
  if (c10::impl::TorchDispatchModeTLS::stack_len() == 0) return false;
  py::gil_scoped_acquire gil;
  // Looked up once. Leaked on purpose: released after the interpreter, a
  // static py::object would touch a finalized Python.
  struct Lookups {
    py::object tracker_class;  // None where this torch has no MemTracker
    py::object mode_stack;     // torch.utils._python_dispatch's reader
  };
  static const Lookups* lookups = [] {
    auto* found = new Lookups{py::none(), py::module_::import("torch.utils._python_dispatch")
                                              .attr("_get_current_dispatch_mode_stack")};
    try {
      found->tracker_class =
          py::module_::import("torch.distributed._tools.mem_tracker").attr("MemTracker");
    } catch (const py::error_already_set&) {
      // No such tracker in this torch: tracker_class stays None.
    }
    return found;
  }();
  if (lookups->tracker_class.is_none()) return false;
  py::list stack = lookups->mode_stack();
  for (py::handle mode : stack) {
    if (py::isinstance(mode, lookups->tracker_class)) return true;
  }
  return false;
}

bool fake_mode_active() {
  return c10::impl::TorchDispatchModeTLS::get_mode(c10::impl::TorchDispatchModeKey::FAKE)
      .has_value();
}

}  // namespace fsdp_ext::fsdp
