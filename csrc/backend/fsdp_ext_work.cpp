#include "backend/fsdp_ext_work.hpp"

#include <c10/util/Exception.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>

#include "backend/environment.hpp"

namespace fsdp_ext::backend {
std::chrono::microseconds wait_spin_for(size_t op_bytes, bool crosses_hosts) {
  // See Note [how long a wait polls].
  static const std::chrono::microseconds configured = wait_spin_from_environment();
  if (crosses_hosts && op_bytes >= kNoWaitSpinAcrossHostsBytes) {
    return std::chrono::microseconds(0);
  }
  return configured;
}

std::exception_ptr make_backend_error(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

FsdpExtWork::FsdpExtWork(int rank, c10d::OpType type, const char* profiling_title,
                         std::vector<at::Tensor> outputs, std::chrono::microseconds wait_spin)
    : c10d::Work(rank, type, profiling_title),
      outputs_(std::move(outputs)),
      wait_spin_(wait_spin),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

bool FsdpExtWork::wait(std::chrono::milliseconds timeout) {
  const auto spin_until = std::chrono::steady_clock::now() + wait_spin_;
  while (!done_.load(std::memory_order_acquire) &&
         std::chrono::steady_clock::now() < spin_until) {
    sched_yield();
  }
  return c10d::Work::wait(timeout);
}

c10::intrusive_ptr<c10::ivalue::Future> FsdpExtWork::getFuture() { return future_; }

std::vector<at::Tensor> FsdpExtWork::result() { return outputs_; }

int FsdpExtWork::sourceRank() const {
  const int source = source_rank_.load();
  TORCH_CHECK(source >= 0,
              "fsdp_ext: sourceRank() is only known for a completed receive from any source");
  return source;
}

void FsdpExtWork::complete(const comm::OpOutcome& outcome) {
  source_rank_.store(outcome.source_rank);
  // finish() before the future: a future callback may call wait() on this
  // Work from this very thread.
  if (outcome.ok) {
    finish();
    done_.store(true, std::memory_order_release);
    future_->markCompleted(c10::IValue(outputs_));
  } else {
    std::exception_ptr error = make_backend_error(outcome.message);
    finish(error);
    done_.store(true, std::memory_order_release);
    future_->setError(error);
  }
}

}  // namespace fsdp_ext::backend
