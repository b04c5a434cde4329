// Device memory shared as a file descriptor: made with the driver's virtual
// memory management calls (cuMemCreate, requesting a POSIX file descriptor
// handle), exported once with cuMemExportToShareableHandle, and mapped by
// peers with cuMemImportFromShareableHandle + cuMemMap.
//
// The second way, beside legacy IPC handles (ipc_memory.h), for the group's
// own buffers to be read in place: some virtual machines and sandboxes refuse
// cudaIpcOpenMemHandle yet pass file descriptors (comm/descriptor_sharing.h
// carries them between the processes). torch's own allocations are not made
// this way, so only the group's buffers can use it.
//
// The driver calls are looked up in libcuda.so.1 (dlopen/dlsym), which torch
// has loaded already: the extension does not link libcuda, and depends on no
// runtime call newer than the oldest CUDA torch builds with (each call used
// here has one ABI version since CUDA 11.2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "comm/unique_fd.h"

namespace fsdp_ext::device {

// Whether `device` can make memory shared as file descriptors; `why_not`
// says why not (the driver lacks the calls, the device the feature).
bool descriptor_memory_supported(int device, std::string* why_not);

// The size a descriptor allocation of at least `bytes` takes on `device`
// (whole units of the device's allocation granularity, 2 MiB on current
// GPUs). Throws CommError (kDevice).
size_t descriptor_allocation_size(int device, size_t bytes);

// Memory of this process that peers can map: created, mapped read-write for
// its device, and exported as a file descriptor (owned here, offered to
// peers by a DescriptorServer). Unmaps and releases on destruction; peers
// that mapped it keep the physical memory alive until they unmap.
class DescriptorAllocation {
 public:
  // Throws CommError (kDevice) naming the call that failed. Where the
  // device has no room and `out_of_memory` is given, sets it instead and
  // stays invalid (valid() false), so that the pool can make room and try
  // again.
  DescriptorAllocation(int device, size_t bytes, bool* out_of_memory = nullptr);
  ~DescriptorAllocation();
  DescriptorAllocation(const DescriptorAllocation&) = delete;
  DescriptorAllocation& operator=(const DescriptorAllocation&) = delete;

  bool valid() const { return data_ != 0; }
  void* data() const { return reinterpret_cast<void*>(data_); }
  size_t bytes() const { return bytes_; }
  // The exported file descriptor, handed to the caller (once: later calls
  // get an invalid one). The memory does not need it.
  comm::UniqueFd take_descriptor() { return std::move(descriptor_); }

 private:
  uint64_t handle_ = 0;  // CUmemGenericAllocationHandle
  uintptr_t data_ = 0;   // CUdeviceptr
  size_t bytes_ = 0;
  comm::UniqueFd descriptor_;
};

// A peer's DescriptorAllocation of `bytes`, mapped into this process for
// `device` from the descriptor its server handed over (the caller still
// owns and closes it). Unmaps on destruction.
class DescriptorMapping {
 public:
  DescriptorMapping(int descriptor, size_t bytes, int device);
  ~DescriptorMapping();
  DescriptorMapping(const DescriptorMapping&) = delete;
  DescriptorMapping& operator=(const DescriptorMapping&) = delete;

  void* data() const { return reinterpret_cast<void*>(data_); }

 private:
  uintptr_t data_ = 0;
  size_t bytes_ = 0;
};

}  // namespace fsdp_ext::device
