#include "comm/progress_engine.h"

#include <sched.h>

#include <algorithm>

#include "comm/small_op_channel.h"
#include "comm/tag_scheme.h"

namespace fsdp_ext::comm {
namespace {

// Longest sleep without a deadline: bounds how late a missed wake-up is noticed.
constexpr auto kMaxSleep = std::chrono::milliseconds(100);
// While requests are pending the engine sleeps this long at first, doubling
// up to kPendingSliceMax: short enough to keep a TCP link busy, long enough
// to leave the core to others (see engine_wakeup.h for why the fd alone is
// not trusted then).
constexpr auto kPendingSliceMin = std::chrono::microseconds(20);
constexpr auto kPendingSliceMax = std::chrono::microseconds(1000);

// After a peer is lost: how long nothing may move before the wait gives up,
// and the most time spent draining.
constexpr auto kLossQuiet = std::chrono::milliseconds(50);
constexpr auto kLossDrainMax = std::chrono::milliseconds(1000);

// Note [a transport failure is often a lost peer]
// A peer that dies inside an op fails this rank's reads of its memory
// (process_vm_readv: "No such process": the kernel drops a process's memory
// before it announces the exit on its pidfd) or its messages, a moment
// before the watchers (pidfd, liveness connection) report the exit. Reported
// as it is, such an error names a pid or a UCX status, not the rank that
// died. So an op that failed in its transport waits up to kLossGrace for a
// watcher to report a lost peer, and then reports that loss, with the
// transport's error after it. A peer that is alive but left the op (its own
// check failed: it sent a notice, then freed the buffers this rank was
// reading, whose reads then fail with "Bad address") is reported the same
// way, by its notice, which says why: a notice counts at once here, without
// the grace that lets a rank's own checks speak first.
constexpr auto kLossGrace = std::chrono::milliseconds(200);

// How often a waiting collective looks for a peer's message of another kind
// (Note [ranks that run different collectives]): a probe of UCX's unexpected
// queue, off the path of an op whose messages keep arriving.
constexpr auto kKindCheckInterval = std::chrono::milliseconds(1);

// How long a failing rank waits for its failure notices to leave before it
// reports its own failure (Note [a failure told to the peers]): they are
// small eager messages, gone at once unless a connection must be made.
constexpr auto kNoticeFlush = std::chrono::milliseconds(300);
// How long a notice received waits before it fails this rank's work: a rank
// that can see the failure itself (it holds the other collective's message,
// its own deadline passed a moment after the peer's) reports it in its own
// words, which name what this rank was doing. Only a rank that cannot see it
// (one that only sends) then reports the peer's notice. Short against any
// timeout; long against the 1 ms between this rank's own checks.
constexpr auto kNoticeGrace = std::chrono::milliseconds(250);

template <typename Finished>
bool drain_after_loss(Transport& transport, Finished&& finished) {
  const auto start = Clock::now();
  auto last_progress = start;
  for (;;) {
    const auto now = Clock::now();
    if (transport.progress() > 0) last_progress = now;
    if (finished()) return true;
    if (now - last_progress > kLossQuiet || now - start > kLossDrainMax) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

bool any_pending(const std::vector<Request>& requests) {
  for (const Request& request : requests) {
    if (!request.finished) return true;
  }
  return false;
}

}  // namespace

ProgressEngine::ProgressEngine(EngineConfig config, std::unique_ptr<Transport> transport)
    : config_(std::move(config)),
      transport_(std::move(transport)),
      scratch_(std::make_unique<ScratchArena>()),
      wakeup_(std::make_unique<EngineWakeup>(transport_->event_fd())) {
  for (int peer = 0; peer < static_cast<int>(config_.peers.size()); ++peer) {
    const PeerInfo& info = config_.peers[peer];
    if (peer != config_.rank && info.same_host && info.pid > 0) {
      wakeup_->watch_process(peer, info.pid);
    }
  }
  for (PeerLiveness::Connection& connection : config_.liveness) {
    wakeup_->watch_socket(connection.rank, connection.socket);
  }
  config_.liveness.clear();
  thread_ = std::thread([this] { thread_main(); });
}

ProgressEngine::~ProgressEngine() { shutdown(); }

void ProgressEngine::submit(EngineOp op) {
  bool refused = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    refused = stop_requested_;
    if (!refused) queue_.push_back(std::move(op));
  }
  if (refused) {
    // Completed outside the lock: the callback may run user code.
    OpOutcome outcome;
    outcome.ok = false;
    outcome.kind = ErrorKind::kAborted;
    outcome.message = describe_op(op.name, 0) + ": the process group was already shut down";
    finish(op, outcome);
    return;
  }
  wakeup_->notify_submitted();
}

void ProgressEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (shut_down_) return;
    shut_down_ = true;
    stop_requested_ = true;
  }
  wakeup_->notify_submitted();
  if (thread_.joinable()) thread_.join();
  // Force-close anything orphaned by a failure before the worker goes away.
  transport_->close_endpoints(std::chrono::milliseconds(1000));
  for (Orphan& orphan : orphans_) {
    for (Request& request : orphan.requests) {
      if (request.handle) {
        ucp_request_free(request.handle);
        request.handle = nullptr;
      }
    }
  }
  // A freed request still moves data while the worker progresses, and the
  // transport's destructor progresses it (Note [messages nobody received]):
  // the orphans' buffers (tensors, scratch, notice payloads) stay alive
  // until the worker is gone.
  transport_.reset();
  orphans_.clear();
}

void ProgressEngine::abort(const std::string& reason) {
  {
    // The reason is written before the flag is raised (release) and never
    // again: the progress thread reads it, without the lock, only after it
    // has seen the flag (found by ThreadSanitizer when the order was reversed).
    std::lock_guard<std::mutex> lock(mutex_);
    if (!aborting_.load(std::memory_order_relaxed)) {
      abort_reason_ = reason;
      aborting_.store(true, std::memory_order_release);
    }
  }
  if (config_.small_ops) config_.small_ops->mark_stopped();
  wakeup_->notify_abort();
  shutdown();
}

ProgressEngine::Turn ProgressEngine::try_take_turn(const char* op) {
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (turn_taken_ || op_running_ || !queue_.empty() || stop_requested_ ||
        !broken_reason_.empty() || aborting_.load(std::memory_order_relaxed)) {
      return Turn();
    }
    turn_taken_ = true;
    // Nothing runs on the progress thread now, so the sequence number is
    // this turn's to take.
    seq = next_seq_++;
  }
  std::lock_guard<std::mutex> lock(activity_mutex_);
  activity_.in_collective = true;
  activity_.seq = seq;
  activity_.op = op;
  return Turn(this, seq);
}

void ProgressEngine::Turn::release(EngineOp* rest) {
  if (engine_ == nullptr) return;
  ProgressEngine& engine = *std::exchange(engine_, nullptr);
  {
    // Handed over, the rest marks itself running again when the engine
    // starts it (run_op), under the same number.
    std::lock_guard<std::mutex> lock(engine.activity_mutex_);
    engine.activity_.in_collective = false;
  }
  bool nudge = false;
  {
    std::lock_guard<std::mutex> lock(engine.mutex_);
    engine.turn_taken_ = false;
    // The progress thread does not leave while a turn is held (see
    // thread_main), so the rest always finds it.
    if (rest != nullptr) {
      rest->continues_seq = seq_;
      engine.queue_.push_front(std::move(*rest));
    }
    // Ops submitted while the turn was held found the engine held back, and
    // it may have gone to sleep since.
    nudge = !engine.queue_.empty() || engine.stop_requested_;
  }
  if (nudge) engine.wakeup_->notify_submitted();
}

void ProgressEngine::Turn::fail(const std::string& message, ErrorKind kind) {
  if (engine_ != nullptr) engine_->mark_broken(message, is_peer_fault(kind));
  release(nullptr);
}

void ProgressEngine::keep_alive_while_waiting(const std::string& description) {
  transport_->progress();
  // Collect what fired on the watched fds without sleeping.
  wakeup_->sleep(Clock::now(), /*wake_on_submit=*/false);
  if (!check_peers().empty()) throw CommError(peer_fault_kind_, description + ": " + peer_fault_);
  if (aborting_) {
    throw CommError(ErrorKind::kAborted, description + ": aborted (" + abort_reason_ + ")");
  }
}

std::string ProgressEngine::broken_reason() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return broken_reason_;
}

void ProgressEngine::mark_broken(const std::string& reason, bool by_peer) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_reason_.empty()) return;
    broken_reason_ = reason;
    broken_by_peer_ = by_peer;
  }
  // Note [a peer that stopped] (small_op_channel.h): peers waiting for this
  // rank in the channel learn it now rather than at their timeout.
  if (config_.small_ops) config_.small_ops->mark_stopped();
}

EngineActivity ProgressEngine::activity() const {
  std::lock_guard<std::mutex> lock(activity_mutex_);
  return activity_;
}

std::string ProgressEngine::describe_peer(int rank) const {
  std::string text = "rank " + std::to_string(rank);
  if (rank < 0 || rank >= static_cast<int>(config_.peers.size())) return text;
  const PeerInfo& info = config_.peers[rank];
  if (info.host.empty() && info.pid == 0) return text;
  text += " (";
  if (!info.host.empty()) text += "host " + info.host;
  if (info.pid > 0) text += std::string(info.host.empty() ? "" : ", ") + "pid " + std::to_string(info.pid);
  return text + ")";
}

std::string ProgressEngine::describe_unmatched(const std::vector<Request>& requests) const {
  std::string text;
  for (const Request& request : requests) {
    if (request.finished) continue;
    text += text.empty() ? "" : "; ";
    if (!request.is_recv) {
      text += "the send of " + std::to_string(request.bytes) + " bytes to " +
              describe_peer(request.peer) + " was not received (no matching recv there)";
    } else if (request.peer < 0) {
      text += "no rank sent to this receive of " + std::to_string(request.bytes) + " bytes";
    } else {
      text += describe_peer(request.peer) + " sent nothing to this receive of " +
              std::to_string(request.bytes) + " bytes (no matching send there)";
    }
  }
  return text.empty() ? std::string("waiting for the peer") : text;
}

// Note [ranks that run different collectives]
// Every collective message carries its op's kind in its tag, so a receive
// never takes the bytes of another collective that a peer runs at the same
// point (the same sequence number): before kinds were in the tags an
// all-reduce on one rank and a broadcast of the same size on another
// exchanged their data without a word. Such a message instead waits,
// unmatched, in the worker; a rank whose collective is stuck on a receive
// looks there (when idle, at most every kKindCheckInterval) for the oldest
// collective message from that peer, and fails naming both collectives when
// it is of another kind and numbered within this op: from the op's sequence
// number to the last one this op has taken so far (its phases take blocks
// of them, and a peer in another collective may be in a phase of another
// number). A message of a later op is not a mismatch: a peer whose part in
// this op was only sends (eager, complete at once) may be ahead; but every
// message it sent in this op reached this rank first (UCX matches one
// sender's messages in order), so its later ops' messages never stand
// before the one awaited here. A rank that only sends (a broadcast's root)
// finds nothing here; the peer it sent to fails at once and tells it (Note
// [a failure told to the peers], failure_notice.h). Shared memory has its
// own check (SharedExchangeKind).
std::string ProgressEngine::describe_other_collective(const std::vector<Request>& requests) {
  const uint64_t first = running_seq_ & tag::kSeqMask;
  const uint64_t span = (next_seq_.load(std::memory_order_relaxed) - running_seq_) & tag::kSeqMask;
  for (const Request& request : requests) {
    if (request.finished || !request.is_recv || request.peer < 0 ||
        (request.posted_tag & tag::kP2PBit) != 0) {
      continue;
    }
    uint64_t found = 0;
    if (!transport_->find_unexpected(request.posted_tag, tag::kMatchCollectiveSender, &found)) {
      continue;
    }
    const CollectiveKind ours = tag::kind_of(request.posted_tag);
    const CollectiveKind theirs = tag::kind_of(found);
    if (theirs == ours) continue;  // a later step of the same op, early
    if (((tag::seq_of(found) - first) & tag::kSeqMask) >= span) continue;  // a later op
    return describe_peer(request.peer) + " is in " + collective_kind_name(theirs) +
           " where this rank is in " + collective_kind_name(ours) +
           " (the ranks called different collectives, or the same ones in another order)";
  }
  return "";
}

std::string ProgressEngine::explain_timeout() const {
  return config_.explain_timeout ? config_.explain_timeout(activity()) : std::string();
}

std::string ProgressEngine::describe_op(const std::string& name, uint64_t seq) const {
  std::string text = "fsdp_ext " + name + " (group '" + config_.group_name +
                     "', rank " + std::to_string(config_.rank) + "/" +
                     std::to_string(config_.size);
  if (seq != 0) text += ", op #" + std::to_string(seq);
  return text + ")";
}

void ProgressEngine::finish(EngineOp& op, const OpOutcome& outcome) {
  // Drop the op's hold on its buffers before completing it, so that when
  // wait() returns, buffers the caller already freed are back in their pool.
  // The body goes too: its closure holds the op's tensors as well, and the op
  // itself is destroyed only after this returns, on this thread, racing the
  // caller's next allocation. (Requests still in flight after a failure keep
  // their own reference.)
  op.keepalive.reset();
  op.body = nullptr;
  op.on_start = nullptr;
  if (op.on_done) op.on_done(outcome);
  op.on_done = nullptr;
}

const std::string& ProgressEngine::check_peers(bool own_transport_failed) {
  if (!peer_fault_.empty()) {
    wakeup_->take_lost_peers();  // the first fault is the one reported
    return peer_fault_;
  }
  const std::vector<EngineWakeup::LostPeer> lost = wakeup_->take_lost_peers();
  // A peer that failed and then exited (its script raised) is reported by
  // its notice, which says why, rather than by its exit. The notice left
  // before the process ended; it may still wait in the worker's queues, so
  // a loss first progresses until nothing more comes (a few rounds) to take
  // it in, and the notice of a peer that is gone does not wait out its
  // grace. A notice from a peer still alive, younger than its grace, while
  // another peer is lost is the loss's consequence (its op failed on the
  // lost peer's transport): the loss is reported. Best effort: a notice
  // still in the kernel's buffers after that loses to the exit.
  if (!lost.empty() && !notice_.has_value()) {
    for (int round = 0; round < 16 && transport_->progress() > 0; ++round) {
    }
  }
  while (!notice_.has_value()) {
    FailureNotice notice;
    if (!notices_.poll(*transport_, &notice)) break;
    if (notice.kind == ErrorKind::kPeerLeft) {
      // Not a failure: the peer's collectives up to notice.seq stand
      // (departed_before). Posted again, so that later notices come in too.
      departed_.emplace(notice.sender, notice.seq);
      notices_.start(*transport_);
      continue;
    }
    notice_ = std::move(notice);
    notice_arrived_ = Clock::now();
  }
  const bool sender_gone =
      notice_.has_value() && std::any_of(lost.begin(), lost.end(), [&](const auto& peer) {
        return peer.rank == notice_->sender;
      });
  const bool grace_over =
      notice_.has_value() &&
      ((own_transport_failed && lost.empty()) || Clock::now() - notice_arrived_ >= kNoticeGrace);
  if (sender_gone || grace_over) {
    const FailureNotice& notice = *notice_;
    peer_fault_ = describe_peer(notice.sender) + " stopped the group after its " +
                  (notice.seq != 0 ? "op #" + std::to_string(notice.seq) : std::string("op")) +
                  " failed there: " + notice.message;
    peer_fault_kind_ = ErrorKind::kPeerFailed;
    mark_broken(peer_fault_, /*by_peer=*/true);
    return peer_fault_;
  }
  std::vector<std::string> losses;
  for (const EngineWakeup::LostPeer& peer : lost) {
    losses.push_back(describe_peer(peer.rank) + " " + peer.how);
  }
  if (!losses.empty()) {
    peer_fault_ = losses.front();
    for (size_t i = 1; i < losses.size(); ++i) peer_fault_ += "; " + losses[i];
    peer_fault_kind_ = ErrorKind::kPeerLost;
    mark_broken(peer_fault_, /*by_peer=*/true);
  }
  return peer_fault_;
}

// Note [a peer that destroyed the group]
// A rank that destroys a group (destroy_process_group, or the group's end)
// while a peer still calls collectives on it leaves that peer waiting for
// the timeout (30 minutes by default): the classic case is uneven data, one
// rank out of batches and done while another runs one more step. Its
// process is alive, so no watcher sees a loss. So a clean shutdown tells the
// peers, with a departure notice (the failure notice's form, kind
// kPeerLeft) carrying the last collective it ran, and marks its small-op
// channel as departed. A peer's collectives up to that one still complete
// (the departed rank took part: its messages are sent); a later one fails
// at once, naming the rank that left and the two collectives' numbers.
// Notices go only to the peers this rank has endpoints to, those it
// exchanged messages with (no connections are made at shutdown); the rank
// that fails first tells the others with its failure notice. Receives
// still take what the departed rank sent (Note [what a lost peer sent
// still arrives]).
void ProgressEngine::announce_departure() {
  if (config_.small_ops) config_.small_ops->mark_departed();
  check_peers();  // departure notices already in: those peers are not told
  std::vector<int> peers;
  for (int peer : transport_->connected_peers()) {
    if (peer != config_.rank && departed_.count(peer) == 0) peers.push_back(peer);
  }
  send_notice(peers, encode_failure_notice(sequences_used(), ErrorKind::kPeerLeft, ""));
}

const std::string& ProgressEngine::departed_before(uint64_t seq) {
  static const std::string kNone;
  if (!peer_fault_.empty() || departed_.empty() || seq == 0) return kNone;
  for (const auto& [peer, last] : departed_) {
    if (last >= seq) continue;
    peer_fault_ = describe_peer(peer) + " destroyed this group (destroy_process_group, or the "
                  "group's end there) after " +
                  (last == 0 ? std::string("running none of its collectives")
                             : "the group's collective #" + std::to_string(last)) +
                  "; collective #" + std::to_string(seq) +
                  " will never be run there (a rank that called more collectives than that "
                  "one, e.g. one more step on uneven data?)";
    peer_fault_kind_ = ErrorKind::kPeerLeft;
    mark_broken(peer_fault_, /*by_peer=*/true);
    return peer_fault_;
  }
  return kNone;
}

void ProgressEngine::tell_peers(uint64_t seq, const OpOutcome& failure) {
  // A collective that failed because a peer departed is a failure to the
  // ranks told of it (kPeerLeft on the wire is a departure: it would not fail them).
  const ErrorKind kind =
      failure.kind == ErrorKind::kPeerLeft ? ErrorKind::kPeerFailed : failure.kind;
  // Not the ranks that destroyed the group: none listens there any more,
  // and a rank this one never talked to would take a new connection to a
  // process that may be gone.
  std::vector<int> peers;
  for (int peer = 0; peer < config_.size; ++peer) {
    if (peer != config_.rank && departed_.count(peer) == 0) peers.push_back(peer);
  }
  send_notice(peers, encode_failure_notice(seq, kind, failure.message));
}

void ProgressEngine::send_notice(const std::vector<int>& peers, std::vector<uint8_t> notice) {
  auto payload = std::make_shared<std::vector<uint8_t>>(std::move(notice));
  std::vector<Request> sends;
  for (int peer : peers) {
    Request request;
    try {
      transport_->post_send(request, peer, tag::failure_notice(config_.rank), payload->data(),
                            payload->size());
    } catch (const std::exception&) {
      continue;  // UCX could not make an endpoint to it: that peer goes untold
    }
    sends.push_back(request);
  }
  const auto until = Clock::now() + kNoticeFlush;
  for (;;) {
    transport_->progress();
    if (test_all(sends) || Clock::now() >= until) break;
    std::this_thread::yield();
  }
  // What has not left yet may still: the payload stays with it.
  orphan_unfinished(sends, payload, false);
}

bool ProgressEngine::test_all(std::vector<Request>& requests) {
  bool all_done = true;
  // Every one is tested (each test updates the request), not only up to the first pending.
  for (Request& request : requests) {
    if (!transport_->test(request)) all_done = false;
  }
  return all_done;
}

ProgressEngine::IdleState ProgressEngine::fresh_idle_state(bool progressed) {
  const auto now = Clock::now();
  if (progressed) cadence_.note_progress(now);
  IdleState state{now + config_.spin, kPendingSliceMin, now, now};
  const Clock::duration gap = cadence_.gap();
  if (gap > config_.spin) {
    state.nap_until = now + gap / 2;
    state.watch_until = now + std::min<Clock::duration>(2 * gap, ProgressCadence::kMaxGap);
  }
  return state;
}

void ProgressEngine::idle_wait(IdleState& state, Clock::time_point until, bool in_op,
                               bool requests_pending) {
  const auto now = Clock::now();
  if (now < state.spin_until) {
    sched_yield();
    return;
  }
  // A stream at a known cadence: awake (spinning) when its next event is due.
  const bool streaming = requests_pending && now < state.watch_until;
  if (streaming && now >= state.nap_until) {
    sched_yield();
    return;
  }
  // Busy: UCX has events queued that arming would lose; progress instead.
  if (!transport_->arm()) return;
  if (streaming) {
    wakeup_->sleep(std::min(until, state.nap_until), /*wake_on_submit=*/!in_op);
    return;
  }
  if (requests_pending) {
    until = std::min(until, now + state.pending_slice);
    state.pending_slice = std::min(state.pending_slice * 2, kPendingSliceMax);
  }
  wakeup_->sleep(std::min(until, now + kMaxSleep), /*wake_on_submit=*/!in_op);
}

void ProgressEngine::thread_main() {
  // Posted here, not in the constructor, so that nothing is posted into the
  // inbox unless this thread is there to retire it. A notice that arrived
  // earlier waits unexpected and matches now.
  notices_.start(*transport_);
  IdleState idle = fresh_idle_state(/*progressed=*/false);
  for (;;) {
    EngineOp op;
    bool have_op = false;
    bool stopping = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // A caller's Turn holds back queued ops: they come after its op.
      if (!queue_.empty() && !turn_taken_) {
        op = std::move(queue_.front());
        queue_.pop_front();
        have_op = true;
        op_running_ = true;
      }
      // Queued ops behind a turn (and its rest) must still run: stay.
      stopping = stop_requested_ && !turn_taken_;
    }
    if (have_op) {
      run_op(op);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        op_running_ = false;
      }
      idle = fresh_idle_state(/*progressed=*/false);
      continue;
    }
    if (stopping) {
      // Drained: cancel what can never complete now, then leave.
      poll_in_flight(/*cancel_all=*/true);
      // Note [a peer that destroyed the group]
      if (!aborting_ && broken_reason().empty()) announce_departure();
      std::vector<Request> inbox{notices_.take_pending()};
      orphan_unfinished(inbox, nullptr, false);
      return;
    }
    const unsigned progressed = transport_->progress();
    check_peers();
    const bool completed = poll_in_flight(false);
    if (progressed > 0 || completed) {
      idle = fresh_idle_state(/*progressed=*/true);
      continue;
    }
    idle_wait(idle, nearest_deadline(), /*in_op=*/false, !in_flight_.empty());
    wakeup_->drain_submitted();
  }
}

void ProgressEngine::run_op(EngineOp& op) {
  ops_run_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t seq = op.continues_seq != 0 ? op.continues_seq : op.collective ? next_seq_++ : 0;
  const std::string description = describe_op(op.name, seq);
  OpOutcome failure;
  failure.ok = false;
  if (aborting_) {
    failure.kind = ErrorKind::kAborted;
    failure.message = description + ": aborted (" + abort_reason_ + ")";
    return finish(op, failure);
  }
  std::string broken;
  bool broken_by_peer = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    broken = broken_reason_;
    broken_by_peer = broken_by_peer_;
  }
  // Note [what a lost peer sent still arrives]
  // A peer that sent a message and then exited (or stopped the group after
  // a failure of its own) completed that send: the message is here, or on
  // its way, and gloo hands it to the receive that comes for it. So a
  // receive still runs on a group that a peer's loss or notice broke: one
  // that matches what arrived completes; any other fails in its wait, at
  // once, with the peer's fault (after draining what is still in flight,
  // drain_after_loss). Collectives stay refused (their tags would no longer
  // line up), and so do sends (UCX may complete a small send to a dead peer
  // locally) and everything after a failure of this rank's own.
  const bool peer_broke_it = !broken.empty() && broken_by_peer;
  if (broken.empty() && op.collective) {
    check_peers();  // a departure notice that came in while idle
    if (const std::string& departed = departed_before(seq); !departed.empty()) {
      failure.kind = ErrorKind::kPeerLeft;
      failure.message = description + ": " + departed;
      // The ranks without an endpoint to the departed one got no notice of
      // it: they learn it from this rank's (Note [a peer that destroyed the group]).
      tell_peers(seq, failure);
      return finish(op, failure);
    }
  }
  if (!broken.empty() && !(op.receive_only && peer_broke_it)) {
    // A lost or failed peer as the first failure keeps its kind; a failure
    // of this rank's own (and faults seen after it) reads as kBroken.
    failure.kind = broken == peer_fault_ ? peer_fault_kind_ : ErrorKind::kBroken;
    failure.message = description +
                      ": the group is unusable after an earlier failure: " + broken;
    return finish(op, failure);
  }
  {
    std::lock_guard<std::mutex> lock(activity_mutex_);
    if (op.collective) {
      activity_.in_collective = true;
      activity_.seq = seq;
      activity_.op = op.name;
    }
  }
  scratch_->reset();
  const auto deadline = Clock::now() + op.timeout;
  OpContext context(*this, *transport_, *scratch_, description, seq, deadline,
                    op.timeout, op.kind);
  running_ = &op;
  running_seq_ = seq;
  if (config_.small_ops && op.collective && !op.small_op) {
    config_.small_ops->announce_engine_collective(seq);
  }
  try {
    if (op.on_start) op.on_start();
    op.body(context);
  } catch (const CommError& error) {
    failure.kind = error.kind();
    // Errors of the op's own checks carry a description of it ("fsdp_ext
    // <op> (group ...)") already; those of the layers below (an endpoint, a
    // shared segment) name neither the op nor the group nor the rank.
    const std::string what = error.what();
    failure.message = what.rfind("fsdp_ext ", 0) == 0 ? what : description + ": " + what;
  } catch (const std::exception& error) {
    failure.kind = ErrorKind::kTransport;
    failure.message = description + ": " + error.what();
  }
  if (failure.kind == ErrorKind::kTransport && !failure.message.empty()) {
    // Note [a transport failure is often a lost peer]
    const auto until = Clock::now() + kLossGrace;
    while (check_peers(/*own_transport_failed=*/true).empty() && Clock::now() < until) {
      wakeup_->sleep(until, /*wake_on_submit=*/false);
    }
    if (!peer_fault_.empty()) {
      failure.kind = peer_fault_kind_;
      failure.message = description + ": " + peer_fault_ + " (this rank's op then failed: " +
                        failure.message + ")";
    }
  }
  running_ = nullptr;
  {
    std::lock_guard<std::mutex> lock(activity_mutex_);
    activity_.in_collective = false;
  }
  if (!failure.message.empty()) {
    // Peers may still be inside this op: later tags would no longer line up.
    if (op.collective) {
      mark_broken(failure.message, is_peer_fault(failure.kind));
      // Note [a failure told to the peers]: not for a peer's loss or notice
      // (each rank sees those itself) nor for an abort (this rank's choice).
      const ErrorKind kind = failure.kind;
      if (kind != ErrorKind::kPeerLost && kind != ErrorKind::kPeerFailed &&
          kind != ErrorKind::kAborted && kind != ErrorKind::kBroken) {
        tell_peers(seq, failure);
      }
    }
    orphan_unfinished(context.detached(), op.keepalive, false);
    return finish(op, failure);
  }
  if (!context.detached().empty()) {
    in_flight_.push_back(
        InFlight{std::move(op), std::move(context.detached()), deadline, description});
    return;
  }
  {
    // Idle from here on: the caller that this completion wakes may take
    // the turn for its next small op at once instead of queueing it.
    std::lock_guard<std::mutex> lock(mutex_);
    op_running_ = false;
  }
  finish(op, OpOutcome{});
}

bool ProgressEngine::poll_in_flight(bool cancel_all) {
  bool any_finished = false;
  const auto now = Clock::now();
  for (size_t i = 0; i < in_flight_.size();) {
    InFlight& entry = in_flight_[i];
    const bool all_done = test_all(entry.requests);
    OpOutcome outcome;
    if (all_done) {
      try {
        for (const Request& request : entry.requests) {
          check_finished_request(request, entry.description);
          if (request.is_recv && request.peer < 0) {
            outcome.source_rank = tag::sender_of(request.matched_tag);
          }
        }
      } catch (const CommError& error) {
        outcome.ok = false;
        outcome.kind = error.kind();
        outcome.message = error.what();
      }
    } else if (!cancel_all && !aborting_ && !peer_fault_.empty() && entry.op.receive_only &&
               !drained_for_receives_) {
      // Note [what a lost peer sent still arrives]: what the peer sent may
      // still be on its way (in a socket when its exit was seen). Once per
      // fault, as wait_for does for collectives; then this entry again.
      drained_for_receives_ = true;
      drain_after_loss(*transport_, [&] { return test_all(entry.requests); });
      continue;
    } else if (cancel_all || aborting_ || !peer_fault_.empty() || now >= entry.deadline) {
      outcome.ok = false;
      if (cancel_all || aborting_) {
        outcome.kind = ErrorKind::kAborted;
        outcome.message = entry.description +
                          ": the process group was shut down or aborted with this "
                          "operation pending";
      } else if (!peer_fault_.empty()) {
        outcome.kind = peer_fault_kind_;
        outcome.message = entry.description + ": " + peer_fault_;
      } else {
        outcome.kind = ErrorKind::kTimeout;
        outcome.message = entry.description + ": timed out after " +
                          std::to_string(entry.op.timeout.count()) + " ms; " +
                          describe_unmatched(entry.requests) +
                          " (set the timeout with init_process_group(timeout=...))";
      }
      orphan_unfinished(entry.requests, entry.op.keepalive, false);
    } else {
      ++i;
      continue;
    }
    EngineOp op = std::move(entry.op);
    in_flight_.erase(in_flight_.begin() + static_cast<long>(i));
    finish(op, outcome);
    any_finished = true;
  }
  return any_finished;
}

Clock::time_point ProgressEngine::nearest_deadline() const {
  auto wake_by = Clock::now() + kMaxSleep;
  for (const InFlight& entry : in_flight_) wake_by = std::min(wake_by, entry.deadline);
  return wake_by;
}

void ProgressEngine::abandon(std::vector<Request>& requests) {
  orphan_unfinished(requests, running_ ? running_->keepalive : nullptr, true);
}

void ProgressEngine::orphan_unfinished(std::vector<Request>& requests,
                                       std::shared_ptr<void> keepalive,
                                       bool scratch_in_use) {
  // Cancel receives, give UCX a moment to retire them, and keep whatever is
  // still pending (plus the memory it points into) until shutdown.
  for (Request& request : requests) transport_->cancel(request);
  for (int round = 0; round < 100; ++round) {
    transport_->progress();
    if (test_all(requests)) return;
  }
  Orphan orphan;
  for (Request& request : requests) {
    if (request.finished) continue;
    orphan.requests.push_back(request);
    // The orphan owns the handle now: the caller's copy must never test,
    // cancel or free it again.
    request.finished = true;
    request.status = UCS_ERR_CANCELED;
    request.handle = nullptr;
  }
  orphan.keepalive = std::move(keepalive);
  if (scratch_in_use) {
    orphan.scratch = std::move(scratch_);
    scratch_ = std::make_unique<ScratchArena>();
  }
  orphans_.push_back(std::move(orphan));
}

void ProgressEngine::wait_for(const std::string& description, Clock::time_point deadline,
                              std::chrono::milliseconds timeout,
                              std::vector<Request>& requests, size_t only) {
  auto finished = [&] {
    if (only != kAllRequests) return transport_->test(requests[only]);
    return test_all(requests);
  };
  auto fail = [&](ErrorKind kind, const std::string& message) {
    orphan_unfinished(requests, running_ ? running_->keepalive : nullptr, true);
    throw CommError(kind, message);
  };
  IdleState idle = fresh_idle_state(/*progressed=*/false);
  Clock::time_point next_kind_check{};
  for (;;) {
    const unsigned progressed = transport_->progress();
    if (finished()) break;
    // A request that already failed dooms the op: report it now rather than
    // waiting for the deadline on the others.
    for (Request& request : requests) {
      if (request.finished && request.status != UCS_OK) {
        // A peer that was lost explains the failure better than UCX's status.
        if (!check_peers().empty()) fail(peer_fault_kind_, description + ": " + peer_fault_);
        Request failed = request;
        orphan_unfinished(requests, running_ ? running_->keepalive : nullptr, true);
        check_finished_request(failed, description);
      }
    }
    if (running_ && running_->collective && !departed_before(running_seq_).empty()) {
      fail(ErrorKind::kPeerLeft, description + ": " + peer_fault_);
    }
    if (!check_peers().empty()) {
      // What the lost peer sent before it went may still be on its way (its
      // liveness connection can close before its last data is read here):
      // keep progressing until nothing has moved for kLossQuiet.
      if (drain_after_loss(*transport_, finished)) break;
      fail(peer_fault_kind_, description + ": " + peer_fault_);
    }
    const auto now = Clock::now();
    if (aborting_) fail(ErrorKind::kAborted, description + ": aborted (" + abort_reason_ + ")");
    if (now >= deadline) {
      std::string waiting_on;
      for (const Request& request : requests) {
        if (request.finished) continue;
        waiting_on += waiting_on.empty() ? "" : ", ";
        waiting_on += (request.is_recv ? "receive from " : "send to ") +
                      (request.peer < 0 ? std::string("any rank") : describe_peer(request.peer)) +
                      " (step " + std::to_string(request.step) + ", " +
                      std::to_string(request.bytes) + " bytes)";
      }
      const std::string peers =
          running_ != nullptr && running_->collective ? explain_timeout() : std::string();
      fail(ErrorKind::kTimeout,
           description + ": timed out after " + std::to_string(timeout.count()) +
               " ms; still waiting for " + waiting_on +
               ". A peer did not reach this collective (set the timeout with "
               "init_process_group(timeout=...))." + peers);
    }
    if (progressed > 0) {
      idle = fresh_idle_state(/*progressed=*/true);
      continue;
    }
    // Note [a size that straddles the channel's limit] (small_op_channel.h).
    if (config_.small_ops && running_ != nullptr && running_->collective && !running_->small_op) {
      const std::string peer = config_.small_ops->peer_in_channel_op(running_seq_);
      if (!peer.empty()) {
        fail(ErrorKind::kMismatch,
             description + ": " + peer + " through the small-op channel (at most " +
                 std::to_string(SmallOpChannel::kMaxBytes) + " bytes per rank) where rank " +
                 std::to_string(config_.rank) +
                 " runs this collective over UCX messages: the ranks' sizes differ, or a "
                 "forced FSDP_EXT_*_ALGO that not every rank set");
      }
    }
    // Note [ranks that run different collectives]
    if (running_ != nullptr && running_->collective && now >= next_kind_check) {
      next_kind_check = now + kKindCheckInterval;
      const std::string other = describe_other_collective(requests);
      if (!other.empty()) fail(ErrorKind::kMismatch, description + ": " + other);
    }
    // Point-to-point ops posted earlier complete while a collective waits.
    if (poll_in_flight(false)) continue;
    idle_wait(idle, deadline, /*in_op=*/true, any_pending(requests));
  }
  if (only != kAllRequests) {
    const Request& done = requests[only];
    const bool failed = done.status != UCS_OK || (done.is_recv && done.received != done.bytes);
    if (failed) orphan_unfinished(requests, running_ ? running_->keepalive : nullptr, true);
    check_finished_request(done, description);
    return;
  }
  for (const Request& request : requests) check_finished_request(request, description);
}

}  // namespace fsdp_ext::comm
