// Who is failing: every error the backend raises names the op, the group and
// the rank, so a message from one rank of many is self-explanatory.
#pragma once

#include <string>

namespace fsdp_ext::backend {

struct OpLabel {
  const char* op;     // user-facing name, e.g. "all_gather_into_tensor"
  std::string group;  // "'0' (default_pg)"
  int rank;
  int size;

  std::string prefix() const {
    return std::string("fsdp_ext ") + op + " (group " + group + ", rank " +
           std::to_string(rank) + "/" + std::to_string(size) + "): ";
  }
};

}  // namespace fsdp_ext::backend
