#include "comm/algorithm_selection.h"

#include <cstdlib>

namespace fsdp_ext::comm {
namespace {

constexpr size_t kRingThresholdBytes = 1 << 20;
constexpr int kRingMinRanks = 4;
constexpr size_t kAllreduceDirectMaxBytes = 64 << 10;
constexpr int kBroadcastFlatMaxRanks = 8;
// Below this, one round of eager UCX messages beats the shared-memory
// protocol's two rounds; above it the copies dominate and reading peers'
// memory in place wins (measured with benchmarks/collectives.py).
constexpr size_t kSharedMemoryMinBytes = 32 << 10;

enum class Forced { kAuto, kDirect, kRing, kSharedMemory };

// Exact, case-sensitive names; anything else is not a forced algorithm.
bool parse_forced(std::string_view value, Forced& out) {
  if (value == "auto") return out = Forced::kAuto, true;
  if (value == "direct") return out = Forced::kDirect, true;
  if (value == "ring") return out = Forced::kRing, true;
  if (value == "shm") return out = Forced::kSharedMemory, true;
  return false;
}

Forced forced(const char* variable) {
  const char* value = std::getenv(variable);
  Forced choice = Forced::kAuto;
  // Unset, empty or (refused at group creation, so unreachable from the
  // backend) unknown: the automatic choice.
  if (value != nullptr) parse_forced(value, choice);
  return choice;
}

// The common shape: shared memory above a threshold when the group has it;
// otherwise `message_choice` (what UCX messages would use).
Algorithm choose(const char* variable, size_t bytes, bool shared_memory,
                 Algorithm message_choice) {
  switch (forced(variable)) {
    case Forced::kDirect:
      return Algorithm::kDirect;
    case Forced::kRing:
      return Algorithm::kRing;
    case Forced::kSharedMemory:
      return shared_memory ? Algorithm::kSharedMemory : message_choice;
    case Forced::kAuto:
      break;
  }
  if (shared_memory && bytes >= kSharedMemoryMinBytes) return Algorithm::kSharedMemory;
  return message_choice;
}

Algorithm ring_for_large(size_t bytes, int group_size) {
  return bytes >= kRingThresholdBytes && group_size >= kRingMinRanks ? Algorithm::kRing
                                                                      : Algorithm::kDirect;
}

}  // namespace

bool small_op_channel_allowed(const char* variable) { return forced(variable) == Forced::kAuto; }

bool is_forced_algorithm_name(std::string_view value) {
  Forced ignored;
  return parse_forced(value, ignored);
}

const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kRing:
      return "ring";
    case Algorithm::kSharedMemory:
      return "shm";
    default:
      return "direct";
  }
}

Algorithm select_allgather(size_t bytes, int group_size, bool shared_memory) {
  return choose("FSDP_EXT_ALLGATHER_ALGO", bytes, shared_memory,
                ring_for_large(bytes, group_size));
}

Algorithm select_reduce_scatter(size_t bytes, int group_size, bool shared_memory,
                                bool spans_hosts) {
  // Two ranks on two hosts: the ring's one message each way, reduced once it
  // is in, beats the direct algorithm's 1 MiB pieces reduced as they arrive.
  // Each piece is a rendezvous of its own, and over the one TCP connection
  // between the two ranks its handshake can wait behind the other
  // direction's data (16 MiB, 2x1: 6.2 against 7.5-7.8 ms unshaped; inside
  // an all-reduce at 1 Gbit/s 141-147 against 190-238 ms, gloo 141 ms; at
  // 10 Gbit/s the same within the noise).
  // Within one host the pieces' overlap wins (CMA, no such queue).
  const bool two_hosts_pair = group_size == 2 && spans_hosts && bytes >= kRingThresholdBytes;
  return choose("FSDP_EXT_REDUCE_SCATTER_ALGO", bytes, shared_memory,
                two_hosts_pair ? Algorithm::kRing : ring_for_large(bytes, group_size));
}

Algorithm select_allreduce(size_t bytes, int group_size, bool shared_memory) {
  // "direct": exchange whole buffers, reduce locally. "ring": reduce-scatter
  // then all-gather (each of which picks its own algorithm).
  const Algorithm messages = bytes <= kAllreduceDirectMaxBytes || group_size <= 1
                                 ? Algorithm::kDirect
                                 : Algorithm::kRing;
  return choose("FSDP_EXT_ALLREDUCE_ALGO", bytes, shared_memory, messages);
}

Algorithm select_broadcast(size_t bytes, int group_size, bool shared_memory) {
  // Over messages, on one host the receivers' CMA reads copy in parallel, so
  // a flat fan-out wins until the root's per-message overhead dominates.
  const Algorithm messages =
      group_size <= kBroadcastFlatMaxRanks ? Algorithm::kDirect : Algorithm::kRing;
  return choose("FSDP_EXT_BROADCAST_ALGO", bytes, shared_memory, messages);
}

}  // namespace fsdp_ext::comm
