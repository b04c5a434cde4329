// Which algorithm each collective uses. Small messages are latency bound: the
// "direct" algorithms exchange everything in one round. Large messages with
// many ranks are bandwidth bound: the ring moves each byte once per hop with
// bounded scratch. FSDP_EXT_ALLGATHER_ALGO, FSDP_EXT_REDUCE_SCATTER_ALGO,
// FSDP_EXT_ALLREDUCE_ALGO and FSDP_EXT_BROADCAST_ALGO ("direct", "ring" or
// "auto") force one, so tests can
// exercise each and benchmarks can compare them. This file is the one place
// the choice is made; the benchmark asks it through torch_fsdp_ext._C.
#pragma once

#include <cstddef>

namespace fsdp_ext::comm {

// kDirect: one round (all pairs at once; broadcast: root sends to everyone).
// kRing: ring (all-reduce: reduce-scatter then all-gather; broadcast:
// binomial tree).
enum class Algorithm { kDirect, kRing };

const char* algorithm_name(Algorithm algorithm);

Algorithm select_allgather(size_t total_bytes, int group_size);
Algorithm select_reduce_scatter(size_t total_bytes, int group_size);
Algorithm select_allreduce(size_t bytes, int group_size);
Algorithm select_broadcast(size_t bytes, int group_size);

}  // namespace fsdp_ext::comm
