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
  if (abandoned_ || cudaGetDevice(&previous) != cudaSuccess) {
    // Left to the process's exit, which takes all device memory back.
    for (auto& [base, buffer] : buffers_) static_cast<void>(buffer.shared_memory.release());
    return;
  }
  cudaSetDevice(device_);
  free_ = StreamOrderedReuse<ReleaseFence>();  // its events first
  for (auto& [base, buffer] : buffers_) {
    if (buffer.shared_memory) {
      buffer.shared_memory.reset();
    } else {
      cudaFree(reinterpret_cast<void*>(base));
    }
  }
  cudaSetDevice(previous);
  cudaGetLastError();
}

void* DeviceBufferPool::make_buffer(size_t size_class) {
  Buffer buffer;
  buffer.size_class = size_class;
  void* data = server_ ? make_descriptor_buffer(size_class, &buffer)
                       : make_legacy_buffer(size_class, &buffer);
  if (data != nullptr) buffers_.emplace(reinterpret_cast<uintptr_t>(data), std::move(buffer));
  return data;
}

// Note [legacy IPC shares whole blocks]
// The runtime may carve a small cudaMalloc out of a larger block, and a
// legacy IPC handle then stands for that whole block (the CUDA programming
// guide's IPC section, which advises sharing only 2 MiB-aligned sizes): a
// peer may be given the block's other allocations too, and what the open
// returns for an allocation inside a block is not documented. So every
// legacy buffer is an allocation of its own, a whole number of 2 MiB
// (torch's segments are too); the size class is what is handed out of it.
constexpr size_t kLegacyAllocationUnit = size_t{2} << 20;

void* DeviceBufferPool::make_legacy_buffer(size_t size_class, Buffer* buffer) {
  void* data = nullptr;
  const size_t bytes =
      (size_class + kLegacyAllocationUnit - 1) / kLegacyAllocationUnit * kLegacyAllocationUnit;
  const cudaError_t status = cudaMalloc(&data, bytes);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: allocate() makes room and tries again
    return nullptr;
  }
  check_cuda(status, "cudaMalloc (a buffer of the group)");
  cudaIpcMemHandle_t handle;
  if (legacy_handles_refused_for_tests()) {
    // as where this machine refuses IPC (below)
  } else if (cudaIpcGetMemHandle(&handle, data) == cudaSuccess) {
    buffer->handle = handle;
    ++exported_;
  } else {
    cudaGetLastError();  // this machine refuses IPC: ops on the buffer are staged
  }
  reserved_bytes_ += bytes;
  return data;
}

void* DeviceBufferPool::make_descriptor_buffer(size_t size_class, Buffer* buffer) {
  bool out_of_memory = false;
  auto memory = std::make_unique<DescriptorAllocation>(device_, size_class, &out_of_memory);
  if (out_of_memory) return nullptr;
  void* data = memory->data();
  // Offered under its base address: unique among the pool's buffers, which
  // live as long as the pool. The server keeps its own duplicate; the
  // export's descriptor is closed here (one per buffer, not two).
  const comm::UniqueFd exported = memory->take_descriptor();
  server_->offer(reinterpret_cast<uintptr_t>(data), exported.get());
  reserved_bytes_ += memory->bytes();  // whole units of the device's granularity
  buffer->shared_memory = std::move(memory);
  ++exported_;
  return data;
}

void DeviceBufferPool::share_by_descriptors() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (server_) return;
  std::string why_not;
  if (!descriptor_memory_supported(device_, &why_not)) {
    throw comm::CommError(comm::ErrorKind::kDevice,
                          "device memory cannot be shared as file descriptors: " + why_not);
  }
  server_ = std::make_unique<comm::DescriptorServer>();
  for (auto& [base, buffer] : buffers_) {
    if (buffer.handle) --exported_;
    buffer.handle.reset();
  }
  // The free legacy buffers leave the free list for good (the route's legacy
  // probe buffer is one: handed out again, it would stage the ops on it);
  // release() keeps those in use out of it.
  free_.take_all();
}

void DeviceBufferPool::abandon_memory() {
  std::lock_guard<std::mutex> lock(mutex_);
  abandoned_ = true;
}

std::string DeviceBufferPool::descriptor_address() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return server_ ? server_->address() : std::string();
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
  if (server_ && !buffer.shared_memory) return;  // a legacy buffer after the switch to descriptors
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
  IpcBuffer buffer{};
  if (found.shared_memory) {
    buffer.kind = IpcKind::kDescriptor;
    buffer.allocation_id = base;
    buffer.allocation_bytes = found.shared_memory->bytes();
  } else if (found.handle) {
    buffer.kind = IpcKind::kLegacy;
    buffer.handle = *found.handle;
  } else {
    return std::nullopt;
  }
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
