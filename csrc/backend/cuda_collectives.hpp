// Where the backend sends an op on CUDA tensors: the group's CUDA path.
//
// The entry points (fsdp_ext_backend.cpp) find an op's device; for CUDA they
// describe the op as a CudaOp and hand it to the group's CudaCollectives, made
// at the group's first CUDA op. Its implementation, and everything CUDA,
// lives in backend/cuda/ (with the torch-free device room, csrc/device), built
// only when CMake finds CUDA (cmake/cuda.cmake); a build without it has
// cuda_unavailable.cpp instead, which refuses CUDA tensors with a clear
// NotImplementedError.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/op_label.hpp"
#include "comm/reduce_spec.h"

namespace fsdp_ext::backend {

class FsdpExtBackend;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// Makes torch's own NCCL process group over this group's ranks and store
// (torch_fsdp_ext/_registration.py passes it; empty without NCCL).
using NcclFactory = std::function<c10::intrusive_ptr<c10d::Backend>()>;

// One op on CUDA tensors, as every route needs it.
struct CudaOp {
  enum class Kind {
    kAllgather,      // inputs[i] gathered into outputs[i] (world_size x input), i < n
    kReduceScatter,  // inputs[i] (world_size x output) reduced into outputs[i]
    kAllreduce,      // inputs[i] reduced in place (outputs == inputs)
    kBroadcast,      // inputs[0] from `root`, in place
    kOther,          // any other op: staged through host memory, or NCCL
  };
  Kind kind = Kind::kOther;
  std::vector<at::Tensor> inputs;   // device tensors the op reads
  std::vector<at::Tensor> outputs;  // device tensors it writes (may be inputs)
  comm::ReduceSpec spec;            // kReduceScatter, kAllreduce
  int root = 0;                     // kBroadcast
  std::chrono::milliseconds timeout{0};
  // The same op on host tensors in place of `inputs` and `outputs` (same
  // order; a tensor both read and written is one host tensor): the staged
  // route runs it between its copies.
  std::function<WorkPtr(std::vector<at::Tensor>& host_inputs,
                        std::vector<at::Tensor>& host_outputs)>
      on_host;
  // The same op on torch's NCCL group (the NCCL route).
  std::function<WorkPtr(c10d::Backend& nccl)> on_nccl;
};

// Where a group's CUDA ops took their data (tests check that buffers from
// the group move in place).
struct CudaPathCounters {
  uint64_t staged_ops = 0;           // ops staged through host memory
  uint64_t peer_buffers_opened = 0;  // peers' IPC handles opened (each once)
};

class CudaCollectives {
 public:
  virtual ~CudaCollectives() = default;
  // Runs `op` (its tensors on this path's device), returning a Work whose
  // wait() makes the caller's current stream wait for it.
  virtual WorkPtr run(const OpLabel& label, CudaOp op) = 0;
  // Which route this group's CUDA ops take and why, for the log and tests.
  virtual std::string describe() const = 0;
  // Whether send/recv run on this route: only NCCL's for now (a staged send
  // would hold the host until its receiver posts, and IPC has no pairwise
  // protocol yet).
  virtual bool runs_point_to_point() const { return false; }
  // Whether peers read this rank's device buffers in place (the IPC
  // route): where the group's own device buffers are worth offering.
  virtual bool reads_in_place() const { return false; }
  virtual CudaPathCounters counters() const { return {}; }
  // The group shuts down (torch's NCCL group with it).
  virtual void shutdown() {}
};

// Device memory the group hands out (allocate_tensor on CUDA tensors), on
// one device: buffers its peers open once and read in place, with or without
// torch's expandable segments (backend/cuda/cuda_buffers.hpp). Tensors hold
// their memory's pool: it outlives the group while any of them lives.
class CudaBuffers {
 public:
  struct Stats {
    size_t buffers = 0;         // made so far, in use or free
    size_t in_use = 0;          // handed out and not yet freed
    size_t reserved_bytes = 0;  // device memory the buffers hold
    size_t allocations = 0;     // tensors handed out so far
    size_t reuses = 0;          // of which from a freed buffer
    size_t exported = 0;        // buffers peers can open (an IPC handle or a descriptor)
  };
  virtual ~CudaBuffers() = default;
  // A 1-D tensor of `numel` elements of `options`' dtype, on this pool's
  // device, for work on the current stream.
  virtual at::Tensor allocate(const OpLabel& label, int64_t numel,
                              const at::TensorOptions& options) = 0;
  virtual int device() const = 0;
  virtual Stats stats() const = 0;
};

// What the user chose for the CUDA path (every rank must choose the same).
struct CudaChoice {
  std::string path = "auto";         // FSDP_EXT_CUDA_PATH: auto, ipc, nccl, staged
  std::string ipc_handles = "auto";  // FSDP_EXT_CUDA_IPC_HANDLES: auto, legacy, descriptors
};

// Whether this build has the CUDA path (false: cuda_unavailable.cpp).
bool cuda_path_built();
// The CUDA devices the runtime sees (0 without a GPU or without the CUDA
// path), and the current one. Asked of the CUDA runtime, not of c10's device
// guard: on a machine without a GPU, entering a FakeTensorMode (torch.compile,
// DTensor, FSDP's memory tools) replaces the CUDA guard by a fake one that
// reports eight devices.
int cuda_device_count();
int cuda_current_device();
// Tests only: this process behaves as if legacy CUDA IPC handles were refused
// (machines that refuse them are where the route falls back to file
// descriptors; this runs that fallback on any GPU).
void refuse_legacy_ipc_for_tests(bool refuse);
// Tests only: the next op this process stages through host memory fails in
// its staging (as where pinned memory runs out), once.
void fail_next_staging_for_tests();
// The group's device buffers on `device` (-1: the current device), shared
// as file descriptors from the first (FSDP_EXT_CUDA_IPC_HANDLES=descriptors)
// or as `choice` and the IPC route decide. A build without CUDA throws
// NotImplementedError naming the op.
std::shared_ptr<CudaBuffers> make_cuda_buffers(const OpLabel& label, int device,
                                               const CudaChoice& choice);

// The CUDA path of `group` for tensors on `device`, set up collectively (every
// rank calls it at the same op). A build without CUDA throws
// NotImplementedError naming the op.
std::shared_ptr<CudaCollectives> make_cuda_collectives(FsdpExtBackend& group,
                                                       const OpLabel& label, int device,
                                                       const CudaChoice& choice,
                                                       const NcclFactory& nccl_factory);

}  // namespace fsdp_ext::backend
