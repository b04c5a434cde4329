// What the hardware allows, measured the way a shared-memory collective
// uses it, so the benchmark can report each op as a fraction of a limit that
// some cross-process collective could actually reach (a hot-cache
// single-core memcpy cannot be approached by ranks reading each other's
// memory).
//
// Both measurements use threads of this process: their buffers share the
// caches and memory exactly as ranks' mapped segments do, without the
// processes. Torch-free; the benchmark calls them through torch_fsdp_ext._C.
#pragma once

#include <cstddef>

namespace fsdp_ext::comm {

// `ranks` threads, each copying `bytes` out of the next thread's freshly
// written buffer into its own, all at once (what every rank of an all-gather
// does). Returns the shortest round of `rounds` (a round: from the first
// copy's start to the last one's end, so with more ranks than cores the
// copies take turns as ranks would). Buffers are touched by their owners
// first and one warm-up round runs, so sizes that fit the caches measure
// cache-to-cache transfers and larger ones memory bandwidth.
double concurrent_peer_copy_seconds(int ranks, size_t bytes, int rounds);

// Two threads passing a flag back and forth through one cache line: the
// round trip (ns; the best of five batches' medians), i.e. twice the cost of
// telling another core that data is ready.
double handoff_round_trip_ns(int round_trips);

}  // namespace fsdp_ext::comm
