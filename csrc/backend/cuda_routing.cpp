// CUDA tensors in the entry points: which device an op's tensors are on, the
// group's CUDA path (made at its first CUDA op), and the host exchange that
// path builds on. The path itself is backend/cuda/ (cuda_collectives.hpp).
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <cstring>

#include "backend/fsdp_ext_backend.hpp"

namespace fsdp_ext::backend {

CudaCollectives* FsdpExtBackend::cuda_route(const OpLabel& label,
                                            const std::vector<at::Tensor>& tensors,
                                            bool point_to_point) {
  const at::Tensor* first = nullptr;
  for (const at::Tensor& tensor : tensors) {
    if (!tensor.defined()) continue;
    if (first == nullptr) {
      first = &tensor;
      continue;
    }
    TORCH_CHECK_VALUE(tensor.device() == first->device(), label.prefix(),
                      "tensors on two devices, ", first->device(), " and ", tensor.device(),
                      "; an op's tensors must all be on one device");
  }
  if (first == nullptr || !first->is_cuda()) return nullptr;
  const int device = first->device().index();
  std::lock_guard<std::mutex> lock(cuda_mutex_);
  if (cuda_) {
    TORCH_CHECK_VALUE(device == cuda_device_, label.prefix(), "a tensor on cuda:", device,
                      ", but this rank's earlier CUDA ops in this group used cuda:", cuda_device_,
                      "; a rank uses one device per group (torch.cuda.set_device)");
  }
  if (point_to_point) {
    // Only two ranks are here: they cannot make the path, which every rank
    // of the group makes together.
    TORCH_CHECK_NOT_IMPLEMENTED(
        cuda_ != nullptr, label.prefix(),
        "a send or recv of CUDA tensors cannot be this group's first CUDA op: the group "
        "chooses its CUDA route at its first CUDA collective, on every rank; run one first, "
        "or use a 'cpu:fsdp_ext,cuda:nccl' backend string for CUDA point-to-point");
    TORCH_CHECK_NOT_IMPLEMENTED(
        cuda_->runs_point_to_point(), label.prefix(),
        "send and recv of CUDA tensors run only on the NCCL route; this group's CUDA route is ",
        cuda_->describe(), "; use a 'cpu:fsdp_ext,cuda:nccl' backend string for CUDA "
        "point-to-point");
    return cuda_.get();
  }
  if (!cuda_) {
    cuda_ = make_cuda_collectives(*this, label, device, cuda_choice_, nccl_factory_);
    cuda_device_ = device;
    LOG(INFO) << "fsdp_ext group '" << group_name_ << "': rank " << rank_ << "/" << size_
              << ", CUDA ops on cuda:" << device << ": " << cuda_->describe();
  }
  return cuda_.get();
}

namespace {
// The backend whose CUDA op this thread is running (its CPU ops, the host
// rounds of the CUDA path, bypass an open coalescing batch), or nullptr.
thread_local const FsdpExtBackend* running_cuda_op_of = nullptr;

// Sets running_cuda_op_of for a scope; restores the outer value on exit,
// also by an exception.
class RunningCudaOp {
 public:
  explicit RunningCudaOp(const FsdpExtBackend* group) : outer_(running_cuda_op_of) {
    running_cuda_op_of = group;
  }
  ~RunningCudaOp() { running_cuda_op_of = outer_; }
  RunningCudaOp(const RunningCudaOp&) = delete;
  RunningCudaOp& operator=(const RunningCudaOp&) = delete;

 private:
  const FsdpExtBackend* outer_;
};
}  // namespace

bool FsdpExtBackend::coalescing_on_this_thread() const {
  return coalescing_ && std::this_thread::get_id() == coalescing_thread_ &&
         running_cuda_op_of != this;
}

WorkPtr FsdpExtBackend::run_on_cuda(CudaCollectives& cuda, const OpLabel& label, CudaOp op) {
  bool in_batch = false;
  {
    std::lock_guard<std::mutex> lock(coalescing_mutex_);
    in_batch = coalescing_on_this_thread();
  }
  WorkPtr work;
  {
    const RunningCudaOp running(this);
    work = cuda.run(label, std::move(op));
  }
  if (in_batch) {
    std::lock_guard<std::mutex> lock(coalescing_mutex_);
    coalesced_cuda_works_.push_back(work);
  }
  return work;
}

void FsdpExtBackend::fail_collective(const OpLabel& label, std::chrono::milliseconds timeout,
                                     const std::string& reason) {
  const RunningCudaOp running(this);
  auto work = enqueue(label, c10d::OpType::UNKNOWN, "fsdp_ext:failed_on_this_rank",
                      /*collective=*/true, timeout, {}, {}, [reason](comm::OpContext&) {
                        throw comm::CommError(comm::ErrorKind::kDevice, reason);
                      });
  work->wait();
  // Not reached: the op's body always throws, and wait() raises it.
  C10_THROW_ERROR(DistBackendError, label.prefix() + reason);
}

std::string FsdpExtBackend::cuda_route_description() const {
  std::lock_guard<std::mutex> lock(cuda_mutex_);
  return cuda_ ? cuda_->describe() : "";
}

std::vector<std::vector<uint8_t>> FsdpExtBackend::exchange_bytes(
    const OpLabel& label, const std::vector<uint8_t>& local, std::chrono::milliseconds timeout) {
  // A host round runs now, also inside a coalescing batch (the path is
  // made at the group's first CUDA op, which may be the batch's first):
  // queued in the batch, its wait below would never return.
  const RunningCudaOp running(this);
  const auto bytes = static_cast<int64_t>(local.size());
  at::Tensor input = at::empty({bytes}, at::kByte);
  if (bytes > 0) std::memcpy(input.data_ptr(), local.data(), local.size());
  at::Tensor output = at::empty({bytes * size_}, at::kByte);
  allgather_into_tensor(label, output, input, timeout)->wait();
  std::vector<std::vector<uint8_t>> out(size_);
  const auto* data = static_cast<const uint8_t*>(output.data_ptr());
  for (int r = 0; r < size_; ++r) out[r].assign(data + r * bytes, data + (r + 1) * bytes);
  return out;
}

}  // namespace fsdp_ext::backend
