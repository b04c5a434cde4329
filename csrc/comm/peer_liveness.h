// How a rank learns that a peer on another host is gone, without a
// heartbeat of its own and without slowing the data path.
//
// Every pair of ranks on different hosts keeps one idle TCP connection,
// used for nothing but its lifetime. When the peer process exits (crash,
// kill -9, normal exit) its kernel closes the socket and this end turns
// readable at once; when the peer's host or link vanishes, TCP keepalive
// (probes after 1 s idle, every 1 s, 2 unanswered) and TCP_USER_TIMEOUT
// end the connection within about 3 s. The engine sleeps on these sockets
// next to its other fds (EngineWakeup::watch_socket).
//
// Why not UCX's own peer error handling (UCP_ERR_HANDLING_MODE_PEER): on
// UCX 1.13 over TCP it made a 16 MiB all-gather between two hosts 5x slower
// (1.5 ms -> 8 ms), for every message, to detect a rare event.
// Ranks on the same host are watched through pidfds instead.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "comm/unique_fd.h"

namespace fsdp_ext::comm {

class PeerLiveness {
 public:
  // Opens a listening socket on an ephemeral port of every interface.
  PeerLiveness();

  // What peers need to connect here: "ip,ip,...:port" (the IPv4 addresses of
  // this host's interfaces that are up, preferring UCX_NET_DEVICES's).
  std::string endpoint() const { return endpoint_; }

  // Connects to every rank with `remote[r]` true: the lower rank of a pair
  // connects and says its rank, the higher accepts. Gives up on a peer after
  // `budget` (then that peer is simply not watched, and `missing()` says so).
  void connect(int rank, const std::vector<std::string>& endpoints,
               const std::vector<bool>& remote, std::chrono::milliseconds budget);

  struct Connection {
    int rank;
    UniqueFd socket;
  };
  // The established connections; the engine takes them over.
  std::vector<Connection> take_connections() { return std::move(connections_); }
  // Ranks that should have been watched but could not be reached.
  const std::vector<int>& missing() const { return missing_; }

 private:
  UniqueFd listener_;
  std::string endpoint_;
  std::vector<Connection> connections_;
  std::vector<int> missing_;
};

}  // namespace fsdp_ext::comm
