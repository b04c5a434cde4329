#include "device/descriptor_memory.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include "comm/error.h"
#include "device/cuda_check.h"

namespace fsdp_ext::device {
namespace {

// The driver calls this file makes, resolved once through the runtime.
struct DriverCalls {
  decltype(&cuGetErrorName) get_error_name = nullptr;
  decltype(&cuDeviceGet) device_get = nullptr;
  decltype(&cuDeviceGetAttribute) device_get_attribute = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  // What the driver lacks (nullptr when everything resolved): a literal, so
  // that the static below has nothing to destroy at exit, when destructors
  // that still use it may run.
  const char* missing = nullptr;
};

template <typename Function>
void resolve(void* library, const char* symbol, Function* function, const char** missing) {
  void* address = library != nullptr ? dlsym(library, symbol) : nullptr;
  if (address == nullptr) {
    if (*missing == nullptr) *missing = symbol;
    return;
  }
  *function = reinterpret_cast<Function>(address);
}

const DriverCalls& driver() {
  static const DriverCalls calls = [] {
    DriverCalls c;
    // Loaded already (torch's CUDA runtime loads the driver): this takes a
    // reference, never closed, as the driver stays for the process's life.
    void* libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (libcuda == nullptr) {
      c.missing = "loadable libcuda.so.1";
      return c;
    }
#define FSDP_EXT_RESOLVE(symbol, member) resolve(libcuda, #symbol, &c.member, &c.missing)
    FSDP_EXT_RESOLVE(cuGetErrorName, get_error_name);
    FSDP_EXT_RESOLVE(cuDeviceGet, device_get);
    FSDP_EXT_RESOLVE(cuDeviceGetAttribute, device_get_attribute);
    FSDP_EXT_RESOLVE(cuMemGetAllocationGranularity, granularity);
    FSDP_EXT_RESOLVE(cuMemCreate, create);
    FSDP_EXT_RESOLVE(cuMemRelease, release);
    FSDP_EXT_RESOLVE(cuMemAddressReserve, reserve);
    FSDP_EXT_RESOLVE(cuMemAddressFree, address_free);
    FSDP_EXT_RESOLVE(cuMemMap, map);
    FSDP_EXT_RESOLVE(cuMemUnmap, unmap);
    FSDP_EXT_RESOLVE(cuMemSetAccess, set_access);
    FSDP_EXT_RESOLVE(cuMemExportToShareableHandle, export_handle);
    FSDP_EXT_RESOLVE(cuMemImportFromShareableHandle, import_handle);
#undef FSDP_EXT_RESOLVE
    return c;
  }();
  return calls;
}

const DriverCalls& checked_driver() {
  const DriverCalls& calls = driver();
  if (calls.missing != nullptr) {
    throw comm::CommError(comm::ErrorKind::kDevice,
                          std::string("the CUDA driver has no ") + calls.missing +
                              " (file-descriptor sharing of device memory needs CUDA 11.2 or later)");
  }
  return calls;
}

void check_driver(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* name = nullptr;
  if (driver().get_error_name == nullptr || driver().get_error_name(result, &name) != CUDA_SUCCESS) {
    name = "an unknown CUresult";
  }
  throw comm::CommError(comm::ErrorKind::kDevice, std::string(what) + " failed: " + name +
                                                      " (" + std::to_string(result) + ")");
}

CUmemAllocationProp properties_for(int device) {
  CUmemAllocationProp properties{};
  properties.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  properties.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  properties.location.id = device;
  properties.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return properties;
}

// Read-write access to [data, data + bytes) for `device`.
void allow_access(const DriverCalls& calls, CUdeviceptr data, size_t bytes, int device) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check_driver(calls.set_access(data, bytes, &access, 1), "cuMemSetAccess");
}

// `handle`'s memory (`bytes`, the whole allocation) mapped at a fresh
// address, read-write for `device`; on failure, nothing is left reserved or
// mapped (the handle stays the caller's). `whose` ends the calls' names in
// errors.
CUdeviceptr map_whole(const DriverCalls& calls, CUmemGenericAllocationHandle handle,
                      size_t bytes, int device, const std::string& whose) {
  CUdeviceptr data = 0;
  check_driver(calls.reserve(&data, bytes, 0, 0, 0), ("cuMemAddressReserve" + whose).c_str());
  try {
    check_driver(calls.map(data, bytes, 0, handle, 0), ("cuMemMap" + whose).c_str());
    try {
      allow_access(calls, data, bytes, device);
    } catch (...) {
      calls.unmap(data, bytes);
      throw;
    }
  } catch (...) {
    calls.address_free(data, bytes);
    throw;
  }
  return data;
}

// Undoes map_whole.
void unmap_whole(const DriverCalls& calls, uintptr_t data, size_t bytes) {
  calls.unmap(static_cast<CUdeviceptr>(data), bytes);
  calls.address_free(static_cast<CUdeviceptr>(data), bytes);
}

// The driver calls act on the thread's current context: any runtime call
// makes the current device's primary context current (creating it on first
// use); cudaFree(nullptr) is the one that does nothing else.
void make_context_current() {
  check_cuda(cudaFree(nullptr), "cudaFree(nullptr) (initialising the device's context)");
}

}  // namespace

bool descriptor_memory_supported(int device, std::string* why_not) {
  const DriverCalls& calls = driver();
  if (calls.missing != nullptr) {
    *why_not = std::string("the CUDA driver has no ") + calls.missing;
    return false;
  }
  try {
    DeviceScope scope(device);
    make_context_current();
    CUdevice handle = 0;
    check_driver(calls.device_get(&handle, device), "cuDeviceGet");
    int vmm = 0, descriptors = 0;
    check_driver(calls.device_get_attribute(
                     &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, handle),
                 "cuDeviceGetAttribute (virtual memory management)");
    check_driver(calls.device_get_attribute(
                     &descriptors, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                     handle),
                 "cuDeviceGetAttribute (file-descriptor handles)");
    if (!vmm) *why_not = "cuda:" + std::to_string(device) + " has no virtual memory management";
    if (vmm && !descriptors) {
      *why_not = "cuda:" + std::to_string(device) + " cannot export memory as file descriptors";
    }
    return vmm && descriptors;
  } catch (const comm::CommError& error) {
    *why_not = error.what();
    return false;
  }
}

size_t descriptor_allocation_size(int device, size_t bytes) {
  const DriverCalls& calls = checked_driver();
  DeviceScope scope(device);
  make_context_current();
  const CUmemAllocationProp properties = properties_for(device);
  size_t granularity = 0;
  check_driver(calls.granularity(&granularity, &properties, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
               "cuMemGetAllocationGranularity");
  if (granularity == 0) granularity = 2 << 20;
  const size_t units = (bytes + granularity - 1) / granularity;
  return (units == 0 ? 1 : units) * granularity;
}

DescriptorAllocation::DescriptorAllocation(int device, size_t bytes, bool* out_of_memory) {
  const DriverCalls& calls = checked_driver();
  bytes_ = descriptor_allocation_size(device, bytes);
  DeviceScope scope(device);
  make_context_current();
  const CUmemAllocationProp properties = properties_for(device);
  CUmemGenericAllocationHandle handle = 0;
  const CUresult created = calls.create(&handle, bytes_, &properties, 0);
  if (created == CUDA_ERROR_OUT_OF_MEMORY && out_of_memory != nullptr) {
    *out_of_memory = true;
    return;
  }
  check_driver(created, "cuMemCreate (a buffer of the group, shared as a file descriptor)");
  // From here on a throw leaves a partly built object, whose destructor
  // does not run: undo by hand.
  try {
    const CUdeviceptr data = map_whole(calls, handle, bytes_, device, "");
    try {
      int fd = -1;
      check_driver(calls.export_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                   "cuMemExportToShareableHandle (as a file descriptor)");
      descriptor_ = comm::UniqueFd(fd);
    } catch (...) {
      unmap_whole(calls, data, bytes_);
      throw;
    }
    data_ = static_cast<uintptr_t>(data);
  } catch (...) {
    calls.release(handle);
    throw;
  }
  handle_ = handle;
}

DescriptorAllocation::~DescriptorAllocation() {
  if (handle_ == 0) return;
  const DriverCalls& calls = driver();
  unmap_whole(calls, data_, bytes_);
  calls.release(static_cast<CUmemGenericAllocationHandle>(handle_));
}

DescriptorMapping::DescriptorMapping(int descriptor, size_t bytes, int device) : bytes_(bytes) {
  const DriverCalls& calls = checked_driver();
  DeviceScope scope(device);
  make_context_current();
  CUmemGenericAllocationHandle handle = 0;
  // The descriptor travels as the pointer-sized value of the handle argument.
  check_driver(calls.import_handle(&handle,
                                   reinterpret_cast<void*>(static_cast<uintptr_t>(descriptor)),
                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
               "cuMemImportFromShareableHandle (a peer's buffer)");
  CUdeviceptr data = 0;
  try {
    data = map_whole(calls, handle, bytes_, device, " (a peer's buffer)");
  } catch (...) {
    calls.release(handle);
    throw;
  }
  // The mapping holds the memory from here; the imported handle is not needed.
  calls.release(handle);
  data_ = static_cast<uintptr_t>(data);
}

DescriptorMapping::~DescriptorMapping() {
  if (data_ != 0) unmap_whole(driver(), data_, bytes_);
}

}  // namespace fsdp_ext::device
