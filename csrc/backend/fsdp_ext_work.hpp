// The Work returned by every fsdp_ext op. It is completed on the progress
// thread; wait() rethrows the op's error as DistBackendError, and the future
// completes with the op's output tensors (what DDP's comm hooks read).
//
// What it reports besides completion, as gloo's Work does: a profiler record
// with the op's input tensors (so a torch.profiler trace shows each op's
// shapes and dtypes), the group's collective sequence number, and, when the
// group's collectives timing is on, how long the op ran (getDuration).
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "comm/progress_engine.h"

namespace fsdp_ext::backend {

// Note [wait() returns once the engine let go]
// The progress thread completes a Work and only then drops its own hold on
// it (and through it on the op's output tensors). A caller that wait()s and
// drops the Work at once therefore left the last reference to the progress
// thread, and with it the return of the op's buffers to their pool (the
// host block cache) some microseconds after wait() returned: the caller's
// next allocation of that size found none idle and took a new block, so a
// training step's memory varied from run to run. An engine-completed Work is
// released (EngineRelease) once the engine holds nothing of it, and wait()
// on any other thread returns only then. A future callback that waits on
// the completing thread itself does not wait for it, and neither does a
// waiter that holds Python's GIL (set_release_wait_check): between the
// completion and the release the progress thread may need the GIL itself
// (a Python future callback; the last reference to a tensor whose Python
// object lives on). torch's own waits (Work.wait, the functional
// collectives' wait_tensor) release the GIL first.
class EngineRelease {
 public:
  // From now until release(), await() blocks. Before the op is submitted.
  void arm();
  void release();
  void await() const;

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable released_cv_;
  // Written under mutex_; read without it first, as the wait polls briefly
  // (the release follows the completion by microseconds).
  std::atomic<bool> released_{true};  // nothing to wait for until armed
};

// Whether this thread may wait for an engine's release (Note [wait()
// returns once the engine let go]). The bindings install a check that it
// does not hold the GIL; without one, every thread may.
void set_release_wait_check(bool (*may_wait)());

// What a Work records of its op besides completion.
struct WorkRecord {
  uint64_t seq = 0;       // the group's collective sequence number (0: not a collective)
  bool timed = false;     // record start and end (Backend::enableCollectivesTiming)
  // The op's Flight Recorder entry (flight_recorder.hpp), and the global
  // rank whose dump file a failure writes.
  std::optional<uint64_t> trace_id;
  int global_rank = 0;
};

class FsdpExtWork : public c10d::Work {
 public:
  // `wait_spin`: how long wait() polls before it sleeps on the Work's
  // condition variable (see wait_spin_for).
  // `inputs`: the tensors the op reads, for the profiler's record (taken
  // only while a profiler listens).
  FsdpExtWork(int rank, c10d::OpType type, const char* profiling_title,
              const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs,
              std::chrono::microseconds wait_spin, WorkRecord record);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  int sourceRank() const override;
  uint64_t getSequencenumber() const override { return record_.seq; }
  // Milliseconds from the op's start to its end; only for a finished op of
  // a group whose collectives timing is on.
  float getDuration() const override;

  // When the op began to run (its first call counts).
  void mark_started();
  // Called exactly once: on the progress thread, or on the caller's for a
  // small op that completed there.
  void complete(const comm::OpOutcome& outcome);

  // The engine's on_done for an op whose outcome completes `works`, in
  // order: completes them, drops the callback's references to them and
  // what `also_held` holds (a coalescing batch's members, which hold Works
  // and tensors too), then releases them (Note [wait() returns once the
  // engine let go]). Arms their release now, before the op is submitted.
  static std::function<void(const comm::OpOutcome&)> completion_on_engine(
      std::vector<c10::intrusive_ptr<FsdpExtWork>> works,
      std::shared_ptr<void> also_held = nullptr);

 private:
  using Clock = std::chrono::steady_clock;
  const WorkRecord record_;
  // Written on the completing thread before finish(), read under mutex_
  // once completed_ is set.
  Clock::time_point started_{};
  Clock::time_point ended_{};
  std::atomic<bool> started_marked_{false};

  std::vector<at::Tensor> outputs_;
  std::chrono::microseconds wait_spin_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<bool> done_{false};
  std::atomic<int> source_rank_{-1};
  // Written before finish(); read once isCompleted() (both under mutex_).
  std::thread::id completing_thread_;
  const std::shared_ptr<EngineRelease> engine_release_ = std::make_shared<EngineRelease>();

  // After the base class's wait: for a completed op, until the engine let go.
  void await_engine_release() const;
};

// Note [how long a wait polls]
// Most ops finish within tens to hundreds of microseconds; polling that long
// (yielding the core to the progress thread) before sleeping saves a futex
// wake-up per op, which costs tens of microseconds on virtual machines. An
// op that moves a few hundred KiB or more across hosts lasts longer than the
// poll: the poll then only takes a core from the kernel's TCP stack and the
// progress threads that carry the op (2x1 over TCP, 1 MiB broadcast and
// all-reduce: 25-35 % faster without it; small ops 2x slower without it).
// So those ops sleep at once. FSDP_EXT_WAIT_SPIN_US sets the poll for the
// others.
constexpr size_t kNoWaitSpinAcrossHostsBytes = 256 << 10;
std::chrono::microseconds wait_spin_for(size_t op_bytes, bool crosses_hosts);

// Builds the exception a failed op carries (DistBackendError).
std::exception_ptr make_backend_error(const std::string& message);

}  // namespace fsdp_ext::backend
