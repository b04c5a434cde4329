#include "backend/fsdp_ext_work.hpp"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>

#include "backend/environment.hpp"
#include "backend/flight_recorder.hpp"

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

namespace {
// The inputs c10d::Work hands to the profiler's record: only while some
// profiler listens (hasCallbacks), so that an op without one copies no
// tensor list.
std::optional<std::vector<at::Tensor>> profiled_inputs(const char* profiling_title,
                                                       const std::vector<at::Tensor>& inputs) {
  if (profiling_title == nullptr || !at::hasCallbacks()) return std::nullopt;
  return inputs;
}
}  // namespace

FsdpExtWork::FsdpExtWork(int rank, c10d::OpType type, const char* profiling_title,
                         const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs,
                         std::chrono::microseconds wait_spin, WorkRecord record)
    : c10d::Work(rank, type, profiling_title, profiled_inputs(profiling_title, inputs)),
      record_(record),
      outputs_(std::move(outputs)),
      wait_spin_(wait_spin),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

namespace {
std::atomic<bool (*)()> release_wait_check{nullptr};
}  // namespace

void set_release_wait_check(bool (*may_wait)()) { release_wait_check.store(may_wait); }

void EngineRelease::arm() {
  std::lock_guard<std::mutex> lock(mutex_);
  released_ = false;
}

void EngineRelease::release() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    released_ = true;
  }
  released_cv_.notify_all();
}

void EngineRelease::await() const {
  constexpr int kPolls = 64;
  for (int i = 0; i < kPolls; ++i) {
    if (released_.load(std::memory_order_acquire)) return;
    sched_yield();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  released_cv_.wait(lock, [this] { return released_.load(std::memory_order_relaxed); });
}

std::function<void(const comm::OpOutcome&)> FsdpExtWork::completion_on_engine(
    std::vector<c10::intrusive_ptr<FsdpExtWork>> works, std::shared_ptr<void> also_held) {
  std::vector<std::shared_ptr<EngineRelease>> releases;
  releases.reserve(works.size());
  for (const auto& work : works) {
    work->engine_release_->arm();
    releases.push_back(work->engine_release_);
  }
  return [works = std::move(works), also_held = std::move(also_held),
          releases = std::move(releases)](const comm::OpOutcome& outcome) mutable {
    for (const auto& work : works) work->complete(outcome);
    // Possibly the last references: the Works (and their outputs) may be
    // destroyed here, before any waiter returns.
    works.clear();
    also_held.reset();
    for (const auto& release : releases) release->release();
  };
}

bool FsdpExtWork::wait(std::chrono::milliseconds timeout) {
  const auto spin_until = std::chrono::steady_clock::now() + wait_spin_;
  while (!done_.load(std::memory_order_acquire) &&
         std::chrono::steady_clock::now() < spin_until) {
    sched_yield();
  }
  // Also when the base wait throws the op's error.
  struct AwaitRelease {
    const FsdpExtWork& work;
    ~AwaitRelease() { work.await_engine_release(); }
  } await_release{*this};
  return c10d::Work::wait(timeout);
}

void FsdpExtWork::await_engine_release() const {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!completed_ || completing_thread_ == std::this_thread::get_id()) return;
  }
  bool (*may_wait)() = release_wait_check.load(std::memory_order_relaxed);
  if (may_wait != nullptr && !may_wait()) return;
  engine_release_->await();
}

c10::intrusive_ptr<c10::ivalue::Future> FsdpExtWork::getFuture() { return future_; }

std::vector<at::Tensor> FsdpExtWork::result() { return outputs_; }

int FsdpExtWork::sourceRank() const {
  const int source = source_rank_.load();
  TORCH_CHECK(source >= 0,
              "fsdp_ext: sourceRank() is only known for a completed receive from any source");
  return source;
}

void FsdpExtWork::mark_started() {
  // Called on the thread that begins the op, before complete() can run; a
  // second call (the rest of an op handed to the engine) changes nothing.
  if (started_marked_.exchange(true)) return;
  if (record_.timed) started_ = Clock::now();
  if (record_.trace_id) FlightRecorder::instance().started(*record_.trace_id);
}

float FsdpExtWork::getDuration() const {
  TORCH_CHECK(record_.timed,
              "fsdp_ext: Work._get_duration() needs collectives timing, which is off for this "
              "group: call enableCollectivesTiming() on its backend before the op");
  // completed_ is set by finish() under mutex_, after ended_ was written.
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(completed_,
              "fsdp_ext: Work._get_duration() is only known once the op has finished; wait() first");
  return std::chrono::duration<float, std::milli>(ended_ - started_).count();
}

void FsdpExtWork::complete(const comm::OpOutcome& outcome) {
  if (record_.timed) {
    // An op failed before it began counts from its end.
    ended_ = Clock::now();
    if (!started_marked_.exchange(true)) started_ = ended_;
  }
  if (record_.trace_id) {
    // A failed op stays "started" in the record: where the ranks stopped.
    FlightRecorder& recorder = FlightRecorder::instance();
    if (outcome.ok) {
      recorder.completed(*record_.trace_id);
    } else if (outcome.kind != comm::ErrorKind::kAborted) {
      const std::string where = recorder.write_dump_on_failure(record_.global_rank);
      if (!where.empty()) {
        LOG(ERROR) << "fsdp_ext: Flight Recorder dump written to " << where << " after: "
                   << outcome.message;
      }
    }
  }
  source_rank_.store(outcome.source_rank);
  completing_thread_ = std::this_thread::get_id();
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
