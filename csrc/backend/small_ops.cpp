// Small collectives through the small-op channel (comm/small_op_channel.h).
//
// Note [small ops on the caller's thread]: when the engine is idle the caller
// takes its turn (ProgressEngine::Turn), publishes its part and polls for
// its peers for at most the engine's spin time (FSDP_EXT_SPIN_US). If every
// peer arrives by then, the op completes right here -- no queue, no
// progress-thread wake-up, no UCX message -- and the returned Work is
// already done. Otherwise the rest of the wait goes to the engine, in this
// op's place in the queue, so an async op still returns at once and a slow
// peer is waited for (and timed out, and noticed dead) like any other. When
// the engine is busy the whole op is queued behind what is already there.
// All three ways run the same exchange, so ranks may take different ones.
#include <c10/util/Exception.h>

#include "backend/fsdp_ext_backend.hpp"
#include "backend/type_mapping.hpp"
#include "comm/algorithms/small_ops.h"

namespace fsdp_ext::backend {
namespace {

// The waiting half of a small op, on the progress thread: with the op's
// deadline, UCX kept moving and lost peers noticed (OpContext::channel_wait).
void wait_and_finish(comm::SmallOpChannel& channel,
                     const std::function<void(const comm::SmallOpChannel&)>& finish,
                     comm::OpContext& context) {
  channel.wait(context.channel_wait());
  try {
    finish(channel);
  } catch (const comm::CommError& error) {
    throw comm::CommError(error.kind(), context.description() + ": " + error.what());
  }
}

}  // namespace

bool FsdpExtBackend::use_small_ops(size_t bytes, const char* algorithm_variable) {
  if (!small_ops_enabled_ || !comm::takes_small_op_channel(bytes, algorithm_variable)) {
    return false;
  }
  // Inside a coalescing batch the op joins the batch's bucket instead (the
  // batch is the same on every rank, so every rank decides alike).
  std::lock_guard<std::mutex> lock(coalescing_mutex_);
  return !coalescing_on_this_thread();
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::run_small(
    const OpLabel& label, c10d::OpType type, const char* profiling_title,
    std::chrono::milliseconds timeout, std::vector<at::Tensor> outputs,
    std::vector<at::Tensor> inputs, SmallStart start, SmallFinish finish) {
  // The engine's bodies share the channel; the caller's own path uses it
  // directly.
  comm::SmallOpChannel& channel = *small_ops_;
  // Small ops stay within a host: the usual poll (Note [how long a wait polls]).
  auto work = make_work(type, profiling_title, /*collective=*/true, inputs, outputs,
                        wait_spin_for(0, /*crosses_hosts=*/false), timeout);
  std::vector<at::Tensor> keep_alive = tensors_of_op(inputs, outputs);
  // What the engine runs: the whole op when it is busy, or the rest of it.
  auto engine_op = [&](std::function<void(comm::OpContext&)> body) {
    comm::EngineOp op;
    op.name = label.op;
    op.kind = collective_kind_of(label.op);
    op.collective = true;
    op.small_op = true;
    op.timeout = timeout;
    op.keepalive = std::make_shared<std::vector<at::Tensor>>(std::move(keep_alive));
    op.body = std::move(body);
    op.on_start = [work] { work->mark_started(); };
    op.on_done = FsdpExtWork::completion_on_engine({work});
    return op;
  };
  comm::ProgressEngine::Turn turn = engine_->try_take_turn(label.op);
  if (!turn) {
    small_queued_.fetch_add(1, std::memory_order_relaxed);
    engine_->submit(engine_op([channel = small_ops_, start = std::move(start),
                               finish = std::move(finish)](comm::OpContext& context) {
      start(*channel, context.seq());
      wait_and_finish(*channel, finish, context);
    }));
    return work;
  }
  try {
    work->mark_started();
    start(channel, turn.seq());
    const auto spin = engine_->config().spin;
    if (channel.poll_until(std::chrono::steady_clock::now() + spin)) {
      finish(channel);
      turn.end();
      small_on_caller_.fetch_add(1, std::memory_order_relaxed);
      work->complete(comm::OpOutcome{});
      return work;
    }
  } catch (const comm::CommError& error) {
    comm::OpOutcome failure;
    failure.ok = false;
    failure.kind = error.kind();
    failure.message = engine_->describe_op(label.op, turn.seq()) + ": " + error.what();
    turn.fail(failure.message, failure.kind);
    work->complete(failure);
    return work;
  }
  small_handed_over_.fetch_add(1, std::memory_order_relaxed);
  turn.hand_over(
      engine_op([channel = small_ops_, finish = std::move(finish)](comm::OpContext& context) {
        wait_and_finish(*channel, finish, context);
      }));
  return work;
}

}  // namespace fsdp_ext::backend
