#include "backend/fsdp_ext_work.hpp"

#include <c10/util/Exception.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>

#include "backend/environment.hpp"

namespace fsdp_ext::backend {
namespace {
// Most ops finish within tens to hundreds of microseconds; polling (and
// yielding the core to the progress thread) that long before sleeping on the
// condition variable saves a futex wake-up per op, which costs tens of
// microseconds on virtual machines. FSDP_EXT_WAIT_SPIN_US overrides it.
std::chrono::microseconds wait_spin() {
  static const std::chrono::microseconds spin = wait_spin_from_environment();
  return spin;
}
}  // namespace

std::exception_ptr make_backend_error(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

FsdpExtWork::FsdpExtWork(int rank, c10d::OpType type, const char* profiling_title,
                         std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type, profiling_title),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

bool FsdpExtWork::wait(std::chrono::milliseconds timeout) {
  const auto spin_until = std::chrono::steady_clock::now() + wait_spin();
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
