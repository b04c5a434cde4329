// ProfilerRange: one phase of the FSDP runtime as a torch.profiler range
// (a user annotation, as torch.profiler.record_function makes), named as
// upstream FSDP2 names its phases: "FSDP::pre_forward (layers.0)". Traces of
// our runtime then read like upstream's, phase for phase.
//
// The label is built only while an observer (the profiler) is listening: a
// range costs one branch otherwise, which matters on a path that runs for
// every group of every step.
#pragma once

#include <ATen/record_function.h>

#include <string>
#include <utility>

namespace fsdp_ext::fsdp {

class ProfilerRange {
 public:
  // `label()` returns the range's name; called only when recording.
  template <typename LabelFn>
  explicit ProfilerRange(LabelFn&& label) : guard_(at::RecordScope::USER_SCOPE) {
    if (guard_.isActive()) guard_.before(std::string(std::forward<LabelFn>(label)()));
  }
  ProfilerRange(const ProfilerRange&) = delete;
  ProfilerRange& operator=(const ProfilerRange&) = delete;

 private:
  at::RecordFunction guard_;  // ends the range when destroyed
};

}  // namespace fsdp_ext::fsdp
