// A method of a C++ runtime object that Python code may replace by assigning
// the attribute, as it could on upstream's Python object.
//
// Note [a group's backward methods replaced from Python]: torch's
// FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker) instruments
// upstream's FSDPParamGroup by reading `group.pre_backward` and
// `group.post_backward`, wrapping each, and assigning the wrapper back; on
// exit it assigns the saved originals. Upstream's autograd hooks then call
// whatever the attribute holds. Ours are C++ and call the group directly, so
// the group keeps such an assignment here and its hooks run it instead
// (FsdpParamGroup::run_pre_backward / run_post_backward). Python reads the
// replacement, or else one bound callable made once, so that assigning the
// value read earlier restores the C++ path with no Python frame left in it.
// A replacement that refers to the module (the tool's wrappers do) makes a
// cycle through this C++ object, which Python's collector cannot see: it
// lasts until the original is assigned back (the tool's exit does).
#pragma once

#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "fsdp/training_state.hpp"  // FSDP_EXT_HIDDEN

namespace fsdp_ext::fsdp {

namespace py = pybind11;

class FSDP_EXT_HIDDEN ReplaceableMethod {
 public:
  explicit ReplaceableMethod(const char* name) : name_(name) {}

  // What Python reads: the replacement, else the original, made by
  // `make_original` on first use (a callable running the C++ method).
  template <typename MakeOriginal>
  py::object get(MakeOriginal&& make_original) {
    if (replacement_) return replacement_;
    if (!original_) original_ = make_original();
    return original_;
  }

  // Assigning the original (or None) undoes a replacement.
  void set(py::object value) {
    if (value.is_none() || (original_ && value.is(original_))) {
      replacement_ = py::object();
      return;
    }
    if (!PyCallable_Check(value.ptr())) {
      throw py::type_error(std::string("FsdpParamGroup.") + name_ + " must be callable, got " +
                           std::string(py::str(py::type::of(value).attr("__name__"))));
    }
    replacement_ = std::move(value);
  }

  // The replacement if there is one (with the GIL), else `original()`.
  template <typename Original>
  void call(Original&& original) {
    if (!replacement_) return original();
    py::gil_scoped_acquire gil;
    // A copy: the call may assign the attribute again (a tool's exit).
    py::object replacement = replacement_;
    replacement();
  }

 private:
  const char* name_;
  // The bound original holds the group weakly (no cycle through it).
  py::object original_;
  py::object replacement_;
};

}  // namespace fsdp_ext::fsdp
