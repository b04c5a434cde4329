// All-gather with per-rank sizes (uneven all_gather is the same code).
//   direct: post every receive and send at once; one round, best for latency
//           and on one host where the receiver's CMA read does the copy.
//   ring  : n-1 steps, each forwarding the block received in the step before;
//           every link carries each byte once.
#include "comm/algorithm_selection.h"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/span_helpers.h"

namespace fsdp_ext::comm {
namespace {

void allgather_direct(OpContext& context, ConstSpan input,
                      const std::vector<MutableSpan>& outputs) {
  const int n = context.size();
  const int r = context.rank();
  std::vector<Request> requests;
  requests.reserve(2 * static_cast<size_t>(n));
  for (int k = 1; k < n; ++k) {
    const int from = detail::wrap(r - k, n);
    requests.push_back(context.recv(from, 0, outputs[from].data,
                                    outputs[from].bytes));
  }
  for (int k = 1; k < n; ++k) {
    requests.push_back(
        context.send(detail::wrap(r + k, n), 0, input.data, input.bytes));
  }
  detail::copy_if_distinct(outputs[r].data, input.data, input.bytes);
  context.wait_all(requests);
}

void allgather_ring(OpContext& context, ConstSpan input,
                    const std::vector<MutableSpan>& outputs) {
  const int n = context.size();
  const int r = context.rank();
  const int next = detail::ring_next(r, n);
  const int prev = detail::ring_prev(r, n);
  detail::copy_if_distinct(outputs[r].data, input.data, input.bytes);
  std::vector<Request> requests(2);
  for (int step = 0; step < n - 1; ++step) {
    const int send_block = detail::wrap(r - step, n);
    const int recv_block = detail::wrap(r - step - 1, n);
    requests[0] = context.recv(prev, static_cast<uint32_t>(step),
                               outputs[recv_block].data,
                               outputs[recv_block].bytes);
    const void* source = step == 0 ? input.data : outputs[send_block].data;
    requests[1] = context.send(next, static_cast<uint32_t>(step),
                               source, outputs[send_block].bytes);
    context.wait_all(requests);
  }
}

}  // namespace

void allgather(OpContext& context, ConstSpan input,
               const std::vector<MutableSpan>& outputs) {
  size_t total = 0;
  for (const MutableSpan& span : outputs) total += span.bytes;
  if (select_allgather(total, context.size()) == Algorithm::kRing) {
    allgather_ring(context, input, outputs);
  } else {
    allgather_direct(context, input, outputs);
  }
}

}  // namespace fsdp_ext::comm
