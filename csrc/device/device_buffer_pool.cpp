#include "device/device_buffer_pool.h"

#include <new>
#include <string>

#include "device/buffer_ranges.h"
#include "device/cuda_check.h"

namespace fsdp_ext::device {

ReleaseFence::ReleaseFence(cudaStream_t stream) {
  check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
  const cudaError_t recorded = cudaEventRecord(event_, stream);
  if (recorded != cudaSuccess) {
    cudaEventDestroy(event_);
    event_ = nullptr;
    check_cuda(recorded, "cudaEventRecord (a buffer's release)");
  }
}

ReleaseFence::~ReleaseFence() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

bool ReleaseFence::passed() {
  if (passed_) return true;
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) {
    cudaGetLastError();  // not an error: the stream has not got there yet
    return false;
  }
  // Passed, or the device failed (sticky errors end every later call as
  // well; the op that caused it reports it).
  if (status != cudaSuccess) cudaGetLastError();
  passed_ = true;
  return true;
}

void ReleaseFence::wait() {
  if (passed_) return;
  if (cudaEventSynchronize(event_) != cudaSuccess) cudaGetLastError();
  passed_ = true;
}

DeviceBufferPool::DeviceBufferPool(int device, std::function<void()> release_cached)
    : device_(device), release_cached_(std::move(release_cached)) {}

DeviceBufferPool::~DeviceBufferPool() {
  // Only once no tensor holds a buffer (each holds the pool) and the group,
  // whose peers may have opened them, is gone. At interpreter exit the CUDA
  // runtime may be unloaded already: its errors are of no use here.
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  cudaSetDevice(device_);
  free_ = StreamOrderedReuse<ReleaseFence>();  // its events first
  for (auto& [base, buffer] : buffers_) cudaFree(reinterpret_cast<void*>(base));
  cudaSetDevice(previous);
  cudaGetLastError();
}

void* DeviceBufferPool::make_buffer(size_t size_class) {
  void* data = nullptr;
  const cudaError_t status = cudaMalloc(&data, size_class);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: allocate() makes room and tries again
    return nullptr;
  }
  check_cuda(status, "cudaMalloc (a buffer of the group)");
  Buffer buffer;
  buffer.size_class = size_class;
  cudaIpcMemHandle_t handle;
  if (cudaIpcGetMemHandle(&handle, data) == cudaSuccess) {
    buffer.handle = handle;
    ++exported_;
  } else {
    cudaGetLastError();  // this machine refuses IPC: ops on the buffer are staged
  }
  reserved_bytes_ += size_class;
  buffers_.emplace(reinterpret_cast<uintptr_t>(data), std::move(buffer));
  return data;
}

void* DeviceBufferPool::allocate(size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return nullptr;
  const size_t size_class = device_size_class(bytes);
  const auto stream_id = reinterpret_cast<StreamId>(stream);
  DeviceScope scope(device_);
  std::lock_guard<std::mutex> lock(mutex_);
  void* data = free_.take(size_class, stream_id);
  if (data != nullptr) {
    ++reuses_;
  } else {
    data = make_buffer(size_class);
  }
  if (data == nullptr) {
    // Note [a full device]: what the device cannot give may be held by this
    // pool's free buffers still fenced by pending work (wait for it, then
    // take one of the class), or cached by torch's allocator (let it go).
    free_.wait_all();
    if ((data = free_.take(size_class, stream_id)) != nullptr) {
      ++reuses_;
    } else {
      if (release_cached_) release_cached_();
      data = make_buffer(size_class);
    }
  }
  if (data == nullptr) {
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    cudaGetLastError();
    throw comm::CommError(
        comm::ErrorKind::kDevice,
        "out of device memory for a buffer of " + std::to_string(size_class) + " bytes on cuda:" +
            std::to_string(device_) + " (the device has " + std::to_string(free_bytes) + " of " +
            std::to_string(total_bytes) + " bytes free; this group's buffers hold " +
            std::to_string(reserved_bytes_) + " bytes in " + std::to_string(buffers_.size()) +
            ", " + std::to_string(in_use_) + " of them in use)");
  }
  ++allocations_;
  Buffer& buffer = buffers_.at(reinterpret_cast<uintptr_t>(data));
  buffer.in_use = true;
  buffer.streams.assign(1, stream_id);
  ++in_use_;
  return data;
}

uintptr_t DeviceBufferPool::base_of(const void* data, size_t bytes) const {
  return base_holding(buffers_, reinterpret_cast<uintptr_t>(data), bytes,
                      [](const Buffer& buffer) { return buffer.size_class; });
}

bool DeviceBufferPool::record_use(const void* data, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uintptr_t base = base_of(data, 0);
  if (base == 0) return false;
  Buffer& buffer = buffers_.at(base);
  const auto id = reinterpret_cast<StreamId>(stream);
  // A tensor's storage holds its buffer, and the caller holds the tensor:
  // a free buffer here would be a use after free, and has no streams to add.
  if (!buffer.in_use) return true;
  for (StreamId known : buffer.streams) {
    if (known == id) return true;
  }
  buffer.streams.push_back(id);
  return true;
}

void DeviceBufferPool::release(void* data) noexcept {
  if (data == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = buffers_.find(reinterpret_cast<uintptr_t>(data));
  if (it == buffers_.end() || !it->second.in_use) return;  // not from allocate()
  Buffer& buffer = it->second;
  buffer.in_use = false;
  --in_use_;
  std::vector<StreamOrderedReuse<ReleaseFence>::Fenced> fences;
  try {
    DeviceScope scope(device_);
    for (StreamId stream : buffer.streams) {
      fences.push_back({stream, ReleaseFence(reinterpret_cast<cudaStream_t>(stream))});
    }
  } catch (const std::exception&) {
    // No fence could be recorded (the device failed, or the runtime is
    // going away at exit): the buffer is never handed out again rather
    // than handed out early.
    return;
  }
  try {
    free_.put(data, buffer.size_class, std::move(fences));
  } catch (const std::bad_alloc&) {
    // No memory for the free list's entry: the buffer stays out of use.
  }
}

std::optional<IpcBuffer> DeviceBufferPool::locate(const void* data, size_t bytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const uintptr_t base = base_of(data, bytes);
  if (base == 0) return std::nullopt;
  const Buffer& found = buffers_.at(base);
  if (!found.handle) return std::nullopt;
  IpcBuffer buffer{};
  buffer.handle = *found.handle;
  buffer.offset = reinterpret_cast<uintptr_t>(data) - base;
  return buffer;
}

DeviceBufferStats DeviceBufferPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceBufferStats stats;
  stats.buffers = buffers_.size();
  stats.in_use = in_use_;
  stats.reserved_bytes = reserved_bytes_;
  stats.allocations = allocations_;
  stats.reuses = reuses_;
  stats.exported = exported_;
  return stats;
}

}  // namespace fsdp_ext::device
