// Reduce to one root: every rank sends to the root, which reduces the
// contributions in rank order as they arrive. Other ranks' data is unchanged.
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/span_helpers.h"

namespace fsdp_ext::comm {

void reduce(OpContext& context, MutableSpan data, int root, const ReduceSpec& spec) {
  const int n = context.size();
  const int r = context.rank();
  const size_t count = data.bytes / element_size(spec.type);
  if (r != root) {
    std::vector<Request> send{context.send(
        root, 0, detail::pre_scaled(context, data.data, data.bytes, spec),
        data.bytes)};
    context.wait_all(send);
    return;
  }
  if (spec.pre_scale != 1.0) scale_in_place(data.data, count, spec.type, spec.pre_scale);
  std::vector<Request> receives;
  std::vector<void*> staging(n, nullptr);
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    staging[p] = context.scratch(data.bytes);
    receives.push_back(context.recv(p, 0, staging[p], data.bytes));
  }
  for (size_t i = 0; i < receives.size(); ++i) {
    context.wait_one(receives, i);
    reduce_into(data.data, staging[receives[i].peer], count, spec.type, spec.kind);
  }
  detail::post_divide(data.data, data.bytes, spec);
}

}  // namespace fsdp_ext::comm
