#include "comm/ucx_config_defaults.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "comm/ucx_handles.h"

namespace fsdp_ext::comm {
namespace {

constexpr const char* kMmReceiveGrowth = "64";

// The value UCX will use for UCX_TLS (environment, or a ucx.conf file):
// ucp_config_print writes the effective configuration as NAME=value lines.
std::string effective_tls(const ucp_config_t* config) {
  char* text = nullptr;
  size_t length = 0;
  FILE* stream = open_memstream(&text, &length);
  if (stream == nullptr) return "";
  ucp_config_print(config, stream, nullptr, UCS_CONFIG_PRINT_CONFIG);
  std::fclose(stream);
  std::string tls;
  std::istringstream lines(std::string(text, length));
  std::free(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("UCX_TLS=", 0) == 0) tls = line.substr(8);
  }
  return tls;
}

std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> items;
  std::stringstream stream(list);
  for (std::string item; std::getline(stream, item, ',');) {
    // "name:aux" (a transport used for wire-up only) still names it.
    const size_t colon = item.find(':');
    if (colon != std::string::npos) item.resize(colon);
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

}  // namespace

bool ucx_tls_allows_mm_transports(const std::string& tls) {
  if (tls.empty()) return true;  // unset: every transport UCX finds
  const bool excluding = tls[0] == '^';
  bool names_family = false;  // "all", "sm", "shm" or "mm": posix and sysv both
  bool names_posix = false;
  bool names_sysv = false;
  for (std::string name : split_commas(excluding ? tls.substr(1) : tls)) {
    if (name[0] == '\\') name.erase(0, 1);  // a leading backslash: this transport exactly
    names_family |= name == "sm" || name == "shm" || name == "mm" || (!excluding && name == "all");
    names_posix |= name == "posix";
    names_sysv |= name == "sysv";
  }
  // xpmem is an mm transport too, but rarely installed: counting on it
  // alone would make UCX warn wherever it is missing.
  if (excluding) return !names_family && !(names_posix && names_sysv);
  return names_family || names_posix || names_sysv;
}

void apply_ucx_config_defaults(ucp_config_t* config) {
  for (const char* name : {"UCX_MM_RX_BUFS_GROW", "UCX_POSIX_RX_BUFS_GROW",
                           "UCX_SYSV_RX_BUFS_GROW", "UCX_XPMEM_RX_BUFS_GROW"}) {
    if (std::getenv(name) != nullptr) return;
  }
  if (!ucx_tls_allows_mm_transports(effective_tls(config))) return;
  check_ucs(ucp_config_modify(config, "MM_RX_BUFS_GROW", kMmReceiveGrowth),
            "ucp_config_modify(MM_RX_BUFS_GROW)");
}

}  // namespace fsdp_ext::comm
