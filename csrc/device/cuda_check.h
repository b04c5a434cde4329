// CUDA runtime calls of the device room, checked: a failure becomes a
// comm::CommError (kDevice) naming the call and CUDA's own message, which the
// backend raises as DistBackendError with the op, group and rank.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "comm/error.h"

namespace fsdp_ext::device {

inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    // Clear the error so that it does not surface again at the next call.
    cudaGetLastError();
    throw comm::CommError(comm::ErrorKind::kDevice, std::string(what) + " failed: " +
                                                        cudaGetErrorName(status) + " (" +
                                                        cudaGetErrorString(status) + ")");
  }
}

// Makes `device` current on this thread for the scope, restoring the previous
// one after (CUDA calls act on the thread's current device).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace fsdp_ext::device
