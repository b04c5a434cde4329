#include "fsdp/event_trace.hpp"

namespace fsdp_ext::fsdp {
namespace {

// Leaked on purpose: a py::object destroyed after interpreter shutdown
// would touch a dead interpreter.
py::object* sink() {
  static py::object* record = new py::object();
  return record;
}

const char* event_name(TraceEvent event) {
  switch (event) {
    case TraceEvent::kUnshard: return "unshard";
    case TraceEvent::kReshard: return "reshard";
    case TraceEvent::kPostBackward: return "post_backward";
  }
  return "?";
}

}  // namespace

bool EventTrace::active_ = false;

void EventTrace::set_sink(py::object record) {
  active_ = !record.is_none();
  *sink() = active_ ? std::move(record) : py::object();
}

void EventTrace::emit(TraceEvent event, const std::string& module_fqn, TrainingState state) {
  if (!active_) return;
  (*sink())(event_name(event), module_fqn, state);
}

}  // namespace fsdp_ext::fsdp
