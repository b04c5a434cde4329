// A group's device buffers (allocate_tensor on CUDA; CudaBuffers in
// cuda_collectives.hpp): tensors over the device room's buffer pool
// (device/device_buffer_pool.h), which the IPC route exports by the handle
// each buffer got once, when it was made.
#pragma once

#include <c10/cuda/CUDAStream.h>

#include <memory>
#include <optional>
#include <string>

#include "backend/cuda_collectives.hpp"
#include "device/device_buffer_pool.h"

namespace fsdp_ext::backend {

class GroupCudaBuffers final : public CudaBuffers {
 public:
  explicit GroupCudaBuffers(int device);

  at::Tensor allocate(const OpLabel& label, int64_t numel,
                      const at::TensorOptions& options) override;
  int device() const override { return pool_->device(); }
  Stats stats() const override;

  // How a peer reads `tensor`'s bytes, if they are in one of this pool's
  // buffers and it has a handle; nullopt otherwise.
  std::optional<device::IpcBuffer> exported(const at::Tensor& tensor) const;
  // Work on `stream` uses `tensor`: true (and its buffer's release waits
  // for that stream) if the tensor's memory is this pool's.
  bool record_use(const at::Tensor& tensor, const c10::cuda::CUDAStream& stream) const;
  // New buffers are shared as file descriptors from now on
  // (DeviceBufferPool::share_by_descriptors); where their server listens.
  void share_by_descriptors() const { pool_->share_by_descriptors(); }
  std::string descriptor_address() const { return pool_->descriptor_address(); }
  // Left to the process's exit, not freed (DeviceBufferPool::abandon_memory).
  void abandon_memory() const { pool_->abandon_memory(); }

 private:
  std::shared_ptr<device::DeviceBufferPool> pool_;
};

}  // namespace fsdp_ext::backend
