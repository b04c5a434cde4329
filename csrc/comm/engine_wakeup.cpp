#include "comm/engine_wakeup.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "comm/error.h"

namespace fsdp_ext::comm {
namespace {

// epoll data: which fd fired; a watched peer's fd carries kWatchedBase plus
// its index in watched_.
constexpr uint64_t kWorkerFd = 1;
constexpr uint64_t kSubmitFd = 2;
constexpr uint64_t kAbortFd = 3;
constexpr uint64_t kWatchedBase = uint64_t{1} << 32;  // | index into watched_

[[noreturn]] void throw_errno(const char* call) {
  throw CommError(ErrorKind::kTransport, std::string(call) + " failed: " + std::strerror(errno));
}

UniqueFd make_event_fd() {
  UniqueFd fd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!fd.valid()) throw_errno("eventfd");
  return fd;
}

UniqueFd make_epoll() {
  UniqueFd fd(epoll_create1(EPOLL_CLOEXEC));
  if (!fd.valid()) throw_errno("epoll_create1");
  return fd;
}

void add_to_epoll(const UniqueFd& epoll, int fd, uint64_t data) {
  epoll_event event{};
  event.events = EPOLLIN | EPOLLRDHUP;
  event.data.u64 = data;
  if (epoll_ctl(epoll.get(), EPOLL_CTL_ADD, fd, &event) != 0) throw_errno("epoll_ctl");
}

void remove_from_epoll(const UniqueFd& epoll, int fd) {
  epoll_ctl(epoll.get(), EPOLL_CTL_DEL, fd, nullptr);
}

void signal(const UniqueFd& fd) {
  const uint64_t one = 1;
  ssize_t ignored = write(fd.get(), &one, sizeof(one));
  (void)ignored;
}

}  // namespace

EngineWakeup::EngineWakeup(int worker_fd)
    : submit_event_(make_event_fd()),
      abort_event_(make_event_fd()),
      idle_epoll_(make_epoll()),
      busy_epoll_(make_epoll()) {
  add_to_epoll(idle_epoll_, worker_fd, kWorkerFd);
  add_to_epoll(idle_epoll_, submit_event_.get(), kSubmitFd);
  add_to_epoll(idle_epoll_, abort_event_.get(), kAbortFd);
  add_to_epoll(busy_epoll_, worker_fd, kWorkerFd);
  add_to_epoll(busy_epoll_, abort_event_.get(), kAbortFd);
}

void EngineWakeup::notify_submitted() { signal(submit_event_); }
void EngineWakeup::notify_abort() { signal(abort_event_); }

void EngineWakeup::watch(int rank, int fd, UniqueFd owned, const char* how) {
  const uint64_t data = kWatchedBase | watched_.size();
  add_to_epoll(idle_epoll_, fd, data);
  add_to_epoll(busy_epoll_, fd, data);
  watched_.push_back(Watched{rank, fd, std::move(owned), how});
}

bool EngineWakeup::watch_process(int rank, int pid) {
#ifdef SYS_pidfd_open
  UniqueFd pidfd(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));
  if (!pidfd.valid()) return false;
  const int fd = pidfd.get();
  watch(rank, fd, std::move(pidfd), "exited (its process is gone)");
  return true;
#else
  return false;
#endif
}

void EngineWakeup::watch_socket(int rank, int socket) {
  // The peer never writes to it: readable means closed (the process
  // exited) or reset / timed out (the host or link is gone).
  watch(rank, socket, UniqueFd(),
        "is gone (its liveness connection closed: the process exited, or its host or link "
        "stopped answering)");
}

void EngineWakeup::sleep(Clock::time_point until, bool wake_on_submit) {
  const auto remaining = std::max(until - Clock::now(), Clock::duration::zero());
  const auto nanos = std::chrono::duration_cast<std::chrono::nanoseconds>(remaining).count();
  const timespec timeout{static_cast<time_t>(nanos / 1000000000),
                         static_cast<long>(nanos % 1000000000)};
  epoll_event events[8];
  const int epoll = wake_on_submit ? idle_epoll_.get() : busy_epoll_.get();
  // epoll_pwait2 takes a nanosecond timeout: the short slices used while
  // requests are pending would round up to a whole millisecond otherwise.
  int count = epoll_pwait2(epoll, events, 8, &timeout, nullptr);
  if (count < 0 && errno == ENOSYS) {
    const int millis = static_cast<int>(std::min<int64_t>((nanos + 999999) / 1000000, 100));
    count = epoll_wait(epoll, events, 8, millis);
  }
  for (int i = 0; i < count; ++i) {
    if (events[i].data.u64 < kWatchedBase) continue;
    Watched& watched = watched_[events[i].data.u64 - kWatchedBase];
    if (watched.fired) continue;
    // Readable for good once the peer is gone: stop watching it.
    watched.fired = true;
    remove_from_epoll(idle_epoll_, watched.fd);
    remove_from_epoll(busy_epoll_, watched.fd);
    lost_.push_back(LostPeer{watched.rank, watched.how});
  }
}

void EngineWakeup::drain_submitted() {
  uint64_t value;
  while (read(submit_event_.get(), &value, sizeof(value)) > 0) {
  }
}

std::vector<EngineWakeup::LostPeer> EngineWakeup::take_lost_peers() {
  return std::exchange(lost_, {});
}

}  // namespace fsdp_ext::comm
