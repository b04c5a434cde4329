// Which collective an op is, as far as its messages are concerned. Every
// collective message carries its op's kind in its tag (comm/tag_scheme.h),
// so ranks that called different collectives at the same point never take
// each other's bytes for their own: over UCX messages an all-reduce and a
// broadcast of the same size would otherwise exchange data silently. A rank
// waiting for a peer looks for that peer's message of another kind and
// reports the mismatch (Note [ranks that run different collectives],
// progress_engine.cpp).
#pragma once

#include <cstdint>

namespace fsdp_ext::comm {

// Four bits in the tag: at most 16 kinds. Forms of one collective that move
// the same bytes (a list or a flat tensor) share a kind; forms that move
// different bytes (the coalesced ones, a batch) do not.
enum class CollectiveKind : uint8_t {
  kUnnamed = 0,  // the group's own set-up exchanges, tests
  kAllReduce,
  kAllReduceCoalesced,
  kAllGather,
  kAllGatherCoalesced,
  kReduceScatter,
  kReduceScatterCoalesced,
  kBroadcast,
  kReduce,
  kGather,
  kScatter,
  kAllToAll,
  kBarrier,
  kCoalescedBatch,  // a coalescing manager's batch, whatever it holds
};

constexpr int kCollectiveKindCount = 14;

// For error messages: "all-reduce", "a coalesced batch", ...
const char* collective_kind_name(CollectiveKind kind);

}  // namespace fsdp_ext::comm
