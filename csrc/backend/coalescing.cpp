// Coalescing: collectives issued between startCoalescing and endCoalescing
// (dist._coalescing_manager, FSDP's buckets) run as one fused engine op.
#include "backend/fsdp_ext_backend.hpp"
#include "backend/type_mapping.hpp"

#include <c10/util/Exception.h>

#include "comm/algorithms/algorithms.h"

namespace fsdp_ext::backend {

void FsdpExtBackend::startCoalescing() {
  std::lock_guard<std::mutex> lock(coalescing_mutex_);
  TORCH_CHECK(!coalescing_, label("start_coalescing").prefix(),
              "coalescing is already active; nested coalescing is not supported");
  coalescing_ = true;
  coalescing_thread_ = std::this_thread::get_id();
  coalesced_timeout_ = default_timeout_;
}

// Note [CUDA ops in a coalescing batch]
// dist._coalescing_manager(device=cuda) opens a batch, then issues its
// captured ops as one coalesced call (all_reduce_coalesced, ...) before
// closing it, and waits on what endCoalescing returns. A CUDA op inside the
// batch runs at once (run_on_cuda); every CUDA op of a group runs on one
// stream, in issue order (torch's NCCL group's ops on its own, in order), so
// the last one's Work orders the caller after all of them, and is the batch's.
// A batch that mixes CPU and CUDA ops is refused.
c10::intrusive_ptr<c10d::Work> FsdpExtBackend::endCoalescing() {
  std::vector<CoalescedOp> members;
  std::vector<at::Tensor> tensors;
  std::vector<WorkPtr> cuda_works;
  std::chrono::milliseconds timeout;
  {
    std::lock_guard<std::mutex> lock(coalescing_mutex_);
    TORCH_CHECK(coalescing_, label("end_coalescing").prefix(),
                "endCoalescing() without a matching startCoalescing()");
    coalescing_ = false;
    members = std::move(coalesced_ops_);
    coalesced_ops_.clear();
    tensors = std::move(coalesced_tensors_);
    coalesced_tensors_.clear();
    cuda_works = std::move(coalesced_cuda_works_);
    coalesced_cuda_works_.clear();
    timeout = coalesced_timeout_;
  }
  if (!cuda_works.empty()) {
    TORCH_CHECK_NOT_IMPLEMENTED(members.empty(), label("end_coalescing").prefix(),
                                "a coalescing batch of both CPU and CUDA tensors");
    return cuda_works.back();
  }
  const bool any_collective = std::any_of(members.begin(), members.end(),
                                          [](const CoalescedOp& m) { return m.collective; });
  // A batch of receives alone (batch_isend_irecv of irecvs) takes what a lost
  // peer sent before it went, as each receive would on its own (Note [what a
  // lost peer sent still arrives], comm/progress_engine.cpp).
  const bool receives_only =
      !members.empty() && std::all_of(members.begin(), members.end(),
                                      [](const CoalescedOp& m) { return m.receive_only; });
  // The batch's own Work takes no sequence number: its members did.
  auto work = make_work(c10d::OpType::COALESCED, "fsdp_ext:coalesced", /*collective=*/false,
                        tensors, tensors, wait_spin_for_tensors(tensors), timeout);
  auto shared_members = std::make_shared<std::vector<CoalescedOp>>(std::move(members));
  comm::EngineOp op;
  op.name = "coalesced";
  op.kind = collective_kind_of(op.name.c_str());
  op.collective = any_collective;
  op.receive_only = receives_only;
  op.timeout = timeout;
  op.body = coalesced_body(shared_members);
  op.on_start = [shared_members, work] {
    for (CoalescedOp& member : *shared_members) member.work->mark_started();
    work->mark_started();
  };
  op.keepalive = std::make_shared<std::vector<at::Tensor>>(std::move(tensors));
  std::vector<c10::intrusive_ptr<FsdpExtWork>> works;
  for (const CoalescedOp& member : *shared_members) works.push_back(member.work);
  works.push_back(work);
  op.on_done = FsdpExtWork::completion_on_engine(std::move(works), shared_members);
  engine_->submit(std::move(op));
  return work;
}

FsdpExtBackend::Body FsdpExtBackend::bucket_body(std::shared_ptr<const BucketMembers> members) {
  return [members](comm::OpContext& context) {
    if (!members->allgather.empty()) comm::allgather(context, members->allgather);
    if (!members->reduce_scatter.empty()) comm::reduce_scatter(context, members->reduce_scatter);
    if (!members->allreduce.empty()) comm::allreduce(context, members->allreduce);
  };
}

FsdpExtBackend::Body FsdpExtBackend::coalesced_body(
    std::shared_ptr<std::vector<CoalescedOp>> members) {
  // Members of one kind (all all-gathers, all reduce-scatters or all
  // all-reduces: what FSDP and _coalescing_manager issue) fuse into one
  // bucket: one algorithm pass.
  auto fused = std::make_shared<BucketMembers>();
  bool fusible = !members->empty();
  for (const CoalescedOp& member : *members) {
    if (!member.bucket) {
      fusible = false;
      break;
    }
    const BucketMembers& b = *member.bucket;
    fused->allgather.insert(fused->allgather.end(), b.allgather.begin(), b.allgather.end());
    fused->reduce_scatter.insert(fused->reduce_scatter.end(), b.reduce_scatter.begin(),
                                 b.reduce_scatter.end());
    fused->allreduce.insert(fused->allreduce.end(), b.allreduce.begin(), b.allreduce.end());
  }
  const int kinds_seen = !fused->allgather.empty() + !fused->reduce_scatter.empty() +
                         !fused->allreduce.empty();
  if (fusible && kinds_seen <= 1) return bucket_body(fused);
  // Anything else (mixed kinds, point-to-point): one queued op whose
  // point-to-point members are posted (non-blocking) and whose collective
  // members run in issue order, each with its own sequence number.
  return [members](comm::OpContext& context) {
    bool first_collective = true;
    for (CoalescedOp& member : *members) {
      if (member.collective) {
        if (!first_collective) context.begin_next_collective();
        first_collective = false;
      }
      member.body(context);
    }
  };
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::enqueue_bucket(
    const OpLabel& label, c10d::OpType type, const char* profiling_title,
    std::chrono::milliseconds timeout, std::vector<at::Tensor> outputs,
    std::vector<at::Tensor> inputs, BucketMembers bucket) {
  auto members = std::make_shared<const BucketMembers>(std::move(bucket));
  return enqueue(label, type, profiling_title, true, timeout, std::move(outputs),
                 std::move(inputs), bucket_body(members), members);
}

}  // namespace fsdp_ext::backend
