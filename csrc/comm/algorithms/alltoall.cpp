// All-to-all (equal or uneven splits): every pair exchanges its block in one
// round; the sends are staggered (rank r starts with r+1) to spread the load.
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/span_helpers.h"

namespace fsdp_ext::comm {

void alltoall(OpContext& context, const std::vector<ConstSpan>& inputs,
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
    const int to = detail::wrap(r + k, n);
    requests.push_back(
        context.send(to, 0, inputs[to].data, inputs[to].bytes));
  }
  detail::copy_if_distinct(outputs[r].data, inputs[r].data, inputs[r].bytes);
  context.wait_all(requests);
}

}  // namespace fsdp_ext::comm
