#include "comm/ucx_library.h"

#include <dlfcn.h>
#include <ucp/api/ucp.h>

#ifndef FSDP_EXT_UCX_SOURCE
#error "FSDP_EXT_UCX_SOURCE (system or wheel) comes from cmake/ucx.cmake"
#endif

namespace fsdp_ext::comm {

UcxLibrary loaded_ucx_library() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  UcxLibrary library;
  library.version =
      std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
  // The object that defines ucp_get_version is the libucp the loader bound.
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&ucp_get_version), &info) != 0 && info.dli_fname) {
    library.directory = info.dli_fname;
    const auto slash = library.directory.rfind('/');
    library.directory = slash == std::string::npos ? "." : library.directory.substr(0, slash);
  }
  library.built_against = FSDP_EXT_UCX_SOURCE;
  return library;
}

std::string describe_ucx_library() {
  const UcxLibrary library = loaded_ucx_library();
  return "UCX " + library.version + " (" + library.built_against + ", " +
         (library.directory.empty() ? std::string("unknown directory") : library.directory) + ")";
}

}  // namespace fsdp_ext::comm
