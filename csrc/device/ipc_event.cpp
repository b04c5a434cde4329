#include "device/ipc_event.h"

#include "device/cuda_check.h"

namespace fsdp_ext::device {

SharedEvent::SharedEvent() {
  check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming | cudaEventInterprocess),
             "cudaEventCreateWithFlags (interprocess)");
  const cudaError_t status = cudaIpcGetEventHandle(&handle_, event_);
  if (status != cudaSuccess) {
    cudaEventDestroy(event_);
    check_cuda(status, "cudaIpcGetEventHandle");
  }
}

SharedEvent::~SharedEvent() {
  if (event_) cudaEventDestroy(event_);
}

void SharedEvent::record(cudaStream_t stream) {
  check_cuda(cudaEventRecord(event_, stream), "cudaEventRecord (shared event)");
}

PeerEvent::PeerEvent(const cudaIpcEventHandle_t& handle) {
  check_cuda(cudaIpcOpenEventHandle(&event_, handle), "cudaIpcOpenEventHandle (a peer's event)");
}

PeerEvent::~PeerEvent() {
  if (event_) cudaEventDestroy(event_);
}

void PeerEvent::wait(cudaStream_t stream) const {
  check_cuda(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent (a peer's event)");
}

}  // namespace fsdp_ext::device
