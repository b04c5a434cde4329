#include "comm/shared_memory_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "comm/error.h"

namespace fsdp_ext::comm {
namespace {

[[noreturn]] void fail(const std::string& what, int error) {
  throw CommError(ErrorKind::kTransport, what + ": " + std::strerror(error));
}

void* map_shared(int fd, size_t bytes) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return data == MAP_FAILED ? nullptr : data;
}

}  // namespace

size_t round_up_to_pages(size_t bytes) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t nonzero = bytes == 0 ? 1 : bytes;
  return (nonzero + page - 1) / page * page;
}

SharedMemorySegment SharedMemorySegment::create(size_t bytes, const char* name) {
  SharedMemorySegment segment;
  segment.bytes_ = round_up_to_pages(bytes);
  segment.fd_ = memfd_create(name, MFD_CLOEXEC);
  if (segment.fd_ < 0) fail("memfd_create", errno);
  if (ftruncate(segment.fd_, static_cast<off_t>(segment.bytes_)) != 0) {
    fail("ftruncate of a " + std::to_string(segment.bytes_) + "-byte shared segment", errno);
  }
  segment.data_ = map_shared(segment.fd_, segment.bytes_);
  if (!segment.data_) fail("mmap of a " + std::to_string(segment.bytes_) + "-byte shared segment", errno);
  return segment;
}

SharedMemorySegment SharedMemorySegment::open_peer(pid_t owner_pid, int owner_fd, size_t bytes) {
  const std::string path =
      "/proc/" + std::to_string(owner_pid) + "/fd/" + std::to_string(owner_fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) fail("opening a peer's shared segment " + path, errno);
  SharedMemorySegment segment;
  segment.bytes_ = bytes;
  segment.data_ = map_shared(fd, bytes);
  const int saved = errno;
  close(fd);
  if (!segment.data_) fail("mapping a peer's shared segment " + path, saved);
  return segment;
}

SharedMemorySegment::~SharedMemorySegment() { release(); }

SharedMemorySegment::SharedMemorySegment(SharedMemorySegment&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      fd_(std::exchange(other.fd_, -1)) {}

SharedMemorySegment& SharedMemorySegment::operator=(SharedMemorySegment&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

void SharedMemorySegment::release() {
  if (data_) munmap(data_, bytes_);
  if (fd_ >= 0) close(fd_);
  data_ = nullptr;
  fd_ = -1;
  bytes_ = 0;
}

}  // namespace fsdp_ext::comm
