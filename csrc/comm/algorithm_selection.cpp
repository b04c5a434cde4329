#include "comm/algorithm_selection.h"

#include <cstdlib>
#include <cstring>

namespace fsdp_ext::comm {
namespace {

constexpr size_t kRingThresholdBytes = 1 << 20;
constexpr int kRingMinRanks = 4;
constexpr size_t kAllreduceDirectMaxBytes = 64 << 10;
constexpr int kBroadcastFlatMaxRanks = 8;

bool forced(const char* variable, Algorithm* out) {
  const char* value = std::getenv(variable);
  if (value == nullptr || std::strcmp(value, "auto") == 0 || value[0] == '\0') {
    return false;
  }
  *out = std::strcmp(value, "ring") == 0 ? Algorithm::kRing : Algorithm::kDirect;
  return true;
}

// All-gather and reduce-scatter move the same bytes the same way.
Algorithm select_ring_for_large(const char* variable, size_t total_bytes, int group_size) {
  Algorithm choice;
  if (forced(variable, &choice)) return choice;
  return total_bytes >= kRingThresholdBytes && group_size >= kRingMinRanks
             ? Algorithm::kRing
             : Algorithm::kDirect;
}

}  // namespace

const char* algorithm_name(Algorithm algorithm) {
  return algorithm == Algorithm::kRing ? "ring" : "direct";
}

Algorithm select_allgather(size_t total_bytes, int group_size) {
  return select_ring_for_large("FSDP_EXT_ALLGATHER_ALGO", total_bytes, group_size);
}

Algorithm select_reduce_scatter(size_t total_bytes, int group_size) {
  return select_ring_for_large("FSDP_EXT_REDUCE_SCATTER_ALGO", total_bytes, group_size);
}

Algorithm select_allreduce(size_t bytes, int group_size) {
  Algorithm choice;
  if (forced("FSDP_EXT_ALLREDUCE_ALGO", &choice)) return choice;
  // "direct": exchange whole buffers, reduce locally. "ring": reduce-scatter
  // then all-gather (each of which picks its own algorithm).
  return bytes <= kAllreduceDirectMaxBytes || group_size <= 1 ? Algorithm::kDirect
                                                              : Algorithm::kRing;
}

Algorithm select_broadcast(size_t /*bytes*/, int group_size) {
  Algorithm choice;
  if (forced("FSDP_EXT_BROADCAST_ALGO", &choice)) return choice;
  // On one host the receivers' CMA reads copy in parallel, so a flat fan-out
  // wins until the root's per-message overhead dominates.
  return group_size <= kBroadcastFlatMaxRanks ? Algorithm::kDirect : Algorithm::kRing;
}

}  // namespace fsdp_ext::comm
