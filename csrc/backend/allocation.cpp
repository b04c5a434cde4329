// Tensors allocated from the group: memory from the shared buffer pool (CPU)
// or the group's device buffers (CUDA), which peers on the same host read in
// place.
#include "backend/fsdp_ext_backend.hpp"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <string>

namespace fsdp_ext::backend {

bool FsdpExtBackend::supportsTensorAlloc(c10::DeviceIndex device_index) {
  // c10d passes only the device index: CPU's is -1 (as is a CUDA device
  // given without one; FSDP gives its mesh's, with the index).
  if (device_index < 0) return shared_memory_enabled();
  return why_no_cuda_buffers(device_index).empty();
}

std::string FsdpExtBackend::why_no_cuda_buffers(int device) const {
  // Offered where peers read the buffers in place: on the IPC route, so
  // only once the group's first CUDA op has chosen it (ranks with GPUs of
  // their own take NCCL, which neither reads them in place nor tells the
  // pool which stream it used them on: a buffer could be handed out again
  // while NCCL still reads it), or up front where FSDP_EXT_CUDA_PATH=ipc
  // names it.
  if (!cuda_path_built()) return "this build of torch_fsdp_ext has no CUDA path";
  // (A CUDA build runs on machines without a GPU too.)
  const int devices = cuda_device_count();
  if (device >= devices) {
    return "this machine has " + std::to_string(devices) + " CUDA device" +
           (devices == 1 ? "" : "s") + ", no cuda:" + std::to_string(device);
  }
  if (!shared_memory_enabled()) {
    return "its ranks do not share memory (several hosts, or FSDP_EXT_SHARED_MEMORY=0)";
  }
  if (cuda_choice_.path == "nccl" || cuda_choice_.path == "staged") {
    return "FSDP_EXT_CUDA_PATH=" + cuda_choice_.path;
  }
  std::lock_guard<std::mutex> lock(cuda_mutex_);
  if (!cuda_) {
    if (cuda_choice_.path == "ipc") return "";
    return "its route for CUDA tensors is not chosen yet (its first CUDA op chooses it; "
           "FSDP_EXT_CUDA_PATH=ipc chooses the one that reads buffers in place up front)";
  }
  if (cuda_device_ != device) {
    return "its CUDA ops run on cuda:" + std::to_string(cuda_device_);
  }
  return cuda_->reads_in_place() ? "" : "its CUDA route is " + cuda_->describe();
}

at::Tensor FsdpExtBackend::allocateTensor(long size, at::TensorOptions options) {
  const OpLabel l = label("allocate_tensor");
  TORCH_CHECK_VALUE(size >= 0, l.prefix(), "size must be >= 0, got ", size);
  if (options.has_device() && options.device().is_cuda()) {
    TORCH_CHECK_NOT_IMPLEMENTED(cuda_path_built(), l.prefix(),
                                "got a CUDA device, but this build of torch_fsdp_ext has no CUDA "
                                "path (built without a CUDA compiler, against a CPU build of "
                                "torch, or with FSDP_EXT_CUDA=OFF)");
    // A device without an index is the current one (0 on a machine
    // without a GPU, which why_no_cuda_buffers names).
    const int device = options.device().has_index() ? options.device().index()
                       : cuda_device_count() > 0    ? cuda_current_device()
                                                    : 0;
    const std::string why_not = why_no_cuda_buffers(device);
    TORCH_CHECK(why_not.empty(), l.prefix(), "this group does not hand out buffers on cuda:",
                device, ": ", why_not, "; check supports_tensor_alloc() first");
    return cuda_buffers(l, device)->allocate(l, size, options);
  }
  if (options.has_device() && !options.device().is_cpu()) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, l.prefix(),
                                cuda_path_built() ? "only CPU and CUDA tensors" : "only CPU tensors",
                                " can be allocated from this group, not ", options.device().str());
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

std::shared_ptr<CudaBuffers> FsdpExtBackend::cuda_buffers(const OpLabel& label, int device) {
  std::lock_guard<std::mutex> lock(cuda_buffers_mutex_);
  if (!cuda_buffers_) {
    cuda_buffers_ = make_cuda_buffers(label, device, cuda_choice_);
  } else {
    TORCH_CHECK_VALUE(device < 0 || device == cuda_buffers_->device(), label.prefix(),
                      "buffers on cuda:", device, ", but this group's device buffers are on cuda:",
                      cuda_buffers_->device(), "; a rank uses one device per group "
                      "(torch.cuda.set_device)");
  }
  return cuda_buffers_;
}

CudaBuffers::Stats FsdpExtBackend::cuda_buffer_stats() const {
  std::lock_guard<std::mutex> lock(cuda_buffers_mutex_);
  return cuda_buffers_ ? cuda_buffers_->stats() : CudaBuffers::Stats{};
}

CudaPathCounters FsdpExtBackend::cuda_path_counters() const {
  std::lock_guard<std::mutex> lock(cuda_mutex_);
  return cuda_ ? cuda_->counters() : CudaPathCounters{};
}

size_t FsdpExtBackend::mapped_peer_segments() const {
  return shared_memory_ ? shared_memory_->mapped_peer_segments() : 0;
}

}  // namespace fsdp_ext::backend
