// Broadcast.
//   flat    : the root sends to every rank at once (one round); on one host the
//             receivers' CMA reads do the copying in parallel.
//   binomial: log2(n) rounds; each rank forwards to the ranks below it.
#include "comm/algorithm_selection.h"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/span_helpers.h"

namespace fsdp_ext::comm {
namespace {

void broadcast_flat(OpContext& context, MutableSpan data, int root) {
  const int n = context.size();
  const int r = context.rank();
  std::vector<Request> requests;
  if (r == root) {
    for (int k = 1; k < n; ++k) {
      requests.push_back(context.send(detail::wrap(r + k, n), 0,
                                      data.data, data.bytes));
    }
  } else {
    requests.push_back(context.recv(root, 0, data.data, data.bytes));
  }
  context.wait_all(requests);
}

void broadcast_binomial(OpContext& context, MutableSpan data, int root) {
  const int n = context.size();
  const int relative = detail::wrap(context.rank() - root, n);
  int mask = 1;
  while (mask < n) {
    if (relative & mask) {
      std::vector<Request> receive{context.recv(detail::wrap(relative - mask + root, n), 0,
                                                data.data,
                                                data.bytes)};
      context.wait_all(receive);
      break;
    }
    mask <<= 1;
  }
  std::vector<Request> sends;
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (relative + mask < n) {
      sends.push_back(context.send(detail::wrap(relative + mask + root, n), 0,
                                   data.data, data.bytes));
    }
  }
  context.wait_all(sends);
}

}  // namespace

void broadcast(OpContext& context, MutableSpan data, int root) {
  if (context.size() == 1) return;
  if (select_broadcast(data.bytes, context.size()) == Algorithm::kDirect) {
    broadcast_flat(context, data, root);
  } else {
    broadcast_binomial(context, data, root);
  }
}

}  // namespace fsdp_ext::comm
