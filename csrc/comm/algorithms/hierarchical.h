// Host-aware versions of the bandwidth-heavy collectives, for groups that
// span hosts (see hierarchical.cpp). Each returns false, doing nothing, when
// the group is not laid out for it (one host, one rank per host, inside a
// phase, uneven all-gather pieces; hosts with different numbers of ranks,
// except for broadcast); the caller then runs its flat algorithm.
#pragma once

#include "comm/algorithms/algorithms.h"

namespace fsdp_ext::comm {

bool hierarchical_allgather(OpContext& context, const std::vector<AllgatherMember>& bucket);
bool hierarchical_reduce_scatter(OpContext& context,
                                 const std::vector<ReduceScatterMember>& bucket);
bool hierarchical_allreduce(OpContext& context, const std::vector<AllreduceMember>& bucket);
bool hierarchical_broadcast(OpContext& context, MutableSpan data, int root);

}  // namespace fsdp_ext::comm
