// State shared by every FSDP group under one root (upstream's FSDPCommContext
// plus the gradient reductions still in flight). CPU tensors need no streams:
// collectives are issued asynchronously and waited where their result is
// first needed, so an all-gather prefetch or a gradient reduce-scatter runs on
// the backend's progress thread while the next module computes.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "fsdp/gradient_divide.hpp"
#include "fsdp/training_state.hpp"  // FSDP_EXT_HIDDEN

namespace fsdp_ext::fsdp {

class FsdpParam;
class FsdpParamGroup;

// A group's gradient reduction in flight: once `work` (the reduce-scatter;
// null with one shard rank) completes, `output` holds this rank's chunk of
// every gradient back to back (padded chunk sizes) in the reduce dtype. The
// group finishes it (divides, HSDP all-reduce, cast, accumulate).
struct PendingReduce {
  // Weak: the group owns this context, which queues the reduction; a strong
  // reference would keep an abandoned model alive (a backward that failed
  // before the end-of-backward callback).
  std::weak_ptr<FsdpParamGroup> group;
  std::vector<std::shared_ptr<FsdpParam>> params;
  at::Tensor input;   // kept alive until the collective completes
  std::vector<at::Tensor> member_inputs;  // the same, per parameter
  at::Tensor output;
  c10::intrusive_ptr<c10d::Work> work;
  ReduceFactors factors;
  bool all_reduce = true;  // HSDP: all-reduce now (else accumulate a partial)
};

class FSDP_EXT_HIDDEN FsdpCommContext {
 public:
  // Groups in the order their forward finished, once per use; backward
  // prefetches the entry before the current group's.
  std::vector<std::weak_ptr<FsdpParamGroup>> post_forward_order;

  void add_reduce(PendingReduce reduce) { reduces_.push_back(std::move(reduce)); }
  // Reductions allowed in flight when a group issues its own: the largest
  // of the groups' set_reduce_scatter_max_input_buffers, resolved at lazy
  // init as upstream does (one queue, so one cap).
  void set_max_reduces_in_flight(int64_t n) { max_reduces_in_flight_ = n; }
  int64_t max_reduces_in_flight() const { return max_reduces_in_flight_; }
  // Completes the oldest reductions until at most `keep` remain in flight
  // (FsdpParamGroup::complete_reduce: wait, divide, all-reduce across
  // replicas, accumulate into the sharded gradients).
  void finish_reduces(size_t keep = 0);
  // End of a backward (the root's final callback, after every group's
  // finish_backward): completes every reduction in flight, and after the
  // last backward of a step forgets the forward order.
  void finish_backward(bool is_last_backward);
  // Waits for every in-flight reduce-scatter and discards its result
  // (reset after a failed iteration).
  void drop_reduces();
  size_t reduces_in_flight() const { return reduces_.size(); }

 private:
  std::deque<PendingReduce> reduces_;
  int64_t max_reduces_in_flight_ = 1;
};

}  // namespace fsdp_ext::fsdp
