#include "comm/collective_kind.h"

namespace fsdp_ext::comm {

const char* collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kUnnamed: return "an internal exchange";
    case CollectiveKind::kAllReduce: return "an all-reduce";
    case CollectiveKind::kAllReduceCoalesced: return "a coalesced all-reduce";
    case CollectiveKind::kAllGather: return "an all-gather";
    case CollectiveKind::kAllGatherCoalesced: return "a coalesced all-gather";
    case CollectiveKind::kReduceScatter: return "a reduce-scatter";
    case CollectiveKind::kReduceScatterCoalesced: return "a coalesced reduce-scatter";
    case CollectiveKind::kBroadcast: return "a broadcast";
    case CollectiveKind::kReduce: return "a reduce";
    case CollectiveKind::kGather: return "a gather";
    case CollectiveKind::kScatter: return "a scatter";
    case CollectiveKind::kAllToAll: return "an all-to-all";
    case CollectiveKind::kBarrier: return "a barrier";
    case CollectiveKind::kCoalescedBatch: return "a coalesced batch";
  }
  return "a collective of unknown kind";
}

}  // namespace fsdp_ext::comm
