#include "comm/peer_liveness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <utility>

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

// The IPv4 addresses of this host's interfaces that are up (not loopback):
// UCX_NET_DEVICES's alone when it names devices that have one, else all.
std::vector<std::string> advertised_addresses() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) throw_errno("getifaddrs");
  const std::vector<std::string> preferred = preferred_devices();
  std::vector<std::string> wanted, others;
  for (ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr || entry->ifa_addr->sa_family != AF_INET) continue;
    if (!(entry->ifa_flags & IFF_UP) || (entry->ifa_flags & IFF_LOOPBACK)) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(entry->ifa_addr)->sin_addr, text,
              sizeof(text));
    const bool is_preferred = std::find(preferred.begin(), preferred.end(),
                                        std::string(entry->ifa_name)) != preferred.end();
    (is_preferred ? wanted : others).emplace_back(text);
  }
  freeifaddrs(list);
  return wanted.empty() ? others : wanted;
}

// Listening sockets on each of `addresses`, all on one port (the kernel's
// pick for the first; retried where another address has it taken). With no
// address to advertise, loopback only: nothing outside can connect.
std::vector<UniqueFd> listen_on(std::vector<std::string> addresses, uint16_t* port) {
  if (addresses.empty()) addresses.push_back("127.0.0.1");
  for (int attempt = 0; attempt < 32; ++attempt) {
    std::vector<UniqueFd> listeners;
    uint16_t chosen = 0;
    bool taken = false;
    for (const std::string& address : addresses) {
      UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (!fd.valid()) throw_errno("socket");
      sockaddr_in where{};
      where.sin_family = AF_INET;
      where.sin_port = htons(chosen);
      if (inet_pton(AF_INET, address.c_str(), &where.sin_addr) != 1) {
        throw CommError(ErrorKind::kTransport, "liveness listener: bad address " + address);
      }
      if (bind(fd.get(), reinterpret_cast<sockaddr*>(&where), sizeof(where)) != 0) {
        if (errno == EADDRINUSE && chosen != 0) {
          taken = true;
          break;
        }
        throw_errno("bind (liveness socket, " + address + ")");
      }
      if (chosen == 0) {
        socklen_t length = sizeof(where);
        getsockname(fd.get(), reinterpret_cast<sockaddr*>(&where), &length);
        chosen = ntohs(where.sin_port);
      }
      if (listen(fd.get(), 1024) != 0) throw_errno("listen (liveness socket)");
      listeners.push_back(std::move(fd));
    }
    if (!taken) {
      *port = chosen;
      return listeners;
    }
  }
  throw CommError(ErrorKind::kTransport,
                  "liveness listener: no port free on every advertised address");
}

// A hello: kMagic, the connecting process's endpoint (length-prefixed), and
// the token of the process it connects to (Note [who may connect to the
// liveness listener]).
constexpr char kMagic[8] = {'f', 's', 'd', 'p', 'x', 'l', 'v', '1'};
constexpr size_t kMaxEndpointBytes = 4096;
constexpr size_t kTokenBytes = 32;  // 16 random bytes, in hex

std::string hello_for(const std::string& endpoint, const std::string& token) {
  std::string hello(kMagic, sizeof(kMagic));
  const auto length = static_cast<uint32_t>(endpoint.size());
  hello.append(reinterpret_cast<const char*>(&length), sizeof(length));
  return hello + endpoint + token;
}

std::string random_token() {
  unsigned char raw[kTokenBytes / 2];
  size_t filled = 0;
  while (filled < sizeof(raw)) {
    const ssize_t got = getrandom(raw + filled, sizeof(raw) - filled, 0);
    if (got < 0 && errno != EINTR) throw_errno("getrandom (liveness token)");
    if (got > 0) filled += static_cast<size_t>(got);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char byte : raw) {
    token += kHex[byte >> 4];
    token += kHex[byte & 15];
  }
  return token;
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

}  // namespace

PeerLiveness& PeerLiveness::of_this_process() {
  static PeerLiveness* const instance = new PeerLiveness();
  return *instance;
}

PeerLiveness::PeerLiveness(const std::string& only_address) : token_(random_token()) {
  const std::vector<std::string> addresses =
      only_address.empty() ? advertised_addresses() : std::vector<std::string>{only_address};
  uint16_t port = 0;
  listeners_ = listen_on(addresses, &port);
  std::string joined;
  for (const std::string& address : addresses) joined += (joined.empty() ? "" : ",") + address;
  endpoint_ = joined + ":" + std::to_string(port);
}

size_t PeerLiveness::connection_count() {
  std::lock_guard<std::mutex> lock(mutex_);
  return by_endpoint_.size();
}

uint64_t PeerLiveness::refused_connections() {
  std::lock_guard<std::mutex> lock(mutex_);
  return refused_;
}

uint64_t PeerLiveness::take_unreported_refusals() {
  std::lock_guard<std::mutex> lock(mutex_);
  return refused_ - std::exchange(refused_reported_, refused_);
}

PeerLiveness::Hello PeerLiveness::judge(Pending& pending) {
  const std::string& got = pending.received;
  const size_t magic = std::min(got.size(), sizeof(kMagic));
  if (std::memcmp(got.data(), kMagic, magic) != 0) return Hello::kRefused;
  const size_t header = sizeof(kMagic) + sizeof(uint32_t);
  if (got.size() < header) return Hello::kPartial;
  uint32_t length = 0;
  std::memcpy(&length, got.data() + sizeof(kMagic), sizeof(length));
  if (length == 0 || length > kMaxEndpointBytes) return Hello::kRefused;
  const size_t total = header + length + kTokenBytes;
  if (got.size() > total) return Hello::kRefused;  // a peer sends its hello and nothing else
  if (got.size() < total) return Hello::kPartial;
  if (got.compare(header + length, kTokenBytes, token_) != 0) return Hello::kRefused;
  std::string endpoint = got.substr(header, length);
  make_liveness_socket(pending.fd.get());
  if (by_endpoint_.count(endpoint) != 0) {
    duplicates_.push_back(std::move(pending.fd));
  } else {
    by_endpoint_.emplace(std::move(endpoint), std::move(pending.fd));
  }
  return Hello::kFiled;
}

void PeerLiveness::serve(Clock::time_point until) {
  auto now = Clock::now();
  // Hellos that did not arrive in time: refused, whatever else is waiting.
  const auto expired = std::remove_if(pending_.begin(), pending_.end(),
                                      [&](const Pending& p) { return p.deadline <= now; });
  refused_ += static_cast<uint64_t>(pending_.end() - expired);
  pending_.erase(expired, pending_.end());

  std::vector<pollfd> waiters;
  for (const UniqueFd& listener : listeners_) waiters.push_back({listener.get(), POLLIN, 0});
  Clock::time_point wake = std::min(until, now + std::chrono::milliseconds(50));
  for (const Pending& pending : pending_) {
    waiters.push_back({pending.fd.get(), POLLIN, 0});
    wake = std::min(wake, pending.deadline);
  }
  if (poll(waiters.data(), waiters.size(), remaining_ms(wake)) <= 0) return;
  now = Clock::now();

  // Read what the pending hellos sent, then accept the newcomers.
  const size_t first_pending = listeners_.size();
  std::vector<bool> finished(pending_.size(), false);
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (!(waiters[first_pending + i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    Pending& pending = pending_[i];
    char chunk[1024];
    const ssize_t got = recv(pending.fd.get(), chunk, sizeof(chunk), 0);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    Hello verdict = Hello::kRefused;
    if (got > 0) {
      pending.received.append(chunk, static_cast<size_t>(got));
      verdict = judge(pending);
    }
    if (verdict == Hello::kPartial) continue;
    finished[i] = true;
    if (verdict == Hello::kRefused) ++refused_;
  }
  std::vector<Pending> still;
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (!finished[i]) still.push_back(std::move(pending_[i]));
  }
  pending_ = std::move(still);
  for (size_t l = 0; l < listeners_.size(); ++l) {
    if (!(waiters[l].revents & POLLIN)) continue;
    for (;;) {
      UniqueFd fd(accept4(listeners_[l].get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!fd.valid()) break;
      pending_.push_back(Pending{std::move(fd), now + kHelloDeadline, {}});
    }
  }
}

PeerLiveness::Connected PeerLiveness::connect(int rank, const std::vector<Address>& peers,
                                              const std::vector<bool>& remote,
                                              std::chrono::milliseconds budget) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto deadline = Clock::now() + budget;
  // Lower rank connects: the kernel completes the handshake from the
  // listen backlog, so every rank can connect before it accepts.
  for (int peer = rank + 1; peer < static_cast<int>(peers.size()); ++peer) {
    const std::string& endpoint = peers[peer].endpoint;
    if (!remote[peer] || by_endpoint_.count(endpoint) != 0) continue;
    const size_t colon = endpoint.rfind(':');
    const auto port = static_cast<uint16_t>(std::atoi(endpoint.c_str() + colon + 1));
    std::stringstream list(endpoint.substr(0, colon));
    UniqueFd fd;
    for (std::string address; !fd.valid() && std::getline(list, address, ',');) {
      fd = connect_to(address, port, deadline);
    }
    const std::string hello = hello_for(endpoint_, peers[peer].token);
    if (fd.valid() && send_all(fd.get(), hello.data(), hello.size(), deadline)) {
      make_liveness_socket(fd.get());
      by_endpoint_.emplace(endpoint, std::move(fd));
    }
  }
  // The lower ranks' connections (or ones made for another group, filed
  // all the same) arrive on the listener.
  auto all_lower_connected = [&] {
    for (int peer = 0; peer < rank; ++peer) {
      if (remote[peer] && by_endpoint_.count(peers[peer].endpoint) == 0) return false;
    }
    return true;
  };
  while (!all_lower_connected() && Clock::now() < deadline) serve(deadline);
  Connected out;
  for (int peer = 0; peer < static_cast<int>(peers.size()); ++peer) {
    if (peer == rank || !remote[peer]) continue;
    const auto found = by_endpoint_.find(peers[peer].endpoint);
    if (found == by_endpoint_.end()) {
      out.missing.push_back(peer);
    } else {
      out.connections.push_back(Connection{peer, found->second.get()});
    }
  }
  return out;
}

}  // namespace fsdp_ext::comm
