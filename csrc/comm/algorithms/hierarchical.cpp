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
// Hosts with different numbers of ranks go flat, except broadcast, which
// goes through one leader per host (broadcast_through_leaders).
//
// Each phase is an OpContext::sub_group with sequence numbers of its own and
// runs the usual algorithm choice for its size (shared memory for the local
// phases when the group enabled it).
//
// Large buckets are pipelined (Note [pipelined hierarchical phases]). Pre-scaling (PREMUL_SUM) applies in the
// first reduction, post-scaling (AVG) in the last, so each happens once.
// Reductions are sums of partial sums (host order after the local order):
// deterministic and identical on every rank, though not bit-identical to a
// flat ring's order.
#include "comm/algorithms/hierarchical.h"

#include <exception>

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

// Note [pipelined hierarchical phases]
// Run one phase after the other and the link idles while a host works in
// shared memory, and the host idles while the link carries the bucket. So a
// bucket with more than two pieces' worth of bytes per block
// (detail::kPipelinePieceBytes) is cut into pieces, and the phases of
// consecutive pieces overlap:
//
//   all-gather     : every piece's column messages are posted at once; each
//                    piece's local all-gather runs as soon as its column
//                    pieces are in, while the later ones are on the wire.
//   reduce-scatter : piece k's local reduce-scatter, then its partial sums go
//                    out to the column peers at once; piece k-1's arrivals
//                    are added into the output while piece k+1 is reduced
//                    locally.
//   all-reduce     : (two hosts) piece k's local reduce-scatter into this
//                    rank's block, which goes to the column peer at once;
//                    piece k-1's block gets the peer's partial added (two
//                    operands: every reduction commutes exactly, so both
//                    column members get the same bits) and is all-gathered
//                    within the host while piece k+1 is reduced.
//   broadcast      : the root's column member sends every piece at once; each
//                    column member broadcasts a piece within its host as soon
//                    as it is in (the root's host at once). Up to 8 hosts a
//                    bucket too small to cut still takes this path, as one
//                    piece, for that overlap on the root's host.
//
// Ordering: each piece's local phase is a sub_group of its own (its own
// sequence numbers, reserved alike on every rank because every rank cuts the
// same pieces); the column messages of the whole op share one column
// sub_group, told apart by the piece's index as the step. A piece's sums are
// taken across hosts in the order the unpipelined path's direct column
// phase takes them (own partial, then the other hosts in host order). Within
// a host, a piece's local phase picks its algorithm by the piece's size, so a
// small last piece may sum in another order than the whole bucket would:
// every rank still gets the same bits, but not necessarily the unpipelined
// path's.
// Buffers: every piece's partial sums and arrivals have scratch of their
// own, alive until the op ends, so nothing is overwritten while a send of
// it may still be in flight.

// The column messages a pipelined op posts ahead of its local phases. If a
// local phase throws (a lost peer, abort, timeout), nobody waits on these
// any more: they are abandoned to the engine, not left posted into the
// caller's tensors, which the caller may free once the op has failed.
class PostedAhead {
 public:
  explicit PostedAhead(OpContext& column) : column_(column) {}
  PostedAhead(const PostedAhead&) = delete;
  PostedAhead& operator=(const PostedAhead&) = delete;
  ~PostedAhead() {
    if (std::uncaught_exceptions() <= exceptions_) return;
    try {
      column_.abandon(requests);
    } catch (...) {
      // Already failing: the first error is the one reported.
    }
  }
  std::vector<Request> requests;

 private:
  OpContext& column_;
  const int exceptions_ = std::uncaught_exceptions();
};

struct PieceOfMember {
  size_t member;
  detail::Piece piece;
};

// The pieces of every member, in order; empty when the bucket is too small
// to gain from pipelining or has more pieces than the column's steps.
template <typename Member, typename Bytes>
std::vector<PieceOfMember> pipeline_pieces(const std::vector<Member>& bucket, Bytes block_bytes,
                                           size_t element_of_all) {
  std::vector<PieceOfMember> pieces;
  size_t total = 0;
  for (size_t m = 0; m < bucket.size(); ++m) {
    const size_t bytes = block_bytes(bucket[m]);
    total += bytes;
    for (const detail::Piece& piece : detail::pieces_of(bytes, element_of_all)) {
      pieces.push_back(PieceOfMember{m, piece});
    }
  }
  if (total <= 2 * detail::kPipelinePieceBytes || pieces.size() >= tag::kMaxSteps) return {};
  // Each piece costs a local collective and a column message of its own: a
  // bucket of many small members (a coalesced FSDP bucket) would run one per
  // member. Only pipeline buckets whose pieces are mostly full.
  if (pieces.size() > 2 * (total / detail::kPipelinePieceBytes) + 2) return {};
  return pieces;
}

// Pieces must be whole elements of every member; 16 bytes is a multiple of
// every supported element size, and kPipelinePieceBytes is a multiple of 16.
constexpr size_t kPieceAlignment = 16;

bool pipelined_allgather(OpContext& context, const HostTopology& topology,
                         const std::vector<AllgatherMember>& bucket) {
  const std::vector<PieceOfMember> pieces = pipeline_pieces(
      bucket, [](const AllgatherMember& m) { return m.input.bytes; }, kPieceAlignment);
  if (pieces.empty()) return false;
  const auto& hosts = topology.hosts;
  const int me = topology.local;
  const int mine = topology.host;
  const int column_size = static_cast<int>(hosts.size());
  OpContext column = column_phase(context, topology, me);
  PostedAhead posted(column);
  std::vector<Request>& requests = posted.requests;
  std::vector<std::vector<size_t>> arrivals(pieces.size());
  for (uint32_t u = 0; u < pieces.size(); ++u) {
    const AllgatherMember& member = bucket[pieces[u].member];
    const detail::Piece& piece = pieces[u].piece;
    for (int h = 0; h < column_size; ++h) {
      if (h == mine) continue;
      arrivals[u].push_back(requests.size());
      requests.push_back(column.recv(h, u, detail::sub(member.outputs[hosts[h][me]], piece).data,
                                     piece.bytes));
    }
    for (int k = 1; k < column_size; ++k) {
      const int to = detail::wrap(mine + k, column_size);
      requests.push_back(column.send(to, u, detail::sub(member.input, piece).data, piece.bytes));
    }
  }
  for (uint32_t u = 0; u < pieces.size(); ++u) {
    const AllgatherMember& member = bucket[pieces[u].member];
    const detail::Piece& piece = pieces[u].piece;
    detail::copy_if_distinct(detail::sub(member.outputs[hosts[mine][me]], piece).data,
                             detail::sub(member.input, piece).data, piece.bytes);
    for (size_t index : arrivals[u]) column.wait_one(requests, index);
    OpContext local = local_phase(context, topology);
    std::vector<AllgatherMember> phase;
    for (const auto& host : hosts) {
      const MutableSpan held = detail::sub(member.outputs[host[me]], piece);
      std::vector<MutableSpan> outs;
      for (int rank : host) outs.push_back(detail::sub(member.outputs[rank], piece));
      phase.push_back(AllgatherMember{ConstSpan{held.data, held.bytes}, std::move(outs)});
    }
    allgather(local, phase);
  }
  column.wait_all(requests);
  return true;
}

bool pipelined_reduce_scatter(OpContext& context, const HostTopology& topology,
                              const std::vector<ReduceScatterMember>& bucket) {
  for (const ReduceScatterMember& member : bucket) {
    for (const ConstSpan& input : member.inputs) {
      if (input.bytes != member.output.bytes) return false;
    }
  }
  const std::vector<PieceOfMember> pieces = pipeline_pieces(
      bucket, [](const ReduceScatterMember& m) { return m.output.bytes; }, kPieceAlignment);
  if (pieces.empty()) return false;
  const auto& hosts = topology.hosts;
  const int me = topology.local;
  const int mine = topology.host;
  OpContext column = column_phase(context, topology, me);
  PostedAhead posted(column);
  std::vector<Request>& requests = posted.requests;
  std::vector<std::vector<size_t>> arrivals(pieces.size());
  std::vector<std::vector<const void*>> arrived(pieces.size());
  std::vector<const void*> own_partial(pieces.size());
  auto add_arrivals = [&](size_t u) {
    const ReduceScatterMember& member = bucket[pieces[u].member];
    for (size_t index : arrivals[u]) column.wait_one(requests, index);
    detail::reduce_sources(detail::sub(member.output, pieces[u].piece), own_partial[u],
                           arrived[u], last_phase(member.spec));
  };
  for (uint32_t u = 0; u < pieces.size(); ++u) {
    const ReduceScatterMember& member = bucket[pieces[u].member];
    const detail::Piece& piece = pieces[u].piece;
    std::vector<MutableSpan> partial;
    {
      OpContext local = local_phase(context, topology);
      std::vector<ReduceScatterMember> phase;
      for (const auto& host : hosts) {
        partial.push_back(MutableSpan{context.scratch(piece.bytes), piece.bytes});
        std::vector<ConstSpan> inputs;
        for (int rank : host) inputs.push_back(detail::sub(member.inputs[rank], piece));
        phase.push_back(
            ReduceScatterMember{std::move(inputs), partial.back(), first_phase(member.spec)});
      }
      reduce_scatter(local, phase);
    }
    own_partial[u] = partial[mine].data;
    for (int h = 0; h < static_cast<int>(hosts.size()); ++h) {
      if (h == mine) continue;
      void* staging = context.scratch(piece.bytes);
      arrivals[u].push_back(requests.size());
      arrived[u].push_back(staging);
      requests.push_back(column.recv(h, u, staging, piece.bytes));
    }
    for (int h = 0; h < static_cast<int>(hosts.size()); ++h) {
      if (h != mine) requests.push_back(column.send(h, u, partial[h].data, piece.bytes));
    }
    if (u > 0) add_arrivals(u - 1);
  }
  add_arrivals(pieces.size() - 1);
  column.wait_all(requests);
  return true;
}

bool pipelined_allreduce(OpContext& context, const HostTopology& topology,
                         const std::vector<AllreduceMember>& bucket) {
  // With more hosts, exchanging whole blocks would cost more link than the
  // column ring; those run unpipelined.
  if (topology.hosts.size() != 2) return false;
  const std::vector<PieceOfMember> pieces = pipeline_pieces(
      bucket, [](const AllreduceMember& m) { return m.data.bytes; }, kPieceAlignment);
  if (pieces.empty()) return false;
  const int per_host = static_cast<int>(topology.hosts[0].size());
  const int me = topology.local;
  const int other = 1 - topology.host;
  OpContext column = column_phase(context, topology, me);
  PostedAhead posted(column);
  std::vector<Request>& requests = posted.requests;
  std::vector<std::vector<MutableSpan>> blocks(pieces.size());
  std::vector<const void*> arrived(pieces.size());
  std::vector<size_t> exchange(pieces.size());  // the piece's receive; its send follows
  // Adds the peer's partial into this rank's block of piece u (once the
  // block's own send is done: it is overwritten), then shares the block
  // within the host.
  auto finish = [&](size_t u) {
    const AllreduceMember& member = bucket[pieces[u].member];
    column.wait_one(requests, exchange[u]);
    column.wait_one(requests, exchange[u] + 1);
    const MutableSpan block = blocks[u][me];
    detail::reduce_sources(block, block.data, {arrived[u]}, last_phase(member.spec));
    OpContext local = local_phase(context, topology);
    allgather(local, std::vector<AllgatherMember>{
                         AllgatherMember{ConstSpan{block.data, block.bytes}, blocks[u]}});
  };
  for (uint32_t u = 0; u < pieces.size(); ++u) {
    const AllreduceMember& member = bucket[pieces[u].member];
    blocks[u] = detail::split_blocks(detail::sub(member.data, pieces[u].piece),
                                     element_size(member.spec.type), per_host);
    {
      OpContext local = local_phase(context, topology);
      std::vector<ConstSpan> inputs;
      for (const MutableSpan& block : blocks[u]) inputs.push_back(ConstSpan{block.data, block.bytes});
      reduce_scatter(local, std::vector<ReduceScatterMember>{ReduceScatterMember{
                                std::move(inputs), blocks[u][me], first_phase(member.spec)}});
    }
    const MutableSpan block = blocks[u][me];
    void* staging = context.scratch(block.bytes);
    arrived[u] = staging;
    exchange[u] = requests.size();
    requests.push_back(column.recv(other, u, staging, block.bytes));
    requests.push_back(column.send(other, u, block.data, block.bytes));
    if (u > 0) finish(u - 1);
  }
  finish(pieces.size() - 1);
  column.wait_all(requests);
  return true;
}

// Hosts up to which the root's column member sends to every other host
// itself (as the flat broadcast does up to this many ranks); beyond, the
// unpipelined path's column broadcast picks a tree.
constexpr size_t kColumnFanOutMaxHosts = 8;

// Also the unpipelined broadcast of up to kColumnFanOutMaxHosts hosts, as one
// piece: the root's host then broadcasts within itself while the bucket
// crosses to the others, instead of after (2x2, 256 KiB: the column send and
// the root host's local phase no longer add up).
bool pipelined_broadcast(OpContext& context, const HostTopology& topology, MutableSpan data,
                         int root_host, int root_local) {
  std::vector<PieceOfMember> pieces = pipeline_pieces(
      std::vector<MutableSpan>{data}, [](const MutableSpan& d) { return d.bytes; }, 1);
  if (pieces.empty() && topology.hosts.size() <= kColumnFanOutMaxHosts) {
    pieces.push_back(PieceOfMember{0, detail::Piece{0, data.bytes}});
  }
  if (pieces.empty()) return false;
  // Every rank reserves the column's sequence numbers, taking part or not.
  OpContext column = column_phase(context, topology, root_local);
  const bool in_column = topology.local == root_local;
  const bool sender = in_column && topology.host == root_host;
  PostedAhead posted(column);
  std::vector<Request>& requests = posted.requests;
  for (uint32_t u = 0; in_column && u < pieces.size(); ++u) {
    MutableSpan piece = detail::sub(data, pieces[u].piece);
    if (!sender) {
      requests.push_back(column.recv(root_host, u, piece.data, piece.bytes));
      continue;
    }
    for (int h = 0; h < static_cast<int>(topology.hosts.size()); ++h) {
      if (h != root_host) requests.push_back(column.send(h, u, piece.data, piece.bytes));
    }
  }
  for (uint32_t u = 0; u < pieces.size(); ++u) {
    if (in_column && !sender) column.wait_one(requests, u);
    OpContext local = local_phase(context, topology);
    broadcast(local, detail::sub(data, pieces[u].piece), root_local);
  }
  column.wait_all(requests);
  return true;
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
  if (pipelined_allgather(context, *topology, bucket)) return true;
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
  if (pipelined_reduce_scatter(context, *topology, bucket)) return true;
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
  if (pipelined_allreduce(context, *topology, bucket)) return true;
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

// Hosts with different numbers of ranks (3 + 1) have no columns: the root
// sends the buffer once to a leader on every other host (its rank at the
// root's position, or its first), which broadcasts it within its host. A
// flat broadcast would send a copy across the link for every rank of the
// other hosts. The init agreement gives such groups no shared memory, so the
// host's phase runs over UCX's own shared-memory transports.
bool broadcast_through_leaders(OpContext& context, const HostTopology& topology,
                               MutableSpan data, int root) {
  const auto [root_host, root_local] = topology.position_of(root);
  if (root_host < 0) return false;
  bool gains = false;  // some host besides the root's has several ranks
  std::vector<int> leaders;      // one per host, host order
  std::vector<int> leader_local; // its position on its host
  for (size_t h = 0; h < topology.hosts.size(); ++h) {
    const int size = static_cast<int>(topology.hosts[h].size());
    const int local = root_local < size ? root_local : 0;
    if (static_cast<int>(h) != root_host && size > 1) gains = true;
    leaders.push_back(topology.hosts[h][local]);
    leader_local.push_back(local);
  }
  if (!gains) return false;
  // Every rank reserves both phases' sequence numbers, taking part or not.
  OpContext column = context.sub_group(leaders, nullptr);
  if (topology.local == leader_local[topology.host]) broadcast(column, data, root_host);
  OpContext local = context.sub_group(topology.hosts[topology.host], nullptr);
  broadcast(local, data, leader_local[topology.host]);
  return true;
}

bool hierarchical_broadcast(OpContext& context, MutableSpan data, int root) {
  const HostTopology* topology = context.hierarchy();
  if (topology == nullptr) {
    const HostTopology* unequal = context.host_layout();
    return unequal != nullptr && broadcast_through_leaders(context, *unequal, data, root);
  }
  const auto [root_host, root_local] = topology->position_of(root);
  if (pipelined_broadcast(context, *topology, data, root_host, root_local)) return true;
  // Every rank reserves both phases' sequence numbers, taking part or not.
  OpContext column = column_phase(context, *topology, root_local);
  if (topology->local == root_local) broadcast(column, data, root_host);
  OpContext local = local_phase(context, *topology);
  broadcast(local, data, root_local);
  return true;
}

}  // namespace fsdp_ext::comm
