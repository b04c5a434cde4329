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
// Note [who may connect to the liveness listener]
// The listener's port is reachable by anything on the hosts' network. A
// connection is filed as a peer's only after its hello proves it belongs to
// this job: the hello carries, after a fixed magic, the connecting process's
// endpoint (who it is) and the listener's token -- random bytes this process
// drew at start and published only through the groups' c10d store, with its
// endpoint (backend/peer_identity). Anything else (a scanner, a health
// checker, garbage, a forged endpoint without the token, a hello longer than
// a hello can be) is closed and counted. Each accepted connection has
// kHelloDeadline of its own to say its hello, and the listener keeps
// accepting and reading the others meanwhile: a silent client never delays a
// real peer queued behind it. The listener binds the addresses it advertises
// only (UCX_NET_DEVICES's when they have any), not every interface.
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
  // How long an accepted connection may take to send its hello.
  static constexpr std::chrono::milliseconds kHelloDeadline{1000};

  // What a peer process publishes for others to connect to it: where, and
  // the token its listener asks for (Note above).
  struct Address {
    std::string endpoint;
    std::string token;
  };

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
  // This process's endpoint and token, as peers need them (published through
  // the c10d store).
  Address address() const { return {endpoint_, token_}; }

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
  // true (`peers[r]` names its process): one made for an earlier group is
  // reused; otherwise, of the pair, the lower rank of this group connects
  // and says who it is, the higher accepts. Gives up on a peer after `budget`
  // (that peer is then not watched, and `missing` says so).
  Connected connect(int rank, const std::vector<Address>& peers, const std::vector<bool>& remote,
                    std::chrono::milliseconds budget);

  // How many peer processes this process holds a connection to.
  size_t connection_count();
  // Connections the listener closed without filing them (Note above): no
  // valid hello within kHelloDeadline, or a hello without this token.
  uint64_t refused_connections();
  // Refused connections not yet reported: the count since the last call
  // (a group's creation logs them once, not again for the next group).
  uint64_t take_unreported_refusals();

 private:
  using Clock = std::chrono::steady_clock;
  // An accepted connection whose hello has not all arrived.
  struct Pending {
    UniqueFd fd;
    Clock::time_point deadline;
    std::string received;
  };
  // Accepts what the listeners have and reads the pending hellos, for at
  // most until `until` (and 50 ms): files each peer that proves itself,
  // refuses the rest. Caller holds mutex_.
  void serve(Clock::time_point until);
  // A pending hello, as far as it has arrived: whether it is complete and
  // valid (filed), wrong (refused), or still partial.
  enum class Hello { kPartial, kFiled, kRefused };
  Hello judge(Pending& pending);

  std::mutex mutex_;
  std::vector<UniqueFd> listeners_;  // one per advertised address, one port
  std::string endpoint_;
  std::string token_;
  std::vector<Pending> pending_;
  uint64_t refused_ = 0;
  uint64_t refused_reported_ = 0;  // of refused_, how many were taken as reported
  std::map<std::string, UniqueFd> by_endpoint_;
  // A second connection from a process already connected (a hello that came
  // after this side had given up on it): kept open, since closing it would
  // tell the peer that this process died.
  std::vector<UniqueFd> duplicates_;
};

}  // namespace fsdp_ext::comm
