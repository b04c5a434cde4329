// An environment variable set for one scope and restored afterwards (unset
// again when it was unset), for tests of the FSDP_EXT_* variables.
#pragma once

#include <cstdlib>
#include <string>

namespace fsdp_ext::comm::testing {

// Sets an environment variable for one scope, restoring it afterwards. Set
// it only while no engine runs an op: the algorithms read FSDP_EXT_*_ALGO on
// the progress threads (submit() orders the write before those reads).
class ScopedVariable {
 public:
  ScopedVariable(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedVariable() {
    if (had_) {
      setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedVariable(const ScopedVariable&) = delete;
  ScopedVariable& operator=(const ScopedVariable&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

}  // namespace fsdp_ext::comm::testing
