#include "backend/cuda/cuda_work.hpp"

#include <c10/cuda/CUDAGuard.h>

namespace fsdp_ext::backend {

CudaWork::CudaWork(int rank, c10d::OpType type, const char* profiling_title,
                   std::vector<at::Tensor> outputs, const c10::cuda::CUDAStream& op_stream)
    : c10d::Work(rank, type, profiling_title),
      outputs_(std::move(outputs)),
      end_(cudaEventDisableTiming),
      device_(op_stream.device_index()) {
  end_.record(op_stream);
  // The future is completed now, with the op's stream current: it records
  // its own event there, and whoever waits on it (with their stream
  // current) is ordered after the op.
  future_ = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()),
      std::vector<c10::Device>{c10::Device(c10::kCUDA, device_)});
  c10::cuda::CUDAStreamGuard guard(op_stream);
  future_->markCompleted(c10::IValue(outputs_));
}

bool CudaWork::isCompleted() { return end_.query(); }

bool CudaWork::wait(std::chrono::milliseconds /*timeout*/) {
  synchronize();
  return true;
}

void CudaWork::synchronize() {
  end_.block(c10::cuda::getCurrentCUDAStream(device_));
}

c10::intrusive_ptr<c10::ivalue::Future> CudaWork::getFuture() { return future_; }

std::vector<at::Tensor> CudaWork::result() { return outputs_; }

}  // namespace fsdp_ext::backend
