// Reduce-scatter with per-rank sizes.
//   direct: every rank sends block p to rank p at once; the owner reduces the
//           blocks as they arrive, in rank order (deterministic).
//   ring  : n-1 steps passing a partial sum to the next rank, which adds its
//           own contribution; two staging buffers, each byte moved once.
// The owner of each block computes it exactly once, so an all-reduce built
// from reduce-scatter + all-gather gives bitwise-identical results everywhere.
#include <algorithm>

#include "comm/algorithm_selection.h"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/span_helpers.h"

namespace fsdp_ext::comm {
namespace {

std::vector<ConstSpan> apply_pre_scale(OpContext& context,
                                       const std::vector<ConstSpan>& inputs,
                                       const ReduceSpec& spec) {
  if (spec.pre_scale == 1.0) return inputs;
  std::vector<ConstSpan> scaled(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    scaled[i] = ConstSpan{detail::pre_scaled(context, inputs[i].data, inputs[i].bytes, spec),
                          inputs[i].bytes};
  }
  return scaled;
}

void reduce_scatter_direct(OpContext& context, const std::vector<ConstSpan>& inputs,
                           MutableSpan output, const ReduceSpec& spec) {
  const int n = context.size();
  const int r = context.rank();
  const size_t count = output.bytes / element_size(spec.type);
  std::vector<void*> staging(n, nullptr);
  // Receives first, in rank order, so the reduction consumes them in order;
  // then the sends.
  std::vector<Request> requests;
  requests.reserve(2 * static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    staging[p] = context.scratch(output.bytes);
    requests.push_back(context.recv(p, 0, staging[p], output.bytes));
  }
  const size_t receive_count = requests.size();
  for (int k = 1; k < n; ++k) {
    const int to = detail::wrap(r + k, n);
    requests.push_back(context.send(to, 0, inputs[to].data,
                                    inputs[to].bytes));
  }
  detail::copy_if_distinct(output.data, inputs[r].data, output.bytes);
  // Reduce each block as soon as it is in, overlapping the later arrivals.
  for (size_t i = 0; i < receive_count; ++i) {
    context.wait_one(requests, i);
    reduce_into(output.data, staging[requests[i].peer], count, spec.type, spec.kind);
  }
  context.wait_all(requests);
}

void reduce_scatter_ring(OpContext& context, const std::vector<ConstSpan>& inputs,
                         MutableSpan output, const ReduceSpec& spec) {
  const int n = context.size();
  const int r = context.rank();
  const int next = detail::ring_next(r, n);
  const int prev = detail::ring_prev(r, n);
  size_t largest = 0;
  for (const ConstSpan& span : inputs) largest = std::max(largest, span.bytes);
  void* buffers[2] = {context.scratch(largest), context.scratch(largest)};
  std::vector<Request> requests(2);
  for (int step = 0; step < n - 1; ++step) {
    const int send_block = detail::wrap(r - step - 1, n);
    const int recv_block = detail::wrap(r - step - 2, n);
    void* incoming = buffers[step % 2];
    const void* outgoing =
        step == 0 ? inputs[send_block].data : buffers[(step + 1) % 2];
    requests[0] = context.recv(prev, static_cast<uint32_t>(step), incoming,
                               inputs[recv_block].bytes);
    requests[1] = context.send(next, static_cast<uint32_t>(step),
                               outgoing, inputs[send_block].bytes);
    context.wait_all(requests);
    const size_t count = inputs[recv_block].bytes / element_size(spec.type);
    if (step < n - 2) {
      reduce_into(incoming, inputs[recv_block].data, count, spec.type, spec.kind);
    } else if (output.data == inputs[r].data) {
      reduce_into(output.data, incoming, count, spec.type, spec.kind);
    } else {
      detail::copy_if_distinct(output.data, incoming, output.bytes);
      reduce_into(output.data, inputs[r].data, count, spec.type, spec.kind);
    }
  }
}

}  // namespace

void reduce_scatter(OpContext& context, const std::vector<ConstSpan>& inputs,
                    MutableSpan output, const ReduceSpec& spec) {
  const std::vector<ConstSpan> contributions = apply_pre_scale(context, inputs, spec);
  if (context.size() == 1) {
    detail::copy_if_distinct(output.data, contributions[0].data, output.bytes);
  } else {
    size_t total = 0;
    for (const ConstSpan& span : inputs) total += span.bytes;
    if (select_reduce_scatter(total, context.size()) == Algorithm::kRing) {
      reduce_scatter_ring(context, contributions, output, spec);
    } else {
      reduce_scatter_direct(context, contributions, output, spec);
    }
  }
  detail::post_scale(output.data, output.bytes, spec);
}

}  // namespace fsdp_ext::comm
