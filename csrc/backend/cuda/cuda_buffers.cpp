#include "backend/cuda/cuda_buffers.hpp"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include "comm/error.h"

namespace fsdp_ext::backend {

bool cuda_path_built() { return true; }

int cuda_device_count() { return c10::cuda::device_count(); }

int cuda_current_device() { return c10::cuda::current_device(); }

void refuse_legacy_ipc_for_tests(bool refuse) { device::refuse_legacy_handles_for_tests(refuse); }

std::shared_ptr<CudaBuffers> make_cuda_buffers(const OpLabel& label, int device,
                                               const CudaChoice& choice) {
  try {
    auto buffers = std::make_shared<GroupCudaBuffers>(device >= 0 ? device
                                                                  : c10::cuda::current_device());
    // Made so from the first where buffers are offered before the route is
    // chosen (FSDP_EXT_CUDA_PATH=ipc): they are then read in place too. Where
    // the device cannot, the pool stays as it is and the route's probe
    // reports why, on every rank. (Elsewhere the route decides first: its
    // probe switches the pool before any buffer is handed out.)
    if (choice.path == "ipc" && choice.ipc_handles == "descriptors") {
      try {
        buffers->share_by_descriptors();
      } catch (const comm::CommError&) {
      }
    }
    return buffers;
  } catch (const comm::CommError& error) {
    C10_THROW_ERROR(DistBackendError, label.prefix() + error.what());
  }
}

GroupCudaBuffers::GroupCudaBuffers(int device)
    : pool_(std::make_shared<device::DeviceBufferPool>(
          device, [] { c10::cuda::CUDACachingAllocator::emptyCache(); })) {}

at::Tensor GroupCudaBuffers::allocate(const OpLabel& label, int64_t numel,
                                      const at::TensorOptions& options) {
  const auto index = static_cast<c10::DeviceIndex>(pool_->device());
  const at::TensorOptions on_device = options.device(at::Device(at::kCUDA, index));
  if (numel == 0) return at::empty({0}, on_device);
  const size_t bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  void* data = nullptr;
  try {
    data = pool_->allocate(bytes, c10::cuda::getCurrentCUDAStream(index).stream());
  } catch (const comm::CommError& error) {
    C10_THROW_ERROR(OutOfMemoryError, label.prefix() + error.what());
  }
  // The deleter returns the buffer in stream order (Note [a freed buffer is
  // reused in stream order]); the pool lives as long as any of its tensors.
  std::shared_ptr<device::DeviceBufferPool> pool = pool_;
  return at::for_blob(data, {numel})
      .options(on_device)
      .target_device(on_device.device())
      .deleter([pool](void* buffer) { pool->release(buffer); })
      .make_tensor();
}

CudaBuffers::Stats GroupCudaBuffers::stats() const {
  const device::DeviceBufferStats pool = pool_->stats();
  Stats stats;
  stats.buffers = pool.buffers;
  stats.in_use = pool.in_use;
  stats.reserved_bytes = pool.reserved_bytes;
  stats.allocations = pool.allocations;
  stats.reuses = pool.reuses;
  stats.exported = pool.exported;
  return stats;
}

std::optional<device::IpcBuffer> GroupCudaBuffers::exported(const at::Tensor& tensor) const {
  if (!tensor.is_cuda() || tensor.device().index() != pool_->device()) return std::nullopt;
  return pool_->locate(tensor.data_ptr(), tensor.nbytes());
}

bool GroupCudaBuffers::record_use(const at::Tensor& tensor,
                                  const c10::cuda::CUDAStream& stream) const {
  if (!tensor.is_cuda() || tensor.device().index() != pool_->device()) return false;
  return pool_->record_use(tensor.storage().data_ptr().get(), stream.stream());
}

}  // namespace fsdp_ext::backend
