#include "comm/descriptor_sharing.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <random>

#include "comm/error.h"

namespace fsdp_ext::comm {
namespace {

// The one-byte answer before the descriptor (sent with it, as ancillary data).
constexpr uint8_t kOffered = 1;
constexpr uint8_t kNotOffered = 0;

// A connection that sends nothing for this long is dropped, so that a
// stalled peer cannot keep the server from answering the others.
constexpr std::chrono::seconds kRequestTimeout{2};

[[noreturn]] void fail(const std::string& what, int error) {
  throw CommError(ErrorKind::kTransport, what + ": " + std::strerror(error));
}

// An abstract socket address: sun_path starts with a NUL, and the name is
// exactly the bytes after it (no terminator), so its length is the address'.
socklen_t abstract_address(const std::string& name, sockaddr_un* address) {
  std::memset(address, 0, sizeof(*address));
  address->sun_family = AF_UNIX;
  std::memcpy(address->sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

void set_timeouts(int fd, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// A name no other server of this host has: the pid and a counter of this
// process, and random bits against pids reused in other PID namespaces that
// share the network namespace.
std::string fresh_name() {
  static std::atomic<uint64_t> servers{0};
  std::random_device random;
  return "fsdp_ext.descriptors." + std::to_string(getpid()) + "." +
         std::to_string(servers.fetch_add(1)) + "." + std::to_string(random());
}

}  // namespace

DescriptorServer::DescriptorServer() {
  listener_ = UniqueFd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!listener_.valid()) fail("socket(AF_UNIX) for the descriptor server", errno);
  sockaddr_un address{};
  int bound = -1;
  for (int attempt = 0; attempt < 8 && bound != 0; ++attempt) {
    address_ = fresh_name();
    bound = bind(listener_.get(), reinterpret_cast<sockaddr*>(&address),
                 abstract_address(address_, &address));
    if (bound != 0 && errno != EADDRINUSE) break;
  }
  if (bound != 0) fail("bind of the descriptor server's socket @" + address_, errno);
  if (listen(listener_.get(), 64) != 0) fail("listen on @" + address_, errno);
  stop_ = UniqueFd(eventfd(0, EFD_CLOEXEC));
  if (!stop_.valid()) fail("eventfd for the descriptor server", errno);
  thread_ = std::thread([this] { serve(); });
}

DescriptorServer::~DescriptorServer() {
  const uint64_t one = 1;
  // An eventfd write of 8 bytes cannot be short; if it failed the thread
  // would never end, and joining it would hang the destructor.
  if (write(stop_.get(), &one, sizeof(one)) == sizeof(one)) {
    thread_.join();
  } else {
    thread_.detach();
  }
}

void DescriptorServer::offer(uint64_t id, int fd) {
  UniqueFd copy(fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!copy.valid()) fail("duplicating descriptor " + std::to_string(fd) + " to offer it", errno);
  std::lock_guard<std::mutex> lock(mutex_);
  offered_[id] = std::move(copy);
}

void DescriptorServer::withdraw(uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  offered_.erase(id);
}

uint64_t DescriptorServer::served() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return served_;
}

void DescriptorServer::serve() {
  pollfd watched[2] = {{listener_.get(), POLLIN, 0}, {stop_.get(), POLLIN, 0}};
  while (true) {
    if (poll(watched, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;  // nothing to report to: peers' fetches then fail with their own error
    }
    if (watched[1].revents != 0) return;
    if ((watched[0].revents & POLLIN) == 0) continue;
    UniqueFd connection(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (connection.valid()) answer(connection.get());
  }
}

void DescriptorServer::answer(int connection) {
  ucred peer{};
  socklen_t length = sizeof(peer);
  if (getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0) return;
  // Another user's process gets nothing: closing without an answer tells it so.
  if (peer.uid != geteuid() && peer.uid != 0) return;
  set_timeouts(connection, kRequestTimeout);
  uint64_t id = 0;
  size_t got = 0;
  while (got < sizeof(id)) {
    const ssize_t n = recv(connection, reinterpret_cast<char*>(&id) + got, sizeof(id) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    got += static_cast<size_t>(n);
  }
  std::unique_lock<std::mutex> lock(mutex_);
  const auto found = offered_.find(id);
  uint8_t reply = found == offered_.end() ? kNotOffered : kOffered;
  iovec part{&reply, sizeof(reply)};
  msghdr message{};
  message.msg_iov = &part;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (reply == kOffered) {
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int));
    const int fd = found->second.get();
    std::memcpy(CMSG_DATA(header), &fd, sizeof(fd));
  }
  // Sent under the lock: withdraw() cannot close the descriptor meanwhile
  // (the kernel has its own reference once sendmsg returns).
  if (sendmsg(connection, &message, MSG_NOSIGNAL) == 1 && reply == kOffered) ++served_;
}

UniqueFd fetch_descriptor(const std::string& address, uint64_t id,
                          std::chrono::milliseconds timeout) {
  const std::string what =
      "fetching descriptor " + std::to_string(id) + " from the server at @" + address;
  if (address.empty() || address.size() > DescriptorServer::kMaxAddressBytes) {
    throw CommError(ErrorKind::kTransport,
                    what + ": not a descriptor server's address (" +
                        std::to_string(address.size()) + " bytes)");
  }
  UniqueFd connection(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!connection.valid()) fail(what + ": socket(AF_UNIX)", errno);
  set_timeouts(connection.get(), timeout);
  sockaddr_un server{};
  const socklen_t length = abstract_address(address, &server);
  int connected;
  do {
    connected = connect(connection.get(), reinterpret_cast<sockaddr*>(&server), length);
  } while (connected != 0 && errno == EINTR);
  if (connected != 0) {
    const int error = errno;
    if (error == ECONNREFUSED || error == ENOENT) {
      throw CommError(ErrorKind::kPeerLost,
                      what + ": no server there (its process exited, or runs in another "
                             "network namespace)");
    }
    fail(what + ": connect", error);
  }
  size_t sent = 0;
  while (sent < sizeof(id)) {
    const ssize_t n = send(connection.get(), reinterpret_cast<const char*>(&id) + sent,
                           sizeof(id) - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(what + ": send", errno);
    sent += static_cast<size_t>(n);
  }
  uint8_t reply = kNotOffered;
  iovec part{&reply, sizeof(reply)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};
  message.msg_iov = &part;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(connection.get(), &message, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    throw CommError(ErrorKind::kTimeout, what + ": no answer within " +
                                             std::to_string(timeout.count()) + " ms");
  }
  if (n < 0) fail(what + ": recvmsg", errno);
  // The descriptor, if one came: taken before any check, so that every
  // path out of here closes it.
  UniqueFd received;
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr;
       header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level == SOL_SOCKET && header->cmsg_type == SCM_RIGHTS &&
        header->cmsg_len == CMSG_LEN(sizeof(int))) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(header), sizeof(fd));
      received = UniqueFd(fd);
    }
  }
  if (n == 0) {
    throw CommError(ErrorKind::kTransport,
                    what + ": the server closed the connection without an answer (it serves "
                           "only its own user's processes)");
  }
  if (reply != kOffered) {
    throw CommError(ErrorKind::kTransport, what + ": the server offers no descriptor " +
                                               std::to_string(id));
  }
  if ((message.msg_flags & MSG_CTRUNC) != 0 || !received.valid()) {
    throw CommError(ErrorKind::kTransport,
                    what + ": the answer came without its descriptor (this process may be at "
                           "its limit of open files)");
  }
  return received;
}

}  // namespace fsdp_ext::comm
