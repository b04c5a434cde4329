// The Work returned by every fsdp_ext op. It is completed on the progress
// thread; wait() rethrows the op's error as DistBackendError, and the future
// completes with the op's output tensors (what DDP's comm hooks read).
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <vector>

#include "comm/progress_engine.h"

namespace fsdp_ext::backend {

class FsdpExtWork : public c10d::Work {
 public:
  // `wait_spin`: how long wait() polls before it sleeps on the Work's
  // condition variable (see wait_spin_for).
  FsdpExtWork(int rank, c10d::OpType type, const char* profiling_title,
              std::vector<at::Tensor> outputs, std::chrono::microseconds wait_spin);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  int sourceRank() const override;

  // Called exactly once, on the progress thread.
  void complete(const comm::OpOutcome& outcome);

 private:
  std::vector<at::Tensor> outputs_;
  std::chrono::microseconds wait_spin_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<bool> done_{false};
  std::atomic<int> source_rank_{-1};
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
