// What the progress thread sleeps on, and the only code that sleeps.
//
// Five kinds of wake-up: the UCX worker's fd (messages arrived), an eventfd
// for newly submitted work, one for abort, a pidfd per peer process on this
// host, which turns readable the moment that process exits, and a liveness
// socket per peer on another host (peer_liveness.h), which turns readable
// when that peer's connection ends -- so a rank that dies is noticed within
// microseconds (same host) or seconds (another host), not at the timeout.
//
// Why sleeping needs care: ucp_worker_arm arms UCX's transports for receive
// events only (UCT_EVENT_RECV | UCT_EVENT_RECV_SIG), never for send
// completion. A send that waits for room -- a TCP socket buffer filling up
// under a rendezvous or multi-fragment transfer -- makes progress only when
// ucp_worker_progress is called, and nothing wakes the fd for it (16 MiB
// all-gather across two hosts: 103 ms, nearly all of it asleep). Receives
// over TCP were seen to miss wake-ups too (UCX 1.13: small all-reduces after
// an idle spell took up to the 100 ms cap). So while any request is pending,
// the engine sleeps in short, growing slices (20 us .. 1 ms) as well as on
// the fd, or, during a stream whose events come at a known cadence, naps and
// spins by it (progress_cadence.h); idle, it sleeps on the fd alone (see
// ProgressEngine::idle_wait).
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "comm/unique_fd.h"

namespace fsdp_ext::comm {

class EngineWakeup {
 public:
  using Clock = std::chrono::steady_clock;

  explicit EngineWakeup(int worker_fd);
  EngineWakeup(const EngineWakeup&) = delete;
  EngineWakeup& operator=(const EngineWakeup&) = delete;

  // Any thread.
  void notify_submitted();
  void notify_abort();

  // Starts watching the process `pid` (on this host) as `rank`. Returns
  // false when the kernel offers no pidfd or the process is already gone.
  bool watch_process(int rank, int pid);
  // Starts watching `rank`'s liveness socket, borrowed: it is shared with
  // other groups' engines and outlives this one (peer_liveness.h).
  void watch_socket(int rank, int socket);

  // Sleeps until a watched fd fires or `until` passes. New submissions wake
  // the thread only when `wake_on_submit` (it is idle, not inside an op).
  void sleep(Clock::time_point until, bool wake_on_submit);
  void drain_submitted();

  // Peers whose process exited or whose liveness connection ended since the
  // last call, each reported once.
  struct LostPeer {
    int rank;
    const char* how;  // "exited (its process is gone)", ...
  };
  std::vector<LostPeer> take_lost_peers();

 private:
  UniqueFd submit_event_;
  UniqueFd abort_event_;
  UniqueFd idle_epoll_;  // worker + submit + abort + pidfds
  UniqueFd busy_epoll_;  // worker + abort + pidfds
  struct Watched {
    int rank;
    int fd;
    UniqueFd owned;  // the pidfds; liveness sockets are borrowed
    const char* how;  // what its firing means
    bool fired = false;
  };
  void watch(int rank, int fd, UniqueFd owned, const char* how);
  std::vector<Watched> watched_;
  std::vector<LostPeer> lost_;
};

}  // namespace fsdp_ext::comm
