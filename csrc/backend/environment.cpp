#include "backend/environment.hpp"

#include "comm/algorithm_selection.h"

#include <c10/util/Exception.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string_view>

extern char** environ;

namespace fsdp_ext::backend {
namespace {

// The backend's own variables; the FSDP_EXT_*_ALGO ones are listed where
// they are parsed (comm::kForcedAlgorithmVariables).
constexpr std::array<const char*, 7> kBackendVariables = {
    "FSDP_EXT_SPIN_US",   "FSDP_EXT_WAIT_SPIN_US", "FSDP_EXT_SHARED_MEMORY",
    "FSDP_EXT_PROCESS_READS", "FSDP_EXT_SMALL_OPS", "FSDP_EXT_CUDA_PATH",
    "FSDP_EXT_CUDA_IPC_HANDLES"};

// The package's variables that the backend does not read but must not take
// for typos: fully_shard's, and the build's (setup.py), which a shell that
// built the package may still export.
constexpr std::array<const char*, 3> kOtherPackageVariables = {
    "FSDP_EXT_FSDP_STREAMS", "FSDP_EXT_UCX", "FSDP_EXT_CUDA"};

// Calls `visit` with every variable the backend reads.
template <typename Visit>
void for_each_known_variable(Visit visit) {
  for (const char* name : kBackendVariables) visit(name);
  for (const char* name : comm::kForcedAlgorithmVariables) visit(name);
}

bool is_package_variable(const std::string& name) {
  bool known = false;
  for_each_known_variable([&](const char* candidate) { known = known || name == candidate; });
  for (const char* candidate : kOtherPackageVariables) known = known || name == candidate;
  return known;
}

std::string known_list() {
  std::string out;
  for_each_known_variable(
      [&](const char* name) { out += (out.empty() ? "" : ", ") + std::string(name); });
  return out;
}

// A non-negative integer, or `fallback` when unset; `meaning` says in the
// error what the number counts.
int64_t non_negative_integer(const char* variable, int64_t fallback, const char* meaning,
                             const std::string& where) {
  const char* value = std::getenv(variable);
  if (value == nullptr || value[0] == '\0') return fallback;
  errno = 0;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK_VALUE(errno == 0 && end != value && *end == '\0' && parsed >= 0, where, variable,
                    "='", value, "' is not valid; expected a non-negative integer (", meaning,
                    ")");
  return parsed;
}

std::chrono::microseconds microseconds(const char* variable, int64_t fallback,
                                       const std::string& where) {
  return std::chrono::microseconds(
      non_negative_integer(variable, fallback, "microseconds", where));
}

// "0" turns a feature off, "1" (or unset) leaves it on.
bool switch_on(const char* variable, const std::string& where) {
  const char* value = std::getenv(variable);
  if (value == nullptr || value[0] == '\0') return true;
  TORCH_CHECK_VALUE(std::strcmp(value, "0") == 0 || std::strcmp(value, "1") == 0, where,
                    variable, "='", value, "' is not valid; expected 0 (off) or 1 (on)");
  return std::strcmp(value, "1") == 0;
}

// One of `accepted` (the first is the default, taken when unset).
std::string one_of(const char* variable, std::initializer_list<const char*> accepted,
                   const std::string& where) {
  const char* value = std::getenv(variable);
  if (value == nullptr || value[0] == '\0') return *accepted.begin();
  std::string names;
  for (const char* name : accepted) {
    if (std::strcmp(value, name) == 0) return value;
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  TORCH_CHECK_VALUE(false, where, variable, "='", value, "' is not valid; expected one of ",
                    names);
  return "";
}

}  // namespace

BackendEnvironment read_environment(const std::string& where) {
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view assignment(*entry);
    if (assignment.rfind("FSDP_EXT_", 0) != 0) continue;
    const std::string name(assignment.substr(0, assignment.find('=')));
    TORCH_CHECK_VALUE(is_package_variable(name), where, "unknown variable ", name, " in the environment; the "
                      "backend reads ", known_list());
  }
  for (const char* variable : comm::kForcedAlgorithmVariables) {
    const char* value = std::getenv(variable);
    if (value == nullptr || value[0] == '\0') continue;
    TORCH_CHECK_VALUE(comm::is_forced_algorithm_name(value), where, variable, "='", value,
                      "' is not valid; expected ", comm::kForcedAlgorithmValues);
  }
  BackendEnvironment out;
  out.spin = microseconds("FSDP_EXT_SPIN_US", 100, where);
  microseconds("FSDP_EXT_WAIT_SPIN_US", 1000, where);  // checked here, read by the Work
  out.shared_memory = switch_on("FSDP_EXT_SHARED_MEMORY", where);
  out.process_reads = switch_on("FSDP_EXT_PROCESS_READS", where);
  out.small_ops = switch_on("FSDP_EXT_SMALL_OPS", where);
  out.cuda_path = one_of("FSDP_EXT_CUDA_PATH", {"auto", "ipc", "nccl", "staged"}, where);
  out.cuda_ipc_handles =
      one_of("FSDP_EXT_CUDA_IPC_HANDLES", {"auto", "legacy", "descriptors"}, where);
  // torch's own, read by the Flight Recorder (flight_recorder.cpp), which
  // would take a bad value for "off" without a word; torch refuses it too.
  for (const char* variable : {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}) {
    non_negative_integer(variable, 0, "the number of ops the Flight Recorder keeps; 0: off",
                         where);
  }
  return out;
}

std::chrono::microseconds wait_spin_from_environment() {
  const char* value = std::getenv("FSDP_EXT_WAIT_SPIN_US");
  if (value == nullptr || value[0] == '\0') return std::chrono::microseconds(1000);
  const long long parsed = std::strtoll(value, nullptr, 10);
  return std::chrono::microseconds(parsed < 0 ? 0 : parsed);
}

}  // namespace fsdp_ext::backend
