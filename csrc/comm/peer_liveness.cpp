#include "comm/peer_liveness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "comm/error.h"

namespace fsdp_ext::comm {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void throw_errno(const std::string& what) {
  throw CommError(ErrorKind::kTransport, what + " failed: " + std::strerror(errno));
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(left.count(), 0));
}

// Keepalive after 1 s idle, probes every 1 s, dead after 2 unanswered; unsent
// or unacknowledged data older than 3 s also ends the connection.
void make_liveness_socket(int fd) {
  const int on = 1, idle = 1, interval = 1, count = 2;
  const unsigned user_timeout_ms = 3000;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
}

// UCX_NET_DEVICES entries look like "eth0" or "mlx5_0:1"; "all" or unset
// means no preference.
std::vector<std::string> preferred_devices() {
  std::vector<std::string> names;
  const char* value = std::getenv("UCX_NET_DEVICES");
  if (value == nullptr) return names;
  std::stringstream list(value);
  for (std::string item; std::getline(list, item, ',');) {
    if (item == "all") return {};
    names.push_back(item.substr(0, item.find(':')));
  }
  return names;
}

std::vector<std::string> local_addresses() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) throw_errno("getifaddrs");
  const std::vector<std::string> preferred = preferred_devices();
  std::vector<std::pair<int, std::string>> ranked;
  for (ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr || entry->ifa_addr->sa_family != AF_INET) continue;
    if (!(entry->ifa_flags & IFF_UP) || (entry->ifa_flags & IFF_LOOPBACK)) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(entry->ifa_addr)->sin_addr, text,
              sizeof(text));
    const bool wanted = std::find(preferred.begin(), preferred.end(),
                                  std::string(entry->ifa_name)) != preferred.end();
    ranked.emplace_back(wanted ? 0 : 1, text);
  }
  freeifaddrs(list);
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::string> out;
  for (auto& [order, address] : ranked) out.push_back(address);
  return out;
}

// Non-blocking connect to one address, waiting at most until `deadline`.
UniqueFd connect_to(const std::string& address, uint16_t port, Clock::time_point deadline) {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) throw_errno("socket");
  sockaddr_in target{};
  target.sin_family = AF_INET;
  target.sin_port = htons(port);
  if (inet_pton(AF_INET, address.c_str(), &target.sin_addr) != 1) return {};
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&target), sizeof(target)) != 0) {
    if (errno != EINPROGRESS) return {};
    pollfd waiter{fd.get(), POLLOUT, 0};
    if (poll(&waiter, 1, remaining_ms(deadline)) != 1) return {};
    int error = 0;
    socklen_t length = sizeof(error);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) return {};
  }
  return fd;
}

bool send_all(int fd, const void* data, size_t bytes, Clock::time_point deadline) {
  const char* at = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t sent = send(fd, at, bytes, MSG_NOSIGNAL);
    if (sent > 0) {
      at += sent;
      bytes -= static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno != EAGAIN && errno != EINTR) return false;
    pollfd waiter{fd, POLLOUT, 0};
    if (poll(&waiter, 1, remaining_ms(deadline)) != 1) return false;
  }
  return true;
}

bool recv_all(int fd, void* data, size_t bytes, Clock::time_point deadline) {
  char* at = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t got = recv(fd, at, bytes, 0);
    if (got > 0) {
      at += got;
      bytes -= static_cast<size_t>(got);
      continue;
    }
    if (got == 0 || (errno != EAGAIN && errno != EINTR)) return false;
    pollfd waiter{fd, POLLIN, 0};
    if (poll(&waiter, 1, remaining_ms(deadline)) != 1) return false;
  }
  return true;
}

}  // namespace

PeerLiveness& PeerLiveness::of_this_process() {
  static PeerLiveness* const instance = new PeerLiveness();
  return *instance;
}

PeerLiveness::PeerLiveness(const std::string& only_address)
    : listener_(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)) {
  if (!listener_.valid()) throw_errno("socket");
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  any.sin_port = 0;
  if (bind(listener_.get(), reinterpret_cast<sockaddr*>(&any), sizeof(any)) != 0) {
    throw_errno("bind (liveness socket)");
  }
  if (listen(listener_.get(), 1024) != 0) throw_errno("listen (liveness socket)");
  socklen_t length = sizeof(any);
  getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&any), &length);
  std::string addresses = only_address;
  for (const std::string& address : only_address.empty() ? local_addresses()
                                                         : std::vector<std::string>{}) {
    addresses += (addresses.empty() ? "" : ",") + address;
  }
  endpoint_ = addresses + ":" + std::to_string(ntohs(any.sin_port));
}

size_t PeerLiveness::connection_count() {
  std::lock_guard<std::mutex> lock(mutex_);
  return by_endpoint_.size();
}

void PeerLiveness::accept_one(Clock::time_point deadline) {
  pollfd waiter{listener_.get(), POLLIN, 0};
  if (poll(&waiter, 1, std::min(remaining_ms(deadline), 50)) != 1) return;
  UniqueFd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
  if (!fd.valid()) return;
  uint32_t length = 0;
  if (!recv_all(fd.get(), &length, sizeof(length), deadline) || length == 0 || length > 4096) {
    return;
  }
  std::string hello(length, '\0');
  if (!recv_all(fd.get(), hello.data(), length, deadline)) return;
  make_liveness_socket(fd.get());
  if (by_endpoint_.count(hello) != 0) {
    duplicates_.push_back(std::move(fd));
  } else {
    by_endpoint_.emplace(std::move(hello), std::move(fd));
  }
}

PeerLiveness::Connected PeerLiveness::connect(int rank, const std::vector<std::string>& endpoints,
                                              const std::vector<bool>& remote,
                                              std::chrono::milliseconds budget) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto deadline = Clock::now() + budget;
  // Lower rank connects: the kernel completes the handshake from the
  // listen backlog, so every rank can connect before it accepts.
  for (int peer = rank + 1; peer < static_cast<int>(endpoints.size()); ++peer) {
    const std::string& endpoint = endpoints[peer];
    if (!remote[peer] || by_endpoint_.count(endpoint) != 0) continue;
    const size_t colon = endpoint.rfind(':');
    const auto port = static_cast<uint16_t>(std::atoi(endpoint.c_str() + colon + 1));
    std::stringstream list(endpoint.substr(0, colon));
    UniqueFd fd;
    for (std::string address; !fd.valid() && std::getline(list, address, ',');) {
      fd = connect_to(address, port, deadline);
    }
    const auto length = static_cast<uint32_t>(endpoint_.size());
    if (fd.valid() && send_all(fd.get(), &length, sizeof(length), deadline) &&
        send_all(fd.get(), endpoint_.data(), endpoint_.size(), deadline)) {
      make_liveness_socket(fd.get());
      by_endpoint_.emplace(endpoint, std::move(fd));
    }
  }
  // The lower ranks' connections (or ones made for another group, filed
  // all the same) arrive on the listener.
  auto all_lower_connected = [&] {
    for (int peer = 0; peer < rank; ++peer) {
      if (remote[peer] && by_endpoint_.count(endpoints[peer]) == 0) return false;
    }
    return true;
  };
  while (!all_lower_connected() && Clock::now() < deadline) accept_one(deadline);
  Connected out;
  for (int peer = 0; peer < static_cast<int>(endpoints.size()); ++peer) {
    if (peer == rank || !remote[peer]) continue;
    const auto found = by_endpoint_.find(endpoints[peer]);
    if (found == by_endpoint_.end()) {
      out.missing.push_back(peer);
    } else {
      out.connections.push_back(Connection{peer, found->second.get()});
    }
  }
  return out;
}

}  // namespace fsdp_ext::comm
