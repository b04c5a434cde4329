// A group's CUDA path: how its ops on CUDA tensors move data, decided once,
// collectively, at the group's first CUDA op (FSDP_EXT_CUDA_PATH=auto), and
// said in the group's log line.
//
//   nccl    every rank has a GPU of its own (on one host or several): torch's
//           own ProcessGroupNCCL over the same ranks and store, made inside
//           ours -- NCCL's speed, watchdog and flight recorder.
//   ipc     ranks of one host that share GPUs or see each other's (NCCL
//           refuses two ranks on one GPU): each rank reads its peers' buffers
//           in place through CUDA IPC, copies by the copy engine, reductions
//           by the device room's kernels, ordering by IPC events; the host
//           only exchanges handles through the group's CPU transport
//           (ipc_route.cpp). Buffers are shared by legacy IPC handles, or
//           where peers cannot open those (FSDP_EXT_CUDA_IPC_HANDLES=auto
//           tries both), the group's own buffers as file descriptors.
//   staged  anywhere else, and wherever IPC does not work (some virtual
//           machines; memory without a legacy IPC handle): device -> pinned
//           host memory -> this group's CPU collective -> device
//           (staged_route.cpp). Correct everywhere, slower, and the host waits
//           for the device's copies.
//
// Hosts whose ranks share GPUs across several hosts (IPC within a host and
// NCCL between them) are staged for now; the log line says so.
#pragma once

#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda_collectives.hpp"

namespace fsdp_ext::backend {

class IpcRoute;
class GroupCudaBuffers;

class CudaPath final : public CudaCollectives {
 public:
  CudaPath(FsdpExtBackend& group, const OpLabel& label, int device, const CudaChoice& choice,
           const NcclFactory& nccl_factory);
  ~CudaPath() override;

  WorkPtr run(const OpLabel& label, CudaOp op) override;
  std::string describe() const override { return description_; }
  bool runs_point_to_point() const override { return route_ == Route::kNccl; }
  bool reads_in_place() const override { return route_ == Route::kIpc; }
  CudaPathCounters counters() const override;
  void shutdown() override;

  // The staged route (staged_route.cpp), also where the IPC route cannot
  // export a buffer.
  WorkPtr run_staged(const OpLabel& label, CudaOp& op);

  FsdpExtBackend& group() { return group_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  const c10::cuda::CUDAStream& stream() const { return stream_; }
  // The group's stream waits for what the caller's current stream has
  // enqueued so far (the op's inputs are ready there).
  void follow_current_stream() const;
  // The allocator keeps the op's tensors' memory for the group's stream's
  // work, even if the caller frees them before waiting: torch's caching
  // allocator, or the group's own buffers.
  void record_stream(const CudaOp& op) const;
  // The group's device buffers (allocate_tensor), which the IPC route
  // exports by their own handles.
  GroupCudaBuffers& buffers() const { return *buffers_; }

 private:
  enum class Route { kNccl, kIpc, kStaged };

  FsdpExtBackend& group_;
  std::string group_label_;  // for the log: "'0' (default_pg)"
  int rank_;
  int size_;
  int device_;
  c10::cuda::CUDAStream stream_;
  Route route_ = Route::kStaged;
  std::string description_;
  c10::intrusive_ptr<c10d::Backend> nccl_;
  std::unique_ptr<IpcRoute> ipc_;
  std::shared_ptr<GroupCudaBuffers> buffers_;
  std::atomic<uint64_t> staged_ops_{0};
};

}  // namespace fsdp_ext::backend
