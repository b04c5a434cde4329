#include "device/ipc_memory.h"

#include <cstring>

#include "device/cuda_check.h"

namespace fsdp_ext::device {

std::optional<IpcBuffer> export_buffer(void* allocation_base, void* data) {
  IpcBuffer buffer{};
  if (cudaIpcGetMemHandle(&buffer.handle, allocation_base) != cudaSuccess) {
    cudaGetLastError();  // not an error of the op: the caller stages instead
    return std::nullopt;
  }
  buffer.offset = static_cast<uint64_t>(static_cast<char*>(data) -
                                        static_cast<char*>(allocation_base));
  return buffer;
}

PeerMemoryMap::~PeerMemoryMap() {
  for (auto& [key, entry] : opened_) cudaIpcCloseMemHandle(entry.base);
}

PeerMemoryMap::Key PeerMemoryMap::key_of(int peer, const IpcBuffer& buffer) {
  Key key{peer, {}};
  std::memcpy(key.second.data(), &buffer.handle, sizeof(buffer.handle));
  return key;
}

bool PeerMemoryMap::find(int peer, const IpcBuffer& buffer) const {
  return opened_.count(key_of(peer, buffer)) != 0;
}

void* PeerMemoryMap::base_of(int peer, const IpcBuffer& buffer) {
  const Key key = key_of(peer, buffer);
  auto found = opened_.find(key);
  if (found != opened_.end()) {
    lru_.splice(lru_.begin(), lru_, found->second.age);
    found->second.last_op = op_;
    return found->second.base;
  }
  void* base = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&base, buffer.handle, cudaIpcMemLazyEnablePeerAccess),
             "cudaIpcOpenMemHandle (a peer's buffer)");
  ++opens_;
  lru_.push_front(key);
  opened_.emplace(key, Entry{base, lru_.begin(), op_});
  return base;
}

bool PeerMemoryMap::oldest_is_from_an_earlier_op() const {
  // lru_ is in order of use: if its last entry is the current op's, all are.
  return !lru_.empty() && opened_.at(lru_.back()).last_op != op_;
}

void PeerMemoryMap::evict_oldest() {
  if (lru_.empty()) return;
  const Key key = lru_.back();
  lru_.pop_back();
  auto found = opened_.find(key);
  cudaIpcCloseMemHandle(found->second.base);
  opened_.erase(found);
}

}  // namespace fsdp_ext::device
