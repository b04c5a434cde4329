// One shared-memory mapping, owned RAII-style (the fd and the mapping are
// released in the destructor, once).
//
// Segments are memfd files: nothing is named in /dev/shm, so a crashed rank
// cannot leak one, and the memory is gone once the last process unmaps it.
// A peer on the same host maps the owner's segment by opening
// /proc/<owner pid>/fd/<fd> (same uid; the owner keeps the fd open for the
// segment's lifetime).
#pragma once

#include <sys/types.h>

#include <cstddef>

namespace fsdp_ext::comm {

class SharedMemorySegment {
 public:
  SharedMemorySegment() = default;
  // A fresh zero-filled segment of at least `bytes` (rounded up to pages).
  static SharedMemorySegment create(size_t bytes, const char* name);
  // Maps a segment that process `owner_pid` created and holds as `owner_fd`.
  // The fd this opens is closed at once; the mapping keeps the file alive.
  static SharedMemorySegment open_peer(pid_t owner_pid, int owner_fd, size_t bytes);

  ~SharedMemorySegment();
  SharedMemorySegment(SharedMemorySegment&& other) noexcept;
  SharedMemorySegment& operator=(SharedMemorySegment&& other) noexcept;
  SharedMemorySegment(const SharedMemorySegment&) = delete;
  SharedMemorySegment& operator=(const SharedMemorySegment&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  int fd() const { return fd_; }  // -1 for a peer's segment
  explicit operator bool() const { return data_ != nullptr; }

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  int fd_ = -1;
};

size_t round_up_to_pages(size_t bytes);

}  // namespace fsdp_ext::comm
