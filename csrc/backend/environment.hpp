// The backend's tuning variables: every FSDP_EXT_* variable is named, read
// and checked here, at group creation, so a misspelt name or value is a
// clear ValueError from init_process_group / new_group instead of a setting
// that silently does nothing. The table in README.md lists them.
//
//   FSDP_EXT_SPIN_US            progress-thread spin before sleeping (µs, default 100)
//   FSDP_EXT_WAIT_SPIN_US       Work.wait() polling before sleeping (µs, default 1000;
//                               see Note [how long a wait polls])
//   FSDP_EXT_SHARED_MEMORY      0: UCX messages only, no allocation from the group
//   FSDP_EXT_PROCESS_READS      0: never process_vm_readv a peer; stage instead
//   FSDP_EXT_SMALL_OPS          0: small collectives go through the engine and UCX
//                               too, not the small-op channel
//   FSDP_EXT_CUDA_PATH          auto, ipc, nccl or staged: how CUDA tensors move
//                               (backend/cuda/cuda_path.hpp; auto decides per group)
//   FSDP_EXT_CUDA_IPC_HANDLES   auto, legacy or descriptors: how the ipc route
//                               shares the group's buffers (ipc_route.hpp)
//   FSDP_EXT_{ALLGATHER,REDUCE_SCATTER,ALLREDUCE,BROADCAST}_ALGO
//                               auto, direct, ring or shm (comm/algorithm_selection.h;
//                               read per op there, so tests can switch them)
#pragma once

#include <chrono>
#include <string>

namespace fsdp_ext::backend {

struct BackendEnvironment {
  std::chrono::microseconds spin{100};
  bool shared_memory = true;
  bool process_reads = true;
  bool small_ops = true;
  std::string cuda_path = "auto";
  std::string cuda_ipc_handles = "auto";
};

// Reads and validates every FSDP_EXT_* variable; throws c10::ValueError
// naming the variable, its value and what is accepted. `where` prefixes the
// message (the op label of the group's init).
BackendEnvironment read_environment(const std::string& where);

// FSDP_EXT_WAIT_SPIN_US (validated by read_environment before any Work).
std::chrono::microseconds wait_spin_from_environment();

}  // namespace fsdp_ext::backend
