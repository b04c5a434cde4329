#include "backend/cuda/cuda_path.hpp"

#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <cuda_runtime_api.h>

#include <array>
#include <chrono>
#include <cstring>
#include <set>
#include <thread>

#include "backend/cuda/cuda_buffers.hpp"
#include "backend/cuda/ipc_route.hpp"
#include "backend/fsdp_ext_backend.hpp"
#include "backend/peer_identity.hpp"
#include "device/cuda_check.h"
#include "device/reduce_kernels.h"

namespace fsdp_ext::backend {
namespace {

// What each rank says of itself at the first CUDA op: fixed-size, so the
// host exchange can gather it.
struct CudaIdentity {
  std::array<char, 160> host{};  // this_host(): hostname, boot id, PID namespace
  std::array<char, 16> gpu{};    // the GPU's UUID
  std::array<char, 8> choice{};        // FSDP_EXT_CUDA_PATH
  std::array<char, 12> ipc_handles{};  // FSDP_EXT_CUDA_IPC_HANDLES
  int32_t device = -1;
  // Why this rank cannot make the path (empty: it can). Carried by the
  // exchange so that every rank raises it together; a rank that raised
  // before the exchange would leave its peers waiting for the timeout.
  std::array<char, 384> failure{};
};

template <size_t N>
void copy_text(std::array<char, N>& out, const std::string& text) {
  std::strncpy(out.data(), text.c_str(), N - 1);
}

template <size_t N>
std::string text_of(const std::array<char, N>& text) {
  return std::string(text.data(), strnlen(text.data(), text.size()));
}

}  // namespace

CudaPath::CudaPath(FsdpExtBackend& group, const OpLabel& label, int device,
                   const CudaChoice& chosen, const NcclFactory& nccl_factory)
    : group_(group),
      group_label_(label.group),
      rank_(label.rank),
      size_(label.size),
      device_(device),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true,
                                           static_cast<c10::DeviceIndex>(device))) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const std::chrono::milliseconds timeout = group.default_timeout();
  const std::string& choice = chosen.path;
  CudaIdentity mine;
  copy_text(mine.host, this_host());
  copy_text(mine.choice, choice);
  copy_text(mine.ipc_handles, chosen.ipc_handles);
  mine.device = device;
  try {
    // In a build with this path every CudaBuffers is a GroupCudaBuffers
    // (make_cuda_buffers, cuda_buffers.cpp); made here if no allocation
    // came first, as the IPC route's probe takes its buffer from it. (It
    // refuses a device other than the one earlier allocations used.)
    buffers_ = std::static_pointer_cast<GroupCudaBuffers>(group.cuda_buffers(label, device));
    cudaDeviceProp properties{};
    device::check_cuda(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");
    std::memcpy(mine.gpu.data(), &properties.uuid, sizeof(mine.gpu));
  } catch (const c10::Error& error) {
    copy_text(mine.failure, error.what_without_backtrace());
  } catch (const std::exception& error) {
    copy_text(mine.failure, error.what());
  }
  std::vector<uint8_t> record(sizeof(mine));
  std::memcpy(record.data(), &mine, sizeof(mine));
  std::vector<CudaIdentity> ranks(size_);
  const auto records = group.exchange_bytes(label, record, timeout);
  for (int r = 0; r < size_; ++r) std::memcpy(&ranks[r], records[r].data(), sizeof(CudaIdentity));
  for (int r = 0; r < size_; ++r) {
    const std::string failure = text_of(ranks[r].failure);
    TORCH_CHECK(failure.empty(), label.prefix(), "rank ", r,
                " could not set up its CUDA path, so no rank does: ", failure);
  }

  // Every rank decides from the same records, so all take the same route.
  std::set<std::string> hosts;
  std::set<std::pair<std::string, std::string>> gpus;
  int shared_with = -1;  // a rank whose GPU an earlier rank also uses
  for (int r = 0; r < size_; ++r) {
    TORCH_CHECK_VALUE(text_of(ranks[r].choice) == choice, label.prefix(),
                      "FSDP_EXT_CUDA_PATH is '", choice, "' here but '", text_of(ranks[r].choice),
                      "' on rank ", r, "; every rank must choose the same");
    TORCH_CHECK_VALUE(text_of(ranks[r].ipc_handles) == chosen.ipc_handles, label.prefix(),
                      "FSDP_EXT_CUDA_IPC_HANDLES is '", chosen.ipc_handles, "' here but '",
                      text_of(ranks[r].ipc_handles), "' on rank ", r,
                      "; every rank must choose the same");
    const std::string host = text_of(ranks[r].host);
    hosts.insert(host);
    const bool fresh = gpus.insert({host, std::string(ranks[r].gpu.data(), 16)}).second;
    if (!fresh && shared_with < 0) shared_with = r;
  }
  const bool one_host = hosts.size() == 1;
  const bool own_gpus = shared_with < 0;
  const std::string layout = std::to_string(size_) + (size_ == 1 ? " rank" : " ranks") + " on " +
                             std::to_string(hosts.size()) +
                             (hosts.size() == 1 ? " host" : " hosts") + ", " +
                             std::to_string(gpus.size()) + (gpus.size() == 1 ? " GPU" : " GPUs");

  const auto use_nccl = [&] {
    TORCH_CHECK_VALUE(static_cast<bool>(nccl_factory), label.prefix(),
                      "torch's NCCL is not available here (torch.distributed.is_nccl_available())");
    nccl_ = nccl_factory();
    route_ = Route::kNccl;
    description_ = "nccl (" + layout + ": torch's ProcessGroupNCCL over the same ranks)";
  };
  const auto try_ipc = [&](std::string* why_not) {
    if (!one_host) {
      *why_not = "the ranks are on " + std::to_string(hosts.size()) + " hosts";
    } else if (size_ > device::kMaxReduceInputs) {
      *why_not = "more than " + std::to_string(device::kMaxReduceInputs) + " ranks on one host";
    } else {
      ipc_ = IpcRoute::try_create(*this, label, chosen.ipc_handles, timeout, why_not);
    }
    if (ipc_) {
      route_ = Route::kIpc;
      description_ = "ipc (" + layout + ": peers' buffers read in place through CUDA IPC, " +
                     ipc_->describe_sharing() + ")";
    }
    return static_cast<bool>(ipc_);
  };
  const auto use_staged = [&](const std::string& why) {
    route_ = Route::kStaged;
    description_ = "staged through host memory (" + layout + "; " + why + ")";
  };

  if (choice == "nccl") {
    TORCH_CHECK_VALUE(own_gpus, label.prefix(), "FSDP_EXT_CUDA_PATH=nccl, but rank ", shared_with,
                      " shares its GPU with another rank, which NCCL refuses");
    use_nccl();
  } else if (choice == "ipc") {
    std::string why_not;
    TORCH_CHECK_VALUE(try_ipc(&why_not), label.prefix(),
                      "FSDP_EXT_CUDA_PATH=ipc, but CUDA IPC cannot be used: ", why_not);
  } else if (choice == "staged") {
    use_staged("FSDP_EXT_CUDA_PATH=staged");
  } else if (own_gpus && nccl_factory) {
    use_nccl();
  } else {
    std::string why_not;
    if (!try_ipc(&why_not)) {
      use_staged(own_gpus ? "no NCCL in this torch, and CUDA IPC: " + why_not
                          : "ranks share GPUs; CUDA IPC: " + why_not +
                                (one_host ? "" : " (IPC within hosts with NCCL between them "
                                                 "is not implemented yet)"));
    }
  }
}

// Note [a group's stream that does not drain]
// Work the group's stream still has queued reads peers' mappings and waits
// on shared events, which the routes close and destroy when the path goes:
// the stream must finish first (Work.wait() orders streams, it does not wait
// for them). It may never finish: a peer that died with an op on the GPU
// never records the event this stream waits for. An unbounded synchronize
// would then hang the group's destruction (and the process's exit) instead
// of the op's error ending the job; so the wait has a deadline, after which
// the mappings, events and the group's buffers are left to the process's
// exit (closing them, or cudaFree, would wait for the same stream).
constexpr std::chrono::seconds kTeardownDrain{10};

namespace {
// Whether `stream` finished its work within `limit` (also true where the
// device failed or the runtime is going away at exit: nothing more to wait
// for then).
bool drains_within(const c10::cuda::CUDAStream& stream, std::chrono::seconds limit) noexcept {
  try {
    c10::cuda::CUDAGuard guard(stream.device_index());
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
      const cudaError_t status = cudaStreamQuery(stream.stream());
      if (status == cudaSuccess) return true;
      cudaGetLastError();  // not sticky: not ready yet, or the device failed
      if (status != cudaErrorNotReady) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  } catch (const std::exception&) {
    cudaGetLastError();
    return true;
  }
}
}  // namespace

CudaPath::~CudaPath() {
  if (drains_within(stream_, kTeardownDrain)) return;
  LOG(WARNING) << "fsdp_ext (group " << group_label_ << ", rank " << rank_ << "/" << size_
               << "): the group's CUDA stream has not finished its work "
               << kTeardownDrain.count()
               << " s after the group's end (waiting for a peer that is gone?); its peer "
                  "mappings, events and buffers are left to the process's exit";
  static_cast<void>(ipc_.release());
  if (buffers_) buffers_->abandon_memory();
}

void CudaPath::shutdown() {
  if (nccl_) nccl_->shutdown();
}

void CudaPath::follow_current_stream() const {
  const c10::cuda::CUDAStream current =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
  if (current == stream_) return;
  c10::cuda::CUDAEvent ready;
  ready.record(current);
  ready.block(stream_);
}

void CudaPath::record_stream(const CudaOp& op) const {
  for (const auto* tensors : {&op.inputs, &op.outputs}) {
    for (const at::Tensor& tensor : *tensors) {
      if (!tensor.defined() || !tensor.is_cuda()) continue;
      // (torch's allocator ignores memory it did not allocate, so the
      // group's buffers need their own record.)
      if (!buffers_->record_use(tensor, stream_)) {
        c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream_);
      }
    }
  }
}

CudaPathCounters CudaPath::counters() const {
  CudaPathCounters counters;
  counters.staged_ops = staged_ops_.load();
  counters.peer_buffers_opened = ipc_ ? ipc_->peer_buffers_opened() : 0;
  return counters;
}

WorkPtr CudaPath::run(const OpLabel& label, CudaOp op) {
  try {
    switch (route_) {
      case Route::kNccl:
        return op.on_nccl(*nccl_);
      case Route::kIpc:
        if (op.kind != CudaOp::Kind::kOther) return ipc_->run(label, op);
        return run_staged(label, op);
      case Route::kStaged:
        return run_staged(label, op);
    }
  } catch (const comm::CommError& error) {
    C10_THROW_ERROR(DistBackendError, label.prefix() + error.what());
  }
  TORCH_INTERNAL_ASSERT(false, "unknown CUDA route");
  return nullptr;
}

std::shared_ptr<CudaCollectives> make_cuda_collectives(FsdpExtBackend& group,
                                                       const OpLabel& label, int device,
                                                       const CudaChoice& choice,
                                                       const NcclFactory& nccl_factory) {
  try {
    return std::make_shared<CudaPath>(group, label, device, choice, nccl_factory);
  } catch (const comm::CommError& error) {
    C10_THROW_ERROR(DistBackendError, label.prefix() + error.what());
  }
}

}  // namespace fsdp_ext::backend
