// State shared by every FSDP group under one root (upstream's FSDPCommContext
// plus the gradient reductions still in flight). CPU tensors need no streams:
// collectives are issued asynchronously and waited where their result is
// first needed, so an all-gather prefetch or a gradient reduce-scatter runs on
// the backend's progress thread while the next module computes.
//
// On an accelerator (a CUDA mesh) the root's lazy init gives the context its
// side streams (fsdp_streams.hpp): collectives then run on them and are
// ordered by events, as upstream's, and the host waits for nothing.
//
// Note [keeping collective buffers alive across streams]
// A buffer allocated on one stream and used on another must outlive the use:
// the caching allocator reuses a block for the allocating stream's next
// request as soon as the host drops the tensor. So, as upstream:
//  - a forward all-gather's flat output (allocated on the copy-in stream,
//    read by the copy-out on the compute stream) is kept in
//    `all_gather_state` with the copy-out's event until the next group's
//    copy-out starts (the all-gather streams wait for that event, then drop
//    it), so the next all-gather overlaps this copy-out; in backward, and
//    for the last group (the root's post-forward), the streams wait at once;
//  - a reduce-scatter's input (allocated on the compute stream, read on the
//    reduce-scatter stream) is kept in `reduce_scatter_states` with the
//    reduce-scatter's event until the compute stream has waited for it:
//    when a later group issues its own (at most max_input_buffers kept), and
//    at the end of backward;
//  - the reduce-scatter output becomes the sharded gradient in stream order
//    on the reduce-scatter (or all-reduce) stream; the compute stream waits
//    for the last such event per stream at the end of backward, before the
//    optimizer reads the gradients. An output whose reduction ended on the
//    all-reduce stream is held until then (`post_reduce_buffers`); with one
//    shard rank the output is a copy made on the reduce-scatter stream, and
//    the input is held like a reduce-scatter's.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <deque>
#include <memory>
#include <utility>
#include <optional>
#include <vector>

#include "fsdp/fsdp_streams.hpp"
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

// A collective buffer kept alive until `event` (its last use on another
// stream) has been waited for by the stream it was allocated on.
struct HeldBuffer {
  at::Tensor buffer;
  StreamEvent event;
};

class FSDP_EXT_HIDDEN FsdpCommContext {
 public:
  // Accelerator meshes: the root's lazy init makes the side streams (once;
  // a second device is refused). `enabled` false (FSDP_EXT_FSDP_STREAMS=0)
  // keeps every collective on the compute stream: slower, and a way to tell
  // an ordering bug from anything else.
  void use_device(c10::Device device, bool enabled);
  // Null on CPU, before lazy init, and with streams disabled.
  FsdpStreams* streams() const { return streams_.get(); }
  // The root's pre-forward: the all-gather streams wait for the compute
  // stream (the optimizer step's updates to the shards).
  void root_pre_forward();
  // The root's post-forward: the last forward all-gather output is released.
  void release_all_gather_state();
  // Note [keeping collective buffers alive across streams].
  std::optional<HeldBuffer> all_gather_state;
  std::deque<HeldBuffer> reduce_scatter_states;
  // Reduce-scatter outputs whose reduction ended on another stream (HSDP's
  // all-reduce): held until the end of backward, as upstream's all-reduce
  // state.
  std::vector<HeldBuffer> post_reduce_buffers;
  // The all-gather streams, for a user's post-optimizer event
  // (FSDPModule.set_post_optim_event) to be waited on in place of the
  // compute stream.
  std::vector<c10::Stream> all_gather_streams() const;
  // The last post-reduce event per stream (later events on a stream subsume
  // earlier ones): the compute stream waits for them at the end of backward.
  void add_post_reduce_event(c10::Stream stream, StreamEvent event);
  // The compute stream waits for every held reduce-scatter input until at
  // most `keep` remain, releasing them.
  void release_reduce_scatter_states(size_t keep);

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
  // Whether a reduction in flight or the forward order holds a group that
  // is not one of `groups`: another root's work, on a context shared with
  // share_comm_ctx, which an asynchronous finalize_backward must not overlap.
  bool holds_groups_other_than(const std::vector<std::shared_ptr<FsdpParamGroup>>& groups) const;

 private:
  // The compute stream waits for every post-reduce event and held buffer.
  void wait_device_reductions();

  std::deque<PendingReduce> reduces_;
  int64_t max_reduces_in_flight_ = 1;
  std::unique_ptr<FsdpStreams> streams_;
  std::vector<std::pair<c10::Stream, StreamEvent>> post_reduce_events_;
};

}  // namespace fsdp_ext::fsdp
