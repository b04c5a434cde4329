// Which algorithm each collective uses. This file is the one place the choice
// is made; the benchmark asks it through torch_fsdp_ext._C.
//
//   direct       : one round of UCX messages (all pairs at once; broadcast:
//                  root sends to everyone). Small messages are latency bound.
//   ring         : UCX ring (all-reduce: reduce-scatter then all-gather;
//                  broadcast: binomial tree), for many ranks and large
//                  messages when memory cannot be shared.
//   shared_memory: ranks on one host read each other's memory directly (see
//                  shared_source_exchange.h); UCX carries only tiny headers.
//                  Chosen above a size threshold whenever the group enabled
//                  shared memory at init.
//
// FSDP_EXT_ALLGATHER_ALGO, FSDP_EXT_REDUCE_SCATTER_ALGO,
// FSDP_EXT_ALLREDUCE_ALGO and FSDP_EXT_BROADCAST_ALGO ("direct", "ring",
// "shm" or "auto") force one, so tests can exercise each and benchmarks can
// compare them; "shm" falls back to the automatic choice where the group has
// no shared memory. Every rank must see the same setting.
#pragma once

#include <cstddef>
#include <string_view>

namespace fsdp_ext::comm {

enum class Algorithm { kDirect, kRing, kSharedMemory };

// The FSDP_EXT_*_ALGO variables and the values they accept. The backend
// rejects any other value at group creation (read_environment); here an
// unset or empty variable means "auto".
constexpr const char* kForcedAlgorithmVariables[] = {
    "FSDP_EXT_ALLGATHER_ALGO", "FSDP_EXT_REDUCE_SCATTER_ALGO", "FSDP_EXT_ALLREDUCE_ALGO",
    "FSDP_EXT_BROADCAST_ALGO"};
constexpr const char* kForcedAlgorithmValues = "auto, direct, ring or shm";
bool is_forced_algorithm_name(std::string_view value);

const char* algorithm_name(Algorithm algorithm);

// Whether a small collective may complete through the small-op channel
// (algorithms/small_ops.h) instead of the algorithm chosen here: only when
// `variable` (the op's FSDP_EXT_*_ALGO) forces nothing, so a forced
// algorithm runs at every size.
bool small_op_channel_allowed(const char* variable);

// `bytes`: the whole bucket (all-gather outputs / reduce-scatter inputs /
// all-reduce buffers). `shared_memory`: the group has it enabled.
// `spans_hosts`: the group's ranks are on more than one host.
Algorithm select_allgather(size_t bytes, int group_size, bool shared_memory);
Algorithm select_reduce_scatter(size_t bytes, int group_size, bool shared_memory,
                                bool spans_hosts = false);
Algorithm select_allreduce(size_t bytes, int group_size, bool shared_memory);
Algorithm select_broadcast(size_t bytes, int group_size, bool shared_memory);

}  // namespace fsdp_ext::comm
