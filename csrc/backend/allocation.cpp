// Tensors allocated from the group: memory from the shared buffer pool,
// which peers on the same host read in place.
#include "backend/fsdp_ext_backend.hpp"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

namespace fsdp_ext::backend {

bool FsdpExtBackend::supportsTensorAlloc(c10::DeviceIndex device_index) {
  // c10d passes only the device index; CPU's is -1 (CUDA devices are >= 0).
  return device_index < 0 && shared_memory_enabled();
}

at::Tensor FsdpExtBackend::allocateTensor(long size, at::TensorOptions options) {
  const OpLabel l = label("allocate_tensor");
  TORCH_CHECK_VALUE(size >= 0, l.prefix(), "size must be >= 0, got ", size);
  if (options.has_device() && !options.device().is_cpu()) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, l.prefix(), "only CPU tensors can be allocated from ",
                                "this group, not ", options.device().str());
  }
  TORCH_CHECK(shared_memory_enabled(), l.prefix(),
              "this group does not share memory between its ranks (ranks on several hosts, ",
              "a peer's memory could not be mapped, or FSDP_EXT_SHARED_MEMORY=0); check ",
              "supports_tensor_alloc() first");
  const caffe2::TypeMeta dtype = options.dtype();
  const size_t bytes = static_cast<size_t>(size) * dtype.itemsize();
  void* data = nullptr;
  try {
    data = pool_->allocate(bytes);
  } catch (const comm::CommError& error) {
    C10_THROW_ERROR(DistBackendError, l.prefix() + error.what());
  }
  // The tensor's deleter returns the buffer to the pool. Ops hold their
  // tensors until they finish, so a buffer freed by Python while an op uses
  // it only returns once the op is done; the pool itself lives as long as
  // any of its tensors, even past the group's destruction.
  std::shared_ptr<comm::SharedBufferPool> pool = pool_;
  return at::from_blob(
      data, {static_cast<int64_t>(size)},
      [pool](void* buffer) {
        try {
          pool->release(buffer);
        } catch (const std::exception&) {
          // Not reachable for buffers from allocate(); never throw from a deleter.
        }
      },
      options.device(at::kCPU));
}

size_t FsdpExtBackend::mapped_peer_segments() const {
  return shared_memory_ ? shared_memory_->mapped_peer_segments() : 0;
}

}  // namespace fsdp_ext::backend
