// The Work of an op on CUDA tensors (IPC and staged routes; the NCCL route
// returns torch's own). The op was enqueued on the group's stream before this
// Work was made; it records the op's end there, and honours the c10d stream
// contract as ProcessGroupNCCL's Work does:
//
//   wait()        the caller's current stream waits for the op's end; the
//                 host does not (no synchronisation unless asked)
//   synchronize() the same
//   isCompleted() whether the device has finished the op
//   getFuture()   completed with the outputs, ordered on the op's stream, so
//                 a callback's consumer (DDP's comm hooks) sees finished data
#pragma once

#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

namespace fsdp_ext::backend {

class CudaWork : public c10d::Work {
 public:
  CudaWork(int rank, c10d::OpType type, const char* profiling_title,
           std::vector<at::Tensor> outputs, const c10::cuda::CUDAStream& op_stream);

  bool isCompleted() override;
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;

 private:
  std::vector<at::Tensor> outputs_;
  c10::cuda::CUDAEvent end_;
  c10::DeviceIndex device_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace fsdp_ext::backend
