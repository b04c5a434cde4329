// CUDA events shared between the processes of a host: the ordering of one
// rank's stream against another's without the host waiting.
//
// Note [an IPC event is waited on after the host hears it was recorded]
// cudaStreamWaitEvent waits for the most recent record of the event at the
// time of the call. So a rank records its event, then tells its peers through
// the host transport; only then do they enqueue their waits. And it records
// the event again (next op) only after every peer has said it enqueued its
// wait (the host exchange that follows in the protocol), so no wait ever sees
// a later record than the one it was meant for.
#pragma once

#include <cuda_runtime_api.h>

namespace fsdp_ext::device {

// An event this process records and peers wait on.
class SharedEvent {
 public:
  SharedEvent();
  ~SharedEvent();
  SharedEvent(const SharedEvent&) = delete;
  SharedEvent& operator=(const SharedEvent&) = delete;

  void record(cudaStream_t stream);
  cudaIpcEventHandle_t handle() const { return handle_; }

 private:
  cudaEvent_t event_ = nullptr;
  cudaIpcEventHandle_t handle_{};
};

// A peer's SharedEvent, opened in this process.
class PeerEvent {
 public:
  explicit PeerEvent(const cudaIpcEventHandle_t& handle);
  ~PeerEvent();
  PeerEvent(const PeerEvent&) = delete;
  PeerEvent& operator=(const PeerEvent&) = delete;

  // `stream` waits for the peer's latest record (Note above).
  void wait(cudaStream_t stream) const;

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace fsdp_ext::device
