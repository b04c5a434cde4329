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
  FsdpExtWork(int rank, c10d::OpType type, const char* profiling_title,
              std::vector<at::Tensor> outputs);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  int sourceRank() const override;

  // Called exactly once, on the progress thread.
  void complete(const comm::OpOutcome& outcome);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<bool> done_{false};
  std::atomic<int> source_rank_{-1};
};

// Builds the exception a failed op carries (DistBackendError).
std::exception_ptr make_backend_error(const std::string& message);

}  // namespace fsdp_ext::backend
