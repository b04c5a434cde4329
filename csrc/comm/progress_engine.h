// The per-group progress engine: one thread that owns the group's UCX worker,
// runs queued operations in the order they were submitted, and sleeps on the
// worker's wakeup fd when there is nothing to do.
//
// Ordering: collectives run one at a time, in submission order, each to
// completion. Point-to-point ops are posted in order and then complete in the
// background, so `isend; irecv` pairs between two ranks cannot deadlock.
//
// Waiting has one owner: the engine. Algorithms call OpContext::wait_all /
// wait_one, which hand the requests, the op's deadline and its description
// to wait_for; idle sleeping and waiting inside an op share idle_wait, and
// EngineWakeup is the only code that blocks.
//
// Dead peers: a peer process on this host is watched through a pidfd, and
// every endpoint uses UCX's peer error handling. Either way the loss becomes
// a kPeerLost error for the op waiting on the group (after draining what the
// peer already delivered), and the group refuses further work.
//
// Failures told to peers: a collective that fails here for a reason of this
// rank's own (a timeout, a mismatch it saw, a transport error) sends each
// peer a notice, and a notice received fails this rank's work like a lost
// peer (Note [a failure told to the peers], failure_notice.h).
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/collective_kind.h"
#include "comm/engine_wakeup.h"
#include "comm/error.h"
#include "comm/failure_notice.h"
#include "comm/op_context.h"
#include "comm/peer_liveness.h"
#include "comm/progress_cadence.h"
#include "comm/scratch_arena.h"
#include "comm/transport.h"

namespace fsdp_ext::comm {

class SharedMemoryDomain;
class SmallOpChannel;

constexpr size_t kAllRequests = ~size_t{0};

struct OpOutcome {
  bool ok = true;
  ErrorKind kind = ErrorKind::kTransport;
  std::string message;
  int source_rank = -1;  // receives from any source: who sent it
};

struct EngineOp {
  std::string name;           // e.g. "allreduce"; used in error messages
  // Carried in the tags of the op's messages (comm/collective_kind.h).
  CollectiveKind kind = CollectiveKind::kUnnamed;
  bool collective = true;     // collectives consume a sequence number
  std::chrono::milliseconds timeout{0};
  std::function<void(OpContext&)> body;
  // Runs on the progress thread just before the body (not for an op failed
  // before it began): when the op's timing and records start.
  std::function<void()> on_start;
  // Runs on the progress thread exactly once, after the op finished.
  std::function<void(const OpOutcome&)> on_done;
  // Keeps the op's buffers alive until the transport is done with them.
  std::shared_ptr<void> keepalive;
  // Non-zero: the rest of a collective begun on a caller's turn (see
  // Turn), which already holds this sequence number.
  uint64_t continues_seq = 0;
  // The op runs in the small-op channel, not over UCX messages (it is not
  // announced there: see SmallOpChannel::announce_engine_collective).
  bool small_op = false;
  // A point-to-point receive: it still runs after a peer was lost or
  // stopped the group (Note [what a lost peer sent still arrives]).
  bool receive_only = false;
};

// Who a peer is, for error messages and dead-peer detection.
struct PeerInfo {
  std::string host;   // empty when unknown
  int pid = 0;        // 0 when unknown
  bool same_host = false;
};

// What this rank is doing, for other ranks' timeout messages.
struct EngineActivity {
  bool in_collective = false;
  uint64_t seq = 0;           // the running collective, or the last one begun
  std::string op;             // its name
};

// Which ranks share a host, when a group spans several: hosts[h] lists the
// global ranks on host h in ascending order. Collectives go hierarchical
// (algorithms/hierarchical.cpp) when every host has the same number of
// ranks, at least two: shared memory within a host, the network between.
// Broadcast also goes through one leader per host when the numbers differ.
struct HostTopology {
  std::vector<std::vector<int>> hosts;
  int host = 0;   // this rank's host
  int local = 0;  // this rank's position on it
  bool hierarchical() const {
    if (hosts.size() < 2 || hosts[0].size() < 2) return false;
    for (const auto& ranks : hosts) {
      if (ranks.size() != hosts[0].size()) return false;
    }
    return true;
  }
  struct Position {
    int host = -1;  // -1: not in the group
    int local = -1;
  };
  // Where global rank `rank` is.
  Position position_of(int rank) const {
    for (size_t h = 0; h < hosts.size(); ++h) {
      for (size_t l = 0; l < hosts[h].size(); ++l) {
        if (hosts[h][l] == rank) return Position{static_cast<int>(h), static_cast<int>(l)};
      }
    }
    return Position{};
  }
  // The ranks at position `local` on every host, host order.
  std::vector<int> column(int local_index) const {
    std::vector<int> out;
    for (const auto& ranks : hosts) out.push_back(ranks[local_index]);
    return out;
  }
};

struct EngineConfig {
  int rank = 0;
  int size = 1;
  std::string group_name;
  HostTopology topology;
  // One entry per rank (or empty): named in errors, same-host ones watched.
  std::vector<PeerInfo> peers;
  // Appended to a timeout's message: what the other ranks were doing when
  // this rank's op (`mine`) timed out (the backend reads it from the store).
  // Optional.
  std::function<std::string(const EngineActivity& mine)> explain_timeout;
  // Connections to peers on other hosts, watched for their end.
  std::vector<PeerLiveness::Connection> liveness;
  // How long to keep polling after the last sign of progress before sleeping
  // on the wakeup fd. Short spins keep latency low; sleeping keeps 4 ranks
  // on 2 cores from starving each other.
  std::chrono::microseconds spin{100};
  // Set for groups whose ranks may share memory (see shared_memory_domain.h).
  std::shared_ptr<SharedMemoryDomain> shared_memory;
  // The group's small-op channel, if this rank has one: the engine announces
  // its UCX collectives there and looks for peers that took the channel for
  // the same op (Note [a size that straddles the channel's limit]).
  std::shared_ptr<SmallOpChannel> small_ops;
};

class ProgressEngine {
 public:
  // The engine's turn, held by a caller thread that runs a small collective
  // itself (small_op_channel.h) instead of queueing it: taken only while the
  // engine has nothing queued or running, so the op keeps its place in
  // submission order. While it is held the engine starts no queued op (it
  // still progresses point-to-point transfers and watches peers). Ends when
  // destroyed, or earlier with hand_over / fail.
  class Turn {
   public:
    Turn() = default;
    Turn(Turn&& other) noexcept : engine_(std::exchange(other.engine_, nullptr)), seq_(other.seq_) {}
    Turn& operator=(Turn&&) = delete;
    Turn(const Turn&) = delete;
    ~Turn() { release(nullptr); }
    explicit operator bool() const { return engine_ != nullptr; }
    uint64_t seq() const { return seq_; }
    // Ends the turn (what the destructor does).
    void end() { release(nullptr); }
    // Ends the turn; `rest` (continues_seq = seq()) runs on the engine
    // before anything submitted meanwhile.
    void hand_over(EngineOp rest) { release(&rest); }
    // Ends the turn after the op failed in a way peers may not share:
    // the group is unusable from now on, as after any failed collective.
    void fail(const std::string& message, ErrorKind kind = ErrorKind::kBroken);

   private:
    friend class ProgressEngine;
    Turn(ProgressEngine* engine, uint64_t seq) : engine_(engine), seq_(seq) {}
    void release(EngineOp* rest);
    ProgressEngine* engine_ = nullptr;
    uint64_t seq_ = 0;
  };
  // Any thread. An empty Turn when the engine is busy, stopping or broken
  // (then submit the op as usual: that path reports a broken group). While
  // the turn is held, activity() reports collective `op` as running, as it
  // does for ops the engine runs (a timed-out peer's message reads it).
  Turn try_take_turn(const char* op = "collective");

  ProgressEngine(EngineConfig config, std::unique_ptr<Transport> transport);
  ~ProgressEngine();
  ProgressEngine(const ProgressEngine&) = delete;
  ProgressEngine& operator=(const ProgressEngine&) = delete;

  void submit(EngineOp op);
  // Finishes queued ops, cancels pending point-to-point ops, stops the
  // thread and closes endpoints. Idempotent.
  void shutdown();
  // Fails every pending and running op with kAborted, then shuts down.
  void abort(const std::string& reason);

  const EngineConfig& config() const { return config_; }
  // Non-empty once a failure desynchronised the group.
  std::string broken_reason() const;

  // Progress thread only: the next collective sequence number.
  uint64_t allocate_seq() { return next_seq_++; }
  // Progress thread only: `count` consecutive sequence numbers (a phase of a
  // hierarchical op; every rank reserves the same blocks in the same order).
  uint64_t reserve_seqs(uint64_t count) {
    const uint64_t first = next_seq_;
    next_seq_ += count;
    return first;
  }
  // Ops run and collective sequence numbers used so far (any thread): tests
  // use them to check that a coalesced bucket runs as one op and one pass.
  uint64_t ops_run() const { return ops_run_.load(std::memory_order_relaxed); }
  uint64_t sequences_used() const { return next_seq_.load(std::memory_order_relaxed) - 1; }

  // A snapshot of what this rank is doing (any thread).
  EngineActivity activity() const;
  // "rank 3 (host h, pid 12)": how errors name a peer.
  std::string describe_peer(int rank) const;
  // The unfinished ones among a point-to-point op's requests, each with its
  // peer and size: what a timed-out send or recv was waiting for.
  std::string describe_unmatched(const std::vector<Request>& requests) const;
  // What the other ranks were doing while this rank's running collective
  // waited for them (EngineConfig::explain_timeout; "" without one).
  std::string explain_timeout() const;
  // "fsdp_ext all_reduce (group 'g', rank 0/2, op #7)": how errors name an op.
  std::string describe_op(const std::string& name, uint64_t seq) const;

  // Progress thread only, inside an op that waits on something other than
  // UCX requests (the small-op channel): progresses UCX (so transfers a peer
  // waits on keep moving), notices lost peers and aborts. Throws CommError
  // naming `description` when the op must stop.
  void keep_alive_while_waiting(const std::string& description);

  // Progress thread only (OpContext::wait_all / wait_one): progresses and
  // sleeps until the requests finish (`only`: one index, or kAllRequests).
  // Throws CommError on failure, timeout, abort or a lost peer.
  void wait_for(const std::string& description, Clock::time_point deadline,
                std::chrono::milliseconds timeout, std::vector<Request>& requests,
                size_t only);

  // Progress thread only (OpContext::abandon): the running op failed while
  // `requests` were posted and not waited on; cancels them, or keeps them
  // (with the op's buffers and scratch) until shutdown. Afterwards every
  // entry reads as finished, so abandoning the same vector twice is safe.
  void abandon(std::vector<Request>& requests);

 private:
  struct InFlight {
    EngineOp op;
    std::vector<Request> requests;
    Clock::time_point deadline;
    std::string description;
  };
  struct Orphan {
    std::vector<Request> requests;
    std::shared_ptr<void> keepalive;
    std::unique_ptr<ScratchArena> scratch;
  };

  void thread_main();
  void run_op(EngineOp& op);
  void finish(EngineOp& op, const OpOutcome& outcome);
  bool poll_in_flight(bool cancel_all);
  void orphan_unfinished(std::vector<Request>& requests,
                         std::shared_ptr<void> keepalive, bool scratch_in_use);
  // `by_peer`: the first failure is a peer's (lost, failed, departed), not
  // this rank's own: receives still run (Note [what a lost peer sent still
  // arrives]).
  void mark_broken(const std::string& reason, bool by_peer = false);
  static bool is_peer_fault(ErrorKind kind) {
    return kind == ErrorKind::kPeerLost || kind == ErrorKind::kPeerFailed ||
           kind == ErrorKind::kPeerLeft;
  }
  // Sleep policy while nothing progresses: spin briefly, then arm the
  // worker and sleep until `until` (in short slices while requests are
  // pending). While a stream makes progress at a known cadence longer than
  // the spin, requests pending nap until half the gap has passed and spin
  // until twice the gap (progress_cadence.h).
  struct IdleState {
    Clock::time_point spin_until;
    std::chrono::microseconds pending_slice;
    Clock::time_point nap_until;
    Clock::time_point watch_until;
  };
  // Called when something progressed (or an op starts): restarts the policy.
  IdleState fresh_idle_state(bool progressed);
  void idle_wait(IdleState& state, Clock::time_point until, bool in_op, bool requests_pending);
  // Collects peers that exited, whose endpoint failed, or that stopped the
  // group after a failure of their own (a notice); returns the message
  // describing the first ("" while every peer is well; peer_fault_kind_
  // says which it was). `own_transport_failed`: this rank's op just failed
  // in its transport, so a notice already in counts at once, without its
  // grace (Note [a transport failure is often a lost peer]).
  const std::string& check_peers(bool own_transport_failed = false);
  // Note [a peer that destroyed the group]: "" unless a peer that destroyed
  // the group ran its last collective before collective `seq`; then that
  // peer's departure, which also becomes the group's peer fault.
  const std::string& departed_before(uint64_t seq);
  // Tells the peers this rank has endpoints to that it destroys the group
  // after its last collective (a clean shutdown only).
  void announce_departure();
  // Sends `notice` (encode_failure_notice) to each of `peers`, waiting at
  // most kNoticeFlush for it to leave; what has not left by then is
  // orphaned with its payload. Failure and departure notices alike.
  void send_notice(const std::vector<int>& peers, std::vector<uint8_t> notice);
  // Tests every request; whether all have finished.
  bool test_all(std::vector<Request>& requests);
  // Note [a failure told to the peers]: sends every other rank a notice of
  // this rank's failed collective `seq`, waiting briefly for it to leave.
  void tell_peers(uint64_t seq, const OpOutcome& failure);
  Clock::time_point nearest_deadline() const;
  // Note [ranks that run different collectives]: "rank 1 (...) is in a
  // broadcast where this rank is in an all-reduce (...)", or "".
  std::string describe_other_collective(const std::vector<Request>& requests);

  EngineConfig config_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<ScratchArena> scratch_;
  ProgressCadence cadence_;  // the progress thread's only

  mutable std::mutex mutex_;
  std::deque<EngineOp> queue_;
  std::string broken_reason_;
  bool broken_by_peer_ = false;  // with broken_reason_, under mutex_
  bool stop_requested_ = false;
  bool op_running_ = false;  // the progress thread runs an op whose outcome is not known yet
  bool turn_taken_ = false;  // a caller holds the Turn
  std::atomic<bool> aborting_{false};
  std::string abort_reason_;  // set once, before aborting_ (see abort())
  bool shut_down_ = false;

  mutable std::mutex activity_mutex_;
  EngineActivity activity_;

  // Only touched on the progress thread.
  // The first peer lost or stopped: set once, by check_peers. Its kind is
  // kPeerLost (exited, connection failed) or kPeerFailed (its notice).
  std::string peer_fault_;
  ErrorKind peer_fault_kind_ = ErrorKind::kPeerLost;
  FailureNoticeInbox notices_;
  // Peers that destroyed the group, with the last collective each ran
  // (Note [a peer that destroyed the group]); progress thread only.
  std::map<int, uint64_t> departed_;
  // Whether receives in flight had their one drain after the peer fault
  // (poll_in_flight); progress thread only.
  bool drained_for_receives_ = false;
  // The first notice received, until its grace has passed (kNoticeGrace).
  std::optional<FailureNotice> notice_;
  Clock::time_point notice_arrived_;
  std::atomic<uint64_t> next_seq_{1};
  std::atomic<uint64_t> ops_run_{0};
  std::vector<InFlight> in_flight_;
  std::vector<Orphan> orphans_;
  EngineOp* running_ = nullptr;
  uint64_t running_seq_ = 0;

  std::unique_ptr<EngineWakeup> wakeup_;
  std::thread thread_;
};

}  // namespace fsdp_ext::comm
