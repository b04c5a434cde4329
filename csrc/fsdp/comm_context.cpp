#include "fsdp/comm_context.hpp"

#include <c10/util/accumulate.h>

#include "fsdp/fsdp_param.hpp"
#include "fsdp/group_collectives.hpp"

namespace fsdp_ext::fsdp {

void FsdpCommContext::finish_reduces(size_t keep) {
  while (reduces_.size() > keep) {
    // Pop first: if the wait throws (a peer failed), the entry is gone and
    // the next backward does not wait on it again.
    PendingReduce reduce = std::move(reduces_.front());
    reduces_.pop_front();
    if (reduce.work) wait_releasing_gil(reduce.work);
    if (reduce.post_divide) reduce.output.div_(*reduce.post_divide);
    int64_t offset = 0;
    for (const std::shared_ptr<FsdpParam>& param : reduce.params) {
      const int64_t shard_numel = c10::multiply_integers(param->sharded_size());
      param->accumulate_sharded_grad(
          reduce.output.narrow(0, offset, shard_numel).view(param->sharded_size()));
      offset += param->padded_shard_numel();
    }
  }
}

void FsdpCommContext::drop_reduces() {
  while (!reduces_.empty()) {
    PendingReduce reduce = std::move(reduces_.front());
    reduces_.pop_front();
    if (reduce.work) {
      try {
        wait_releasing_gil(reduce.work);
      } catch (const std::exception&) {
        // The iteration already failed; its gradients are being discarded.
      }
    }
  }
}

}  // namespace fsdp_ext::fsdp
