// How a rank learns that a peer on another host is gone, without a
// heartbeat of its own and without slowing the data path.
//
// Every pair of processes on different hosts keeps one idle TCP connection,
// used for nothing but its lifetime, shared by every group the two have in
// common (a job with many groups must not hold a socket per peer per group).
// When the peer process exits (crash, kill -9, normal exit) its kernel closes
// the socket and this end turns readable at once; when the peer's host or
// link vanishes, TCP keepalive (probes after 1 s idle, every 1 s, 2
// unanswered) and TCP_USER_TIMEOUT end the connection within about 3 s.
// Each group's engine sleeps on the shared sockets next to its other fds
// (EngineWakeup::watch_socket); nobody ever reads or writes them after the
// hello, so one firing is seen by every engine that watches it.
//
// The connections live as long as the process: a group that ends must not
// close a socket that another group (or the peer's copy of this group, torn
// down later) still watches, or the peer would take the close for a death.
//
// Why not UCX's own peer error handling (UCP_ERR_HANDLING_MODE_PEER): on
// UCX 1.13 over TCP it made a 16 MiB all-gather between two hosts 5x slower
// (1.5 ms -> 8 ms), for every message, to detect a rare event.
// Ranks on the same host are watched through pidfds instead.
#pragma once

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "comm/unique_fd.h"

namespace fsdp_ext::comm {

class PeerLiveness {
 public:
  // The process's one listener and its connections, made on first use and
  // kept until the process exits (never destroyed: engines of groups still
  // alive at exit borrow its fds).
  static PeerLiveness& of_this_process();

  // One registry; production has one per process (of_this_process), tests
  // make several to stand for several processes. `only_address` publishes
  // that address instead of the interfaces' (tests: "127.0.0.1").
  explicit PeerLiveness(const std::string& only_address = "");
  PeerLiveness(const PeerLiveness&) = delete;
  PeerLiveness& operator=(const PeerLiveness&) = delete;

  // Where peers connect, and what names this process to them: "ip,ip,...:port"
  // (the IPv4 addresses of this host's interfaces that are up, preferring
  // UCX_NET_DEVICES's, and the listener's port).
  const std::string& endpoint() const { return endpoint_; }

  // A connection to a peer process, borrowed for the process's lifetime.
  struct Connection {
    int rank;
    int socket;
  };
  struct Connected {
    std::vector<Connection> connections;
    std::vector<int> missing;  // ranks that should be watched but could not be reached
  };
  // Makes sure this process has a connection to every rank with `remote[r]`
  // true (`endpoints[r]` names its process): one made for an earlier group
  // is reused; otherwise, of the pair, the lower rank of this group connects
  // and says who it is, the higher accepts. Gives up on a peer after `budget`
  // (that peer is then not watched, and `missing` says so).
  Connected connect(int rank, const std::vector<std::string>& endpoints,
                    const std::vector<bool>& remote, std::chrono::milliseconds budget);

  // How many peer processes this process holds a connection to.
  size_t connection_count();

 private:
  // Accepts one pending connection and files it under the endpoint its
  // hello names. Caller holds mutex_.
  void accept_one(std::chrono::steady_clock::time_point deadline);

  std::mutex mutex_;
  UniqueFd listener_;
  std::string endpoint_;
  std::map<std::string, UniqueFd> by_endpoint_;
  // A second connection from a process already connected (a hello that came
  // after this side had given up on it): kept open, since closing it would
  // tell the peer that this process died.
  std::vector<UniqueFd> duplicates_;
};

}  // namespace fsdp_ext::comm
