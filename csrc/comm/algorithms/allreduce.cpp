// All-reduce, in place.
//   direct: every rank sends its whole buffer to every other rank and reduces
//           all n contributions locally in rank order: one round, for small
//           messages; the same order everywhere gives identical results.
//   ring  : reduce-scatter into this rank's block, then all-gather the blocks
//           (bandwidth optimal; each block reduced once by its owner).
#include "comm/algorithm_selection.h"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/span_helpers.h"

namespace fsdp_ext::comm {
namespace {

void allreduce_direct(OpContext& context, MutableSpan data, const ReduceSpec& spec) {
  const int n = context.size();
  const int r = context.rank();
  const size_t count = data.bytes / element_size(spec.type);
  if (spec.pre_scale != 1.0) {
    scale_in_place(data.data, count, spec.type, spec.pre_scale);
  }
  std::vector<const void*> contributions(n, nullptr);
  std::vector<Request> requests;
  requests.reserve(2 * static_cast<size_t>(n));
  for (int k = 1; k < n; ++k) {
    const int from = detail::wrap(r - k, n);
    void* staging = context.scratch(data.bytes);
    contributions[from] = staging;
    requests.push_back(context.recv(from, 0, staging, data.bytes));
  }
  for (int k = 1; k < n; ++k) {
    requests.push_back(context.send(detail::wrap(r + k, n), 0,
                                    data.data, data.bytes));
  }
  context.wait_all(requests);
  contributions[r] = data.data;
  if (r == 0) {
    for (int p = 1; p < n; ++p) {
      reduce_into(data.data, contributions[p], count, spec.type, spec.kind);
    }
  } else {
    void* accumulator = context.scratch(data.bytes);
    detail::copy_if_distinct(accumulator, contributions[0], data.bytes);
    for (int p = 1; p < n; ++p) {
      reduce_into(accumulator, contributions[p], count, spec.type, spec.kind);
    }
    detail::copy_if_distinct(data.data, accumulator, data.bytes);
  }
  detail::post_scale(data.data, data.bytes, spec);
}

void allreduce_ring(OpContext& context, MutableSpan data, const ReduceSpec& spec) {
  const int n = context.size();
  const size_t element = element_size(spec.type);
  const size_t count = data.bytes / element;
  std::vector<ConstSpan> blocks(n);
  std::vector<MutableSpan> outputs(n);
  size_t offset = 0;
  for (int p = 0; p < n; ++p) {
    const size_t block_count = count / n + (static_cast<size_t>(p) < count % n ? 1 : 0);
    char* start = static_cast<char*>(data.data) + offset * element;
    blocks[p] = ConstSpan{start, block_count * element};
    outputs[p] = MutableSpan{start, block_count * element};
    offset += block_count;
  }
  const int r = context.rank();
  reduce_scatter(context, blocks, outputs[r], spec);
  allgather(context, ConstSpan{outputs[r].data, outputs[r].bytes}, outputs);
}

}  // namespace

void allreduce(OpContext& context, MutableSpan data, const ReduceSpec& spec) {
  if (select_allreduce(data.bytes, context.size()) == Algorithm::kRing) {
    allreduce_ring(context, data, spec);
  } else {
    allreduce_direct(context, data, spec);
  }
}

}  // namespace fsdp_ext::comm
