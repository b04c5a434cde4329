#include "fsdp/comm_context.hpp"

#include <unordered_set>

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

void FsdpCommContext::use_device(c10::Device device, bool enabled) {
  if (streams_) {
    TORCH_CHECK_VALUE(streams_->device() == device, "fsdp_ext: one FSDP root spans devices ",
                      streams_->device().str(), " and ", device.str(),
                      "; every module of a root must shard onto the same device");
    return;
  }
  if (enabled) streams_ = std::make_unique<FsdpStreams>(device);
}

void FsdpCommContext::root_pre_forward() {
  if (!streams_) return;
  const c10::Stream current = streams_->current();
  streams_->wait_stream(streams_->all_gather_copy_in(), current);
  streams_->wait_stream(streams_->all_gather(), current);
}

void FsdpCommContext::release_all_gather_state() {
  if (!all_gather_state) return;
  if (streams_) streams_->all_gather_streams_wait(all_gather_state->event);
  all_gather_state.reset();
}

void FsdpCommContext::add_post_reduce_event(c10::Stream stream, StreamEvent event) {
  for (auto& [known, last] : post_reduce_events_) {
    if (known == stream) {
      last = std::move(event);
      return;
    }
  }
  post_reduce_events_.emplace_back(stream, std::move(event));
}

void FsdpCommContext::release_reduce_scatter_states(size_t keep) {
  while (reduce_scatter_states.size() > keep) {
    if (streams_) FsdpStreams::wait_event(streams_->current(), reduce_scatter_states.front().event);
    reduce_scatter_states.pop_front();
  }
}

void FsdpCommContext::wait_device_reductions() {
  if (streams_) {
    const c10::Stream current = streams_->current();
    for (const auto& entry : post_reduce_events_) FsdpStreams::wait_event(current, entry.second);
  }
  post_reduce_events_.clear();
  post_reduce_buffers.clear();
  release_reduce_scatter_states(0);
}

std::vector<c10::Stream> FsdpCommContext::all_gather_streams() const {
  if (!streams_) return {};
  return {streams_->all_gather_copy_in(), streams_->all_gather()};
}

void FsdpCommContext::finish_backward(bool is_last_backward) {
  finish_reduces(0);
  // Device reductions completed in stream order: the compute stream (the
  // optimizer's) waits for them, and the held inputs are released.
  wait_device_reductions();
  // The forward order is kept across microbatches (each backward prefetches
  // through it) and dropped once the step's last backward is done.
  if (is_last_backward) post_forward_order.clear();
}

bool FsdpCommContext::holds_groups_other_than(
    const std::vector<std::shared_ptr<FsdpParamGroup>>& groups) const {
  std::unordered_set<const FsdpParamGroup*> mine;
  for (const auto& group : groups) mine.insert(group.get());
  // An expired group (its model gone) is nobody's work any more.
  auto other = [&](const std::weak_ptr<FsdpParamGroup>& weak) {
    const std::shared_ptr<FsdpParamGroup> group = weak.lock();
    return group && mine.count(group.get()) == 0;
  };
  for (const PendingReduce& reduce : reduces_) {
    if (other(reduce.group)) return true;
  }
  for (const auto& group : post_forward_order) {
    if (other(group)) return true;
  }
  return false;
}

void FsdpCommContext::drop_reduces() {
  wait_device_reductions();
  release_all_gather_state();
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
