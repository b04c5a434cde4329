// Collectives of a group that spans hosts, with the same number L >= 2 of
// ranks on each of H hosts: the ranks of one host work through their shared
// memory, and only what must cross hosts travels the network, between the
// ranks at the same position on each host (a "column").
//
//   all-gather     : column all-gather of each rank's input (1 piece out per
//                    rank instead of a ring's n - 1 hops), then one local
//                    all-gather per host of the H pieces now held.
//   reduce-scatter : local reduce-scatter (into H partial sums, one for each
//                    column peer), then a column reduce-scatter of them.
//   all-reduce     : local reduce-scatter into L blocks, column all-reduce of
//                    this rank's block, local all-gather of the blocks.
//   broadcast      : the root's column first, then each host from its rank at
//                    the root's position.
//
// Each phase is an OpContext::sub_group with sequence numbers of its own and
// runs the usual algorithm choice for its size (shared memory for the local
// phases when the group enabled it). Pre-scaling (PREMUL_SUM) applies in the
// first reduction, post-scaling (AVG) in the last, so each happens once.
// Reductions are sums of partial sums (host order after the local order):
// deterministic and identical on every rank, though not bit-identical to a
// flat ring's order.
#include "comm/algorithms/hierarchical.h"

#include "comm/algorithms/span_helpers.h"
#include "comm/progress_engine.h"

namespace fsdp_ext::comm {
namespace {

ReduceSpec first_phase(ReduceSpec spec) {
  spec.post_divisor = 1.0;
  return spec;
}

ReduceSpec last_phase(ReduceSpec spec) {
  spec.pre_scale = 1.0;
  return spec;
}

OpContext local_phase(OpContext& context, const HostTopology& topology) {
  return context.sub_group(topology.hosts[topology.host],
                           context.shared_memory_of_host());
}

OpContext column_phase(OpContext& context, const HostTopology& topology, int local) {
  return context.sub_group(topology.column(local), nullptr);
}

}  // namespace

bool hierarchical_allgather(OpContext& context, const std::vector<AllgatherMember>& bucket) {
  const HostTopology* topology = context.hierarchy();
  if (topology == nullptr) return false;
  // Every rank's piece the same size (FSDP's layout); uneven ones go flat.
  for (const AllgatherMember& member : bucket) {
    for (const MutableSpan& out : member.outputs) {
      if (out.bytes != member.input.bytes) return false;
    }
  }
  const auto& hosts = topology->hosts;
  const int me = topology->local;
  {
    OpContext column = column_phase(context, *topology, me);
    std::vector<AllgatherMember> phase;
    for (const AllgatherMember& member : bucket) {
      std::vector<MutableSpan> outs;
      for (const auto& host : hosts) outs.push_back(member.outputs[host[me]]);
      phase.push_back(AllgatherMember{member.input, std::move(outs)});
    }
    allgather(column, phase);
  }
  {
    OpContext local = local_phase(context, *topology);
    std::vector<AllgatherMember> phase;
    for (const AllgatherMember& member : bucket) {
      for (const auto& host : hosts) {
        const MutableSpan held = member.outputs[host[me]];
        std::vector<MutableSpan> outs;
        for (int rank : host) outs.push_back(member.outputs[rank]);
        phase.push_back(AllgatherMember{ConstSpan{held.data, held.bytes}, std::move(outs)});
      }
    }
    allgather(local, phase);
  }
  return true;
}

bool hierarchical_reduce_scatter(OpContext& context,
                                 const std::vector<ReduceScatterMember>& bucket) {
  const HostTopology* topology = context.hierarchy();
  if (topology == nullptr) return false;
  const auto& hosts = topology->hosts;
  const int me = topology->local;
  // partial[m][h]: the host's sum of what goes to hosts[h][me].
  std::vector<std::vector<MutableSpan>> partial(bucket.size());
  {
    OpContext local = local_phase(context, *topology);
    std::vector<ReduceScatterMember> phase;
    for (size_t m = 0; m < bucket.size(); ++m) {
      for (const auto& host : hosts) {
        const size_t bytes = bucket[m].inputs[host[me]].bytes;
        partial[m].push_back(MutableSpan{context.scratch(bytes), bytes});
        std::vector<ConstSpan> inputs;
        for (int rank : host) inputs.push_back(bucket[m].inputs[rank]);
        phase.push_back(ReduceScatterMember{std::move(inputs), partial[m].back(),
                                            first_phase(bucket[m].spec)});
      }
    }
    reduce_scatter(local, phase);
  }
  {
    OpContext column = column_phase(context, *topology, me);
    std::vector<ReduceScatterMember> phase;
    for (size_t m = 0; m < bucket.size(); ++m) {
      std::vector<ConstSpan> inputs;
      for (const MutableSpan& sum : partial[m]) inputs.push_back(ConstSpan{sum.data, sum.bytes});
      phase.push_back(
          ReduceScatterMember{std::move(inputs), bucket[m].output, last_phase(bucket[m].spec)});
    }
    reduce_scatter(column, phase);
  }
  return true;
}

bool hierarchical_allreduce(OpContext& context, const std::vector<AllreduceMember>& bucket) {
  const HostTopology* topology = context.hierarchy();
  if (topology == nullptr) return false;
  const int per_host = static_cast<int>(topology->hosts[0].size());
  const int me = topology->local;
  std::vector<std::vector<MutableSpan>> blocks;
  for (const AllreduceMember& member : bucket) {
    blocks.push_back(detail::split_blocks(member.data, element_size(member.spec.type), per_host));
  }
  {
    OpContext local = local_phase(context, *topology);
    std::vector<ReduceScatterMember> phase;
    for (size_t m = 0; m < bucket.size(); ++m) {
      std::vector<ConstSpan> inputs;
      for (const MutableSpan& block : blocks[m]) inputs.push_back(ConstSpan{block.data, block.bytes});
      phase.push_back(
          ReduceScatterMember{std::move(inputs), blocks[m][me], first_phase(bucket[m].spec)});
    }
    reduce_scatter(local, phase);
  }
  {
    OpContext column = column_phase(context, *topology, me);
    std::vector<AllreduceMember> phase;
    for (size_t m = 0; m < bucket.size(); ++m) {
      phase.push_back(AllreduceMember{blocks[m][me], last_phase(bucket[m].spec)});
    }
    allreduce(column, phase);
  }
  {
    OpContext local = local_phase(context, *topology);
    std::vector<AllgatherMember> phase;
    for (size_t m = 0; m < bucket.size(); ++m) {
      phase.push_back(
          AllgatherMember{ConstSpan{blocks[m][me].data, blocks[m][me].bytes}, blocks[m]});
    }
    allgather(local, phase);
  }
  return true;
}

bool hierarchical_broadcast(OpContext& context, MutableSpan data, int root) {
  const HostTopology* topology = context.hierarchy();
  if (topology == nullptr) return false;
  int root_host = 0, root_local = 0;
  for (size_t h = 0; h < topology->hosts.size(); ++h) {
    for (size_t l = 0; l < topology->hosts[h].size(); ++l) {
      if (topology->hosts[h][l] == root) {
        root_host = static_cast<int>(h);
        root_local = static_cast<int>(l);
      }
    }
  }
  // Every rank reserves both phases' sequence numbers, taking part or not.
  OpContext column = column_phase(context, *topology, root_local);
  if (topology->local == root_local) broadcast(column, data, root_host);
  OpContext local = local_phase(context, *topology);
  broadcast(local, data, root_local);
  return true;
}

}  // namespace fsdp_ext::comm
