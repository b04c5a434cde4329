// The IPC route of a group's CUDA path (cuda_path.hpp): ranks of one host
// read each other's device buffers in place.
//
// One op, on every rank (Note [an IPC event is waited on after the host hears
// it was recorded], device/ipc_event.h):
//   1. the group's stream waits for the caller's current stream; `ready` is
//      recorded on it (this rank's buffers are ready for its peers);
//   2. host exchange: the IPC handle and offset of each buffer peers read;
//   3. the stream waits for every peer's `ready`; copies and kernels read the
//      peers' buffers (the all-reduce has a second phase, after `mid`);
//   4. `done` recorded; host exchange (every rank has recorded it); the
//      stream waits for every peer's `done`, so the op ends only when no
//      peer still reads this rank's buffers. The Work is that end.
// A rank whose buffer has no handle its peers can open says so in step 2,
// and every rank stages that op instead.
//
// Note [a failure between host rounds]: a rank that fails after a round (a
// peer's buffer it cannot open, a CUDA call that errs) must not leave its
// peers waiting in the next round until the op's timeout. Every round after
// the handles' carries an ok byte and a reason; a failing rank enqueues
// nothing more and goes on to that round, and after it every rank has the
// same records, so all raise the first failure (naming its rank) together.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda_collectives.hpp"
#include "device/ipc_event.h"
#include "device/ipc_memory.h"

namespace fsdp_ext::backend {

class CudaPath;

class IpcRoute {
 public:
  // Collective: creates this rank's events, opens the peers', and checks
  // that a peer's device memory can be opened. Returns nullptr on every rank
  // if any rank cannot, with `why_not` naming the rank and the failure.
  // `handles` is FSDP_EXT_CUDA_IPC_HANDLES: auto tries legacy IPC handles,
  // then file descriptors; legacy or descriptors tries that one only.
  static std::unique_ptr<IpcRoute> try_create(CudaPath& path, const OpLabel& label,
                                              const std::string& handles,
                                              std::chrono::milliseconds timeout,
                                              std::string* why_not);

  WorkPtr run(const OpLabel& label, CudaOp& op);
  // Peers' buffers opened so far (each allocation of a peer once).
  uint64_t peer_buffers_opened() const { return peer_memory_.opens(); }
  // How buffers are shared, for the group's log line.
  std::string describe_sharing() const;

 private:
  explicit IpcRoute(CudaPath& path) : path_(path) {}

  // Collective: every rank exports a buffer of the group's own shared by
  // `kind` and opens its peers'. "" (and sharing_ set) when every rank
  // could; otherwise the first failure, as "rank R: reason", on every rank.
  std::string probe_sharing(const OpLabel& label, device::IpcKind kind,
                            std::chrono::milliseconds timeout);

  // Step 2: this rank's shared buffers exported and exchanged with their
  // sizes and dtypes; false (on every rank) when some rank's buffer has no
  // handle. Raises on every rank when a rank's `failure_here` came in set
  // (a CUDA call before the round failed), or when the ranks' tensors differ
  // in number, size or dtype: no rank then reads past a peer's buffer. A
  // peer's buffer this rank cannot open sets `failure_here` (Note [a failure
  // between host rounds]). `read_from` >= 0: peers read only that rank's
  // buffers (a broadcast's root), the others are neither exported nor opened.
  bool exchange_buffers(const OpLabel& label, const std::vector<at::Tensor>& shared,
                        int read_from, std::chrono::milliseconds timeout,
                        std::vector<std::vector<void*>>* peer_pointers,
                        std::string* failure_here);
  // A host round in which every rank says it recorded `event` (or why it
  // failed: then every rank raises DistBackendError); then the stream waits
  // for each peer's record of it. Returns why that wait could not be
  // enqueued ("" when it was), for the next round to carry.
  std::string all_recorded(const OpLabel& label, device::SharedEvent& event,
                    const std::vector<std::unique_ptr<device::PeerEvent>>& peers,
                    std::chrono::milliseconds timeout, std::string failure_here);

  CudaPath& path_;
  std::unique_ptr<device::SharedEvent> ready_, mid_, done_;
  std::vector<std::unique_ptr<device::PeerEvent>> peer_ready_, peer_mid_, peer_done_;
  device::PeerMemoryMap peer_memory_;
  // Legacy handles: every buffer, torch's too. Descriptors: the group's own
  // buffers only (torch's memory is staged); legacy_refusal_ says why.
  device::IpcKind sharing_ = device::IpcKind::kLegacy;
  std::string legacy_refusal_;
};

}  // namespace fsdp_ext::backend
