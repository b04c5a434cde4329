#include "device/ipc_memory.h"

#include <chrono>
#include <cstring>

#include "comm/descriptor_sharing.h"
#include "device/cuda_check.h"

namespace fsdp_ext::device {
namespace {

// A peer's server answers at once from its own thread whatever that peer
// is doing; longer than this, and it is gone or stuck.
constexpr std::chrono::milliseconds kFetchTimeout{10000};

std::atomic<bool> legacy_refused_for_tests{false};

}  // namespace

void refuse_legacy_handles_for_tests(bool refuse) { legacy_refused_for_tests = refuse; }

bool legacy_handles_refused_for_tests() { return legacy_refused_for_tests.load(); }

std::optional<IpcBuffer> export_buffer(void* allocation_base, void* data) {
  if (legacy_handles_refused_for_tests()) return std::nullopt;
  IpcBuffer buffer{};
  if (cudaIpcGetMemHandle(&buffer.handle, allocation_base) != cudaSuccess) {
    cudaGetLastError();  // not an error of the op: the caller stages instead
    return std::nullopt;
  }
  buffer.kind = IpcKind::kLegacy;
  buffer.offset = static_cast<uint64_t>(static_cast<char*>(data) -
                                        static_cast<char*>(allocation_base));
  return buffer;
}

PeerMemoryMap::~PeerMemoryMap() {
  for (auto& [key, entry] : opened_) close(entry);
}

PeerMemoryMap::Key PeerMemoryMap::key_of(int peer, const IpcBuffer& buffer) {
  Key key{peer, buffer.kind, {}, 0};
  if (buffer.kind == IpcKind::kLegacy) {
    std::memcpy(std::get<2>(key).data(), &buffer.handle, sizeof(buffer.handle));
  } else {
    std::get<3>(key) = buffer.allocation_id;
  }
  return key;
}

bool PeerMemoryMap::find(int peer, const IpcBuffer& buffer) const {
  return opened_.count(key_of(peer, buffer)) != 0;
}

std::unique_ptr<DescriptorMapping> PeerMemoryMap::open_descriptor(int peer,
                                                                  const IpcBuffer& buffer) const {
  const std::string address =
      peer < static_cast<int>(descriptor_servers_.size()) ? descriptor_servers_[peer] : "";
  if (address.empty()) {
    throw comm::CommError(comm::ErrorKind::kDevice,
                          "rank " + std::to_string(peer) +
                              " shared a buffer as a file descriptor but has no descriptor server");
  }
  int device = -1;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const comm::UniqueFd descriptor =
      comm::fetch_descriptor(address, buffer.allocation_id, kFetchTimeout);
  return std::make_unique<DescriptorMapping>(descriptor.get(), buffer.allocation_bytes, device);
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
  std::unique_ptr<DescriptorMapping> mapping;
  if (buffer.kind == IpcKind::kDescriptor) {
    mapping = open_descriptor(peer, buffer);
    base = mapping->data();
  } else {
    check_cuda(cudaIpcOpenMemHandle(&base, buffer.handle, cudaIpcMemLazyEnablePeerAccess),
               "cudaIpcOpenMemHandle (a peer's buffer)");
  }
  ++opens_;
  lru_.push_front(key);
  opened_.emplace(key, Entry{base, std::move(mapping), lru_.begin(), op_});
  return base;
}

void PeerMemoryMap::close(Entry& entry) {
  if (entry.mapping) {
    entry.mapping.reset();
  } else {
    cudaIpcCloseMemHandle(entry.base);
  }
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
  close(found->second);
  opened_.erase(found);
}

}  // namespace fsdp_ext::device
