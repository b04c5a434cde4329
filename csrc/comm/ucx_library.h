// Which UCX this process runs: the library the loader bound (its version and
// directory) and the one the build linked against (the system's or the
// libucx wheel's, cmake/ucx.cmake). They differ where a program loads a UCX
// of its own before ours, or the wheel's libraries were not loaded first.
#pragma once

#include <string>

namespace fsdp_ext::comm {

struct UcxLibrary {
  std::string version;    // of the loaded libucp, e.g. "1.22.0"
  std::string directory;  // where the loaded libucp lies
  std::string built_against;  // "system" or "wheel": what the build linked
};

UcxLibrary loaded_ucx_library();

// "UCX 1.22.0 (wheel, /venv/.../libucx/lib)", for the group's log line.
std::string describe_ucx_library();

}  // namespace fsdp_ext::comm
