#include "comm/shared_memory_domain.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "comm/error.h"

namespace fsdp_ext::comm {
namespace {
constexpr size_t kInitialStagingBytes = 64 << 10;
}  // namespace

SharedMemoryDomain::SharedMemoryDomain(std::shared_ptr<SharedBufferPool> pool)
    : pool_(std::move(pool)) {
  for (StagingSlot& slot : staging_) {
    slot.id = pool_->next_segment_id();
    slot.memory = SharedMemorySegment::create(kInitialStagingBytes, "fsdp_ext-staging");
  }
}

void SharedMemoryDomain::enable(std::vector<pid_t> peer_pids, bool process_reads) {
  peer_pids_ = std::move(peer_pids);
  process_reads_ = process_reads;
  enabled_.store(true, std::memory_order_release);
}

char* SharedMemoryDomain::staging(int slot, size_t bytes) {
  StagingSlot& staging = staging_[slot];
  if (staging.memory.bytes() < bytes) {
    // Grow geometrically so a growing workload remaps only a few times. The
    // old segment can go now: peers only map it during an op that names it,
    // and every such op has finished.
    const size_t grown = std::max(bytes, staging.memory.bytes() * 2);
    staging.memory = SharedMemorySegment::create(grown, "fsdp_ext-staging");
    staging.id = pool_->next_segment_id();
  }
  return static_cast<char*>(staging.memory.data());
}

std::optional<SharedPiece> SharedMemoryDomain::locate(const void* data, size_t bytes) const {
  const char* address = static_cast<const char*>(data);
  for (const StagingSlot& slot : staging_) {
    const char* base = static_cast<const char*>(slot.memory.data());
    if (address >= base && address + bytes <= base + slot.memory.bytes()) {
      return SharedPiece{slot.id, slot.memory.bytes(), static_cast<uint64_t>(address - base),
                         bytes, slot.memory.fd(), static_cast<uint32_t>(&slot - staging_) + 1};
    }
  }
  if (std::optional<SharedLocation> location = pool_->locate(data, bytes)) {
    return SharedPiece{location->segment_id, location->segment_bytes, location->offset, bytes,
                       location->fd, 0};
  }
  return std::nullopt;
}

const char* SharedMemoryDomain::map_peer(int peer, const SharedPiece& piece) {
  return map_peer_with_pid(peer, peer_pids_.at(peer), piece);
}

const char* SharedMemoryDomain::map_peer_with_pid(int peer, pid_t pid, const SharedPiece& piece) {
  if (piece.offset + piece.bytes > piece.segment_bytes || piece.staging_slot > kStagingSlots) {
    // `peer` is a position among this host's ranks, not a group rank: name
    // the process, which the message's reader can match.
    throw CommError(ErrorKind::kTransport, "the peer process with pid " + std::to_string(pid) +
                                               " described a shared piece outside its memory");
  }
  const SharedMemorySegment* segment = nullptr;
  if (piece.staging_slot > 0) {
    PeerStaging& staging = peer_staging_[{peer, piece.staging_slot}];
    if (!staging.memory || staging.id != piece.segment_id) {
      staging.memory = SharedMemorySegment::open_peer(pid, piece.fd, piece.segment_bytes);
      staging.id = piece.segment_id;
    }
    segment = &staging.memory;
  } else {
    auto it = peer_buffers_.find({peer, piece.segment_id});
    if (it == peer_buffers_.end()) {
      it = peer_buffers_
               .emplace(std::make_pair(peer, piece.segment_id),
                        SharedMemorySegment::open_peer(pid, piece.fd, piece.segment_bytes))
               .first;
    }
    segment = &it->second;
  }
  mapped_count_.store(peer_buffers_.size() + peer_staging_.size(), std::memory_order_relaxed);
  return static_cast<const char*>(segment->data()) + piece.offset;
}

SharedPiece SharedMemoryDomain::probe_piece() {
  const StagingSlot& slot = staging_[0];
  return SharedPiece{slot.id, slot.memory.bytes(), 0, 0, slot.memory.fd(), 1};
}

void SharedMemoryDomain::probe_peer(int peer, pid_t peer_pid, const SharedPiece& piece) {
  map_peer_with_pid(peer, peer_pid, piece);
}


void SharedMemoryDomain::read_process_memory(pid_t pid, uint64_t address, void* destination,
                                             size_t bytes) {
  char* out = static_cast<char*>(destination);
  size_t done = 0;
  while (done < bytes) {
    // One call may copy less than asked (it stops at page or size limits).
    iovec local{out + done, bytes - done};
    iovec remote{reinterpret_cast<void*>(address + done), bytes - done};
    const ssize_t copied = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (copied <= 0) {
      throw CommError(ErrorKind::kTransport,
                      "process_vm_readv of " + std::to_string(bytes) + " bytes from pid " +
                          std::to_string(pid) + " failed: " +
                          (copied < 0 ? std::strerror(errno) : "no progress"));
    }
    done += static_cast<size_t>(copied);
  }
}

void SharedMemoryDomain::copy_from_peer(int peer, const SharedPiece& piece, void* destination) {
  if (piece.bytes == 0) return;
  if (piece.in_process_memory) {
    read_process_memory(peer_pids_.at(peer), piece.process_address, destination, piece.bytes);
  } else {
    std::memcpy(destination, map_peer(peer, piece), piece.bytes);
  }
}

}  // namespace fsdp_ext::comm
