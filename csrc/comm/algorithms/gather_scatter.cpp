// Gather to and scatter from one root: the root posts one message per rank,
// all at once.
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/span_helpers.h"

namespace fsdp_ext::comm {

void gather(OpContext& context, ConstSpan input, const std::vector<MutableSpan>& outputs,
            int root) {
  const int n = context.size();
  const int r = context.rank();
  std::vector<Request> requests;
  if (r == root) {
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      requests.push_back(context.recv(p, 0, outputs[p].data,
                                      outputs[p].bytes));
    }
    detail::copy_if_distinct(outputs[r].data, input.data, input.bytes);
  } else {
    requests.push_back(
        context.send(root, 0, input.data, input.bytes));
  }
  context.wait_all(requests);
}

void scatter(OpContext& context, const std::vector<ConstSpan>& inputs, MutableSpan output,
             int root) {
  const int n = context.size();
  const int r = context.rank();
  std::vector<Request> requests;
  if (r == root) {
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      requests.push_back(context.send(p, 0, inputs[p].data,
                                      inputs[p].bytes));
    }
    detail::copy_if_distinct(output.data, inputs[r].data, output.bytes);
  } else {
    requests.push_back(
        context.recv(root, 0, output.data, output.bytes));
  }
  context.wait_all(requests);
}

}  // namespace fsdp_ext::comm
