#include "fsdp/comm_context.hpp"

#include "fsdp/fsdp_param_group.hpp"
#include "fsdp/collective_group.hpp"

namespace fsdp_ext::fsdp {

void FsdpCommContext::finish_reduces(size_t keep) {
  while (reduces_.size() > keep) {
    // Pop first: if the wait throws (a peer failed), the entry is gone and
    // the next backward does not wait on it again.
    PendingReduce reduce = std::move(reduces_.front());
    reduces_.pop_front();
    std::shared_ptr<FsdpParamGroup> group = reduce.group.lock();
    if (!group) {
      wait_releasing_gil(reduce.work);  // its parameters are gone
      continue;
    }
    group->complete_reduce(std::move(reduce));
  }
}

void FsdpCommContext::finish_backward(bool is_last_backward) {
  finish_reduces(0);
  // The forward order is kept across microbatches (each backward prefetches
  // through it) and dropped once the step's last backward is done.
  if (is_last_backward) post_forward_order.clear();
}

void FsdpCommContext::drop_reduces() {
  while (!reduces_.empty()) {
    PendingReduce reduce = std::move(reduces_.front());
    reduces_.pop_front();
    try {
      wait_releasing_gil(reduce.work);
    } catch (const std::exception&) {
      // The iteration already failed; its gradients are being discarded.
    }
  }
}

}  // namespace fsdp_ext::fsdp
