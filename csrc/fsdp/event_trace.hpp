// The public event trace: while a Python sink is installed
// (torch_fsdp_ext.trace_fsdp_events), every group's unshard / reshard /
// post_backward appends (event, module fqn, training state) to it, in the
// order the state machine runs them. Upstream's tests patch private methods
// to see this order; ours reads it from the runtime itself.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "fsdp/training_state.hpp"

namespace fsdp_ext::fsdp {

namespace py = pybind11;

enum class TraceEvent { kUnshard, kReshard, kPostBackward };

class EventTrace {
 public:
  // `record(event, fqn, state)` is called for each event; None uninstalls.
  // Called with the GIL held, like every entry point of the runtime.
  static void set_sink(py::object record);
  static void emit(TraceEvent event, const std::string& module_fqn, TrainingState state);

 private:
  static bool active_;
};

}  // namespace fsdp_ext::fsdp
