// All-gather over a bucket, with per-rank sizes (uneven all_gather is the
// same code).
//   direct: post every member's receives and sends at once; one round, best
//           for latency.
//   ring  : n-1 steps, each forwarding every member's block received in the
//           step before; every link carries each byte once.
//   shm   : each rank copies every peer's input straight out of the peer's
//           memory: mapped in place when it came from the group's pool,
//           else with process_vm_readv (large) or from a staging copy (small).
#include "comm/algorithm_selection.h"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/hierarchical.h"
#include "comm/algorithms/shared_source_exchange.h"
#include "comm/algorithms/span_helpers.h"

namespace fsdp_ext::comm {
namespace {

void copy_own_blocks(OpContext& context, const std::vector<AllgatherMember>& bucket) {
  for (const AllgatherMember& member : bucket) {
    detail::copy_if_distinct(member.outputs[context.rank()].data, member.input.data,
                             member.input.bytes);
  }
}

void allgather_direct(OpContext& context, const std::vector<AllgatherMember>& bucket) {
  const int n = context.size();
  const int r = context.rank();
  std::vector<Request> requests;
  requests.reserve(2 * static_cast<size_t>(n) * bucket.size());
  for (uint32_t m = 0; m < bucket.size(); ++m) {
    for (int k = 1; k < n; ++k) {
      const int from = detail::wrap(r - k, n);
      const MutableSpan& out = bucket[m].outputs[from];
      requests.push_back(context.recv(from, m, out.data, out.bytes));
    }
  }
  for (uint32_t m = 0; m < bucket.size(); ++m) {
    for (int k = 1; k < n; ++k) {
      requests.push_back(context.send(detail::wrap(r + k, n), m, bucket[m].input.data,
                                      bucket[m].input.bytes));
    }
  }
  copy_own_blocks(context, bucket);
  context.wait_all(requests);
}

void allgather_ring(OpContext& context, const std::vector<AllgatherMember>& bucket) {
  const int n = context.size();
  const int r = context.rank();
  const int next = detail::ring_next(r, n);
  const int prev = detail::ring_prev(r, n);
  const uint32_t members = static_cast<uint32_t>(bucket.size());
  copy_own_blocks(context, bucket);
  std::vector<Request> requests;
  for (int step = 0; step < n - 1; ++step) {
    const int send_block = detail::wrap(r - step, n);
    const int recv_block = detail::wrap(r - step - 1, n);
    requests.clear();
    for (uint32_t m = 0; m < members; ++m) {
      const uint32_t tag_step = static_cast<uint32_t>(step) * members + m;
      const MutableSpan& in = bucket[m].outputs[recv_block];
      requests.push_back(context.recv(prev, tag_step, in.data, in.bytes));
      const void* source = step == 0 ? bucket[m].input.data : bucket[m].outputs[send_block].data;
      requests.push_back(
          context.send(next, tag_step, source, bucket[m].outputs[send_block].bytes));
    }
    context.wait_all(requests);
  }
}

void allgather_shared(OpContext& context, SharedMemoryDomain& domain,
                      const std::vector<AllgatherMember>& bucket) {
  const int n = context.size();
  const int r = context.rank();
  SharedSourceExchange exchange(context, domain, 0, /*staging_slot=*/0, kProcessReadMinBytes,
                                SharedExchangeKind::kAllGather);
  std::vector<ConstSpan> inputs;
  for (const AllgatherMember& member : bucket) inputs.push_back(member.input);
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    std::vector<size_t> sizes;
    for (const AllgatherMember& member : bucket) sizes.push_back(member.outputs[p].bytes);
    exchange.offer(p, inputs);
    exchange.expect(p, std::move(sizes));
  }
  exchange.exchange();
  copy_own_blocks(context, bucket);
  // Start with the next rank so that ranks do not all read the same peer.
  for (int k = 1; k < n; ++k) {
    const int p = detail::wrap(r + k, n);
    for (size_t m = 0; m < bucket.size(); ++m) {
      exchange.copy_out(p, m, bucket[m].outputs[p].data);
    }
  }
  exchange.finish();
}

}  // namespace

void allgather(OpContext& context, const std::vector<AllgatherMember>& bucket) {
  if (hierarchical_allgather(context, bucket)) return;

  const int n = context.size();
  if (n == 1) {
    copy_own_blocks(context, bucket);
    return;
  }
  size_t total = 0;
  for (const AllgatherMember& member : bucket) {
    for (const MutableSpan& span : member.outputs) total += span.bytes;
  }
  SharedMemoryDomain* shared = context.shared_memory();
  switch (select_allgather(total, n, shared != nullptr)) {
    case Algorithm::kSharedMemory:
      return allgather_shared(context, *shared, bucket);
    case Algorithm::kRing:
      return detail::in_step_windows(context, bucket, static_cast<uint32_t>(n - 1),
                                     [&](const auto& window) { allgather_ring(context, window); });
    case Algorithm::kDirect:
      return detail::in_step_windows(context, bucket, 1,
                                     [&](const auto& window) { allgather_direct(context, window); });
  }
}

void allgather(OpContext& context, ConstSpan input, const std::vector<MutableSpan>& outputs) {
  allgather(context, std::vector<AllgatherMember>{AllgatherMember{input, outputs}});
}

}  // namespace fsdp_ext::comm
