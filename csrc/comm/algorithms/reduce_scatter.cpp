// Reduce-scatter over a bucket, with per-rank sizes.
//   direct: every rank sends block p of every member to rank p at once; the
//           owner reduces the blocks as they arrive, in rank order.
//   ring  : n-1 steps passing partial sums to the next rank, which adds its
//           own contribution; two staging buffers per member.
//   shm   : the owner of each block reads every peer's contribution straight
//           out of the peer's memory (shared, or with process_vm_readv a chunk
//           at a time when large and ordinary) and reduces it in one
//           cache-blocked pass.
// Each block is computed by its owner only, always in the same order, so an
// all-reduce built from reduce-scatter + all-gather gives bitwise-identical
// results everywhere.
#include <algorithm>
#include <array>

#include "comm/algorithm_selection.h"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/hierarchical.h"
#include "comm/algorithms/shared_source_exchange.h"
#include "comm/algorithms/span_helpers.h"

namespace fsdp_ext::comm {
namespace {

// PREMUL_SUM: contributions are scaled copies (the caller's input is left as is).
std::vector<ReduceScatterMember> apply_pre_scale(OpContext& context,
                                                 const std::vector<ReduceScatterMember>& bucket) {
  std::vector<ReduceScatterMember> scaled = bucket;
  for (ReduceScatterMember& member : scaled) {
    if (member.spec.pre_scale == 1.0) continue;
    for (ConstSpan& input : member.inputs) {
      input.data = detail::pre_scaled(context, input.data, input.bytes, member.spec);
    }
  }
  return scaled;
}

void copy_own_blocks(OpContext& context, const std::vector<ReduceScatterMember>& bucket) {
  for (const ReduceScatterMember& member : bucket) {
    detail::copy_if_distinct(member.output.data, member.inputs[context.rank()].data,
                             member.output.bytes);
  }
}

// Members whose blocks are large and all the same size, cut into pieces
// (kPipelinePieceBytes) that travel as messages of their own: the direct
// algorithm reduces each piece as it arrives, overlapping the rest of the
// transfer. Summation order per element is unchanged (own, then rank order).
std::vector<ReduceScatterMember> in_pieces(const std::vector<ReduceScatterMember>& bucket) {
  std::vector<ReduceScatterMember> out;
  for (const ReduceScatterMember& member : bucket) {
    bool even = member.output.bytes > 2 * detail::kPipelinePieceBytes;
    for (const ConstSpan& input : member.inputs) even = even && input.bytes == member.output.bytes;
    if (!even) {
      out.push_back(member);
      continue;
    }
    for (const detail::Piece& piece :
         detail::pieces_of(member.output.bytes, element_size(member.spec.type))) {
      ReduceScatterMember part{{}, detail::sub(member.output, piece), member.spec};
      for (const ConstSpan& input : member.inputs) part.inputs.push_back(detail::sub(input, piece));
      out.push_back(std::move(part));
    }
  }
  return out;
}

void reduce_scatter_direct(OpContext& context, const std::vector<ReduceScatterMember>& bucket) {
  const int n = context.size();
  const int r = context.rank();
  std::vector<Request> requests;
  std::vector<std::pair<size_t, void*>> arrivals;  // (member, staging), in request order
  // Receives first (members, then peers in rank order) so the reduction can
  // consume them in that order; then the sends.
  for (uint32_t m = 0; m < bucket.size(); ++m) {
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      void* staging = context.scratch(bucket[m].output.bytes);
      arrivals.emplace_back(m, staging);
      requests.push_back(context.recv(p, m, staging, bucket[m].output.bytes));
    }
  }
  for (uint32_t m = 0; m < bucket.size(); ++m) {
    for (int k = 1; k < n; ++k) {
      const int to = detail::wrap(r + k, n);
      requests.push_back(
          context.send(to, m, bucket[m].inputs[to].data, bucket[m].inputs[to].bytes));
    }
  }
  // Reduce each block as soon as it is in, overlapping the later arrivals.
  // A member's first arrival is added to the rank's own contribution in the
  // same pass that writes the output (no separate copy of the own block).
  std::vector<bool> started(bucket.size(), false);
  for (size_t i = 0; i < arrivals.size(); ++i) {
    context.wait_one(requests, i);
    const ReduceScatterMember& member = bucket[arrivals[i].first];
    if (!started[arrivals[i].first]) {
      started[arrivals[i].first] = true;
      ReduceSpec no_divide = member.spec;
      no_divide.post_divisor = 1.0;  // reduce_scatter() divides once, at the end
      detail::reduce_sources(member.output, member.inputs[r].data, {arrivals[i].second},
                             no_divide);
      continue;
    }
    reduce_into(member.output.data, arrivals[i].second,
                member.output.bytes / element_size(member.spec.type), member.spec.type,
                member.spec.kind);
  }
  context.wait_all(requests);
}

void reduce_scatter_ring(OpContext& context, const std::vector<ReduceScatterMember>& bucket) {
  const int n = context.size();
  const int r = context.rank();
  const int next = detail::ring_next(r, n);
  const int prev = detail::ring_prev(r, n);
  const uint32_t members = static_cast<uint32_t>(bucket.size());
  std::vector<std::array<void*, 2>> buffers(members);
  for (uint32_t m = 0; m < members; ++m) {
    size_t largest = 0;
    for (const ConstSpan& span : bucket[m].inputs) largest = std::max(largest, span.bytes);
    buffers[m] = {context.scratch(largest), context.scratch(largest)};
  }
  std::vector<Request> requests;
  for (int step = 0; step < n - 1; ++step) {
    const int send_block = detail::wrap(r - step - 1, n);
    const int recv_block = detail::wrap(r - step - 2, n);
    requests.clear();
    for (uint32_t m = 0; m < members; ++m) {
      const uint32_t tag_step = static_cast<uint32_t>(step) * members + m;
      const ReduceScatterMember& member = bucket[m];
      const void* outgoing =
          step == 0 ? member.inputs[send_block].data : buffers[m][(step + 1) % 2];
      requests.push_back(context.recv(prev, tag_step, buffers[m][step % 2],
                                      member.inputs[recv_block].bytes));
      requests.push_back(
          context.send(next, tag_step, outgoing, member.inputs[send_block].bytes));
    }
    context.wait_all(requests);
    for (uint32_t m = 0; m < members; ++m) {
      const ReduceScatterMember& member = bucket[m];
      void* incoming = buffers[m][step % 2];
      const size_t count = member.inputs[recv_block].bytes / element_size(member.spec.type);
      if (step < n - 2) {
        reduce_into(incoming, member.inputs[recv_block].data, count, member.spec.type,
                    member.spec.kind);
      } else {
        // This rank's block: its own contribution then the partial sum that
        // came in, in one blocked pass (the output may alias the input), with
        // AVG's divide made while each block is in cache. A copy into the
        // output followed by a second pass over it made a 16 MiB reduce-
        // scatter of two ranks on two hosts 3-9 % slower (6.36-6.43 against
        // 5.81-6.25 ms, interleaved runs).
        detail::reduce_sources(member.output, member.inputs[r].data, {incoming}, member.spec);
      }
    }
  }
}

void reduce_scatter_shared(OpContext& context, SharedMemoryDomain& domain,
                           const std::vector<ReduceScatterMember>& bucket) {
  const int n = context.size();
  const int r = context.rank();
  // Large blocks of ordinary memory are offered as process memory rather
  // than staged by their owner (one copy fewer: the reader copies a chunk at
  // a time into cache and reduces it there).
  SharedSourceExchange exchange(context, domain, 0, /*staging_slot=*/0, kProcessReadMinBytes,
                                SharedExchangeKind::kReduceScatter);
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    std::vector<ConstSpan> pieces;
    std::vector<size_t> sizes;
    for (const ReduceScatterMember& member : bucket) {
      pieces.push_back(member.inputs[p]);
      sizes.push_back(member.output.bytes);
    }
    exchange.offer(p, std::move(pieces));
    exchange.expect(p, std::move(sizes));
  }
  // Every size agrees where the ranks reduce different dtypes of one size
  // or with different ops: the reductions are checked too.
  std::vector<ReduceSpec> reductions;
  for (const ReduceScatterMember& member : bucket) reductions.push_back(member.spec);
  exchange.set_reductions(std::move(reductions));
  exchange.exchange();
  // Own contribution first (so an output that aliases it is read before it
  // is written), then the peers' in rank order.
  for (size_t m = 0; m < bucket.size(); ++m) {
    exchange.reduce_pieces(m, bucket[m].output, bucket[m].inputs[r].data, bucket[m].spec);
  }
  exchange.finish();
}

}  // namespace

void reduce_scatter(OpContext& context, const std::vector<ReduceScatterMember>& bucket) {
  if (hierarchical_reduce_scatter(context, bucket)) return;

  const std::vector<ReduceScatterMember> contributions = apply_pre_scale(context, bucket);
  const int n = context.size();
  bool divided = false;  // AVG's divide already made inside the reduction pass
  if (n == 1) {
    copy_own_blocks(context, contributions);
  } else {
    size_t total = 0;
    for (const ReduceScatterMember& member : bucket) {
      for (const ConstSpan& span : member.inputs) total += span.bytes;
    }
    SharedMemoryDomain* shared = context.shared_memory();
    switch (select_reduce_scatter(total, n, shared != nullptr, context.spans_hosts())) {
      case Algorithm::kSharedMemory:
        reduce_scatter_shared(context, *shared, contributions);
        divided = true;
        break;
      case Algorithm::kRing:
        detail::in_step_windows(context, contributions, static_cast<uint32_t>(n - 1),
                                [&](const auto& window) { reduce_scatter_ring(context, window); });
        divided = true;
        break;
      case Algorithm::kDirect:
        detail::in_step_windows(context, in_pieces(contributions), 1, [&](const auto& window) {
          reduce_scatter_direct(context, window);
        });
        break;
    }
  }
  if (divided) return;
  for (const ReduceScatterMember& member : bucket) {
    detail::post_divide(member.output.data, member.output.bytes, member.spec);
  }
}

void reduce_scatter(OpContext& context, const std::vector<ConstSpan>& inputs,
                    MutableSpan output, const ReduceSpec& spec) {
  reduce_scatter(context, std::vector<ReduceScatterMember>{ReduceScatterMember{inputs, output, spec}});
}

}  // namespace fsdp_ext::comm
