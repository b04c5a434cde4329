// Dissemination barrier: in round k every rank signals rank + 2^k and waits
// for rank - 2^k; after ceil(log2 n) rounds everyone has heard from everyone.
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/span_helpers.h"

namespace fsdp_ext::comm {

void barrier(OpContext& context) {
  const int n = context.size();
  const int r = context.rank();
  char token = 0;
  uint32_t round = 0;
  for (int distance = 1; distance < n; distance <<= 1, ++round) {
    std::vector<Request> requests{
        context.recv(detail::wrap(r - distance, n), round, &token, 0),
        context.send(detail::wrap(r + distance, n), round, &token, 0)};
    context.wait_all(requests);
  }
}

}  // namespace fsdp_ext::comm
