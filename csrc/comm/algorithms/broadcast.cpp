// Broadcast.
//   flat    : the root sends to every rank at once (one round); on one host the
//             receivers' CMA reads do the copying in parallel.
//   binomial: log2(n) rounds; each rank forwards to the ranks below it.
//   shm     : every rank copies the root's buffer straight out of its memory.
#include "comm/algorithm_selection.h"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/hierarchical.h"
#include "comm/algorithms/shared_source_exchange.h"
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

void broadcast_shared(OpContext& context, SharedMemoryDomain& domain, MutableSpan data,
                      int root) {
  SharedSourceExchange exchange(context, domain, 0, /*staging_slot=*/0, kProcessReadMinBytes,
                                SharedExchangeKind::kBroadcast);
  if (context.rank() == root) {
    for (int p = 0; p < context.size(); ++p) {
      if (p != root) exchange.offer(p, {ConstSpan{data.data, data.bytes}});
    }
  } else {
    exchange.expect(root, {data.bytes});
  }
  exchange.exchange();
  if (context.rank() != root) exchange.copy_out(root, 0, data.data);
  exchange.finish();
}

}  // namespace

void broadcast(OpContext& context, MutableSpan data, int root) {
  if (hierarchical_broadcast(context, data, root)) return;

  if (context.size() == 1) return;
  SharedMemoryDomain* shared = context.shared_memory();
  switch (select_broadcast(data.bytes, context.size(), shared != nullptr)) {
    case Algorithm::kSharedMemory:
      return broadcast_shared(context, *shared, data, root);
    case Algorithm::kDirect:
      return broadcast_flat(context, data, root);
    case Algorithm::kRing:
      return broadcast_binomial(context, data, root);
  }
}

}  // namespace fsdp_ext::comm
