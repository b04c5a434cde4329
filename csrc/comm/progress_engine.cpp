#include "comm/progress_engine.h"

#include "comm/tag_scheme.h"

#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace fsdp_ext::comm {
namespace {

constexpr auto kMaxSleep = std::chrono::milliseconds(100);

int make_event_fd() {
  const int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd < 0) {
    throw CommError(ErrorKind::kTransport,
                    std::string("eventfd failed: ") + std::strerror(errno));
  }
  return fd;
}

int make_epoll(std::initializer_list<int> fds) {
  const int epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd < 0) {
    throw CommError(ErrorKind::kTransport,
                    std::string("epoll_create1 failed: ") + std::strerror(errno));
  }
  for (int fd : fds) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &event) != 0) {
      const int saved = errno;
      close(epoll_fd);
      throw CommError(ErrorKind::kTransport,
                      std::string("epoll_ctl failed: ") + std::strerror(saved));
    }
  }
  return epoll_fd;
}

void signal_event_fd(int fd) {
  const uint64_t one = 1;
  ssize_t ignored = write(fd, &one, sizeof(one));
  (void)ignored;
}

void drain_event_fd(int fd) {
  uint64_t value;
  while (read(fd, &value, sizeof(value)) > 0) {
  }
}

void close_fd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

}  // namespace

ProgressEngine::ProgressEngine(EngineConfig config, std::unique_ptr<Transport> transport)
    : config_(std::move(config)),
      transport_(std::move(transport)),
      scratch_(std::make_unique<ScratchArena>()) {
  submit_event_fd_ = make_event_fd();
  abort_event_fd_ = make_event_fd();
  idle_epoll_fd_ =
      make_epoll({transport_->event_fd(), submit_event_fd_, abort_event_fd_});
  wait_epoll_fd_ = make_epoll({transport_->event_fd(), abort_event_fd_});
  thread_ = std::thread([this] { thread_main(); });
}

ProgressEngine::~ProgressEngine() {
  shutdown();
  close_fd(idle_epoll_fd_);
  close_fd(wait_epoll_fd_);
  close_fd(submit_event_fd_);
  close_fd(abort_event_fd_);
}

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
    outcome.message = describe(op, 0) + ": the process group was already shut down";
    finish(op, outcome);
    return;
  }
  signal_event_fd(submit_event_fd_);
}

void ProgressEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (shut_down_) return;
    shut_down_ = true;
    stop_requested_ = true;
  }
  signal_event_fd(submit_event_fd_);
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
  orphans_.clear();
  transport_.reset();
}

void ProgressEngine::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!aborting_.exchange(true)) abort_reason_ = reason;
  }
  signal_event_fd(abort_event_fd_);
  shutdown();
}

std::string ProgressEngine::broken_reason() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return broken_reason_;
}

void ProgressEngine::mark_broken(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (broken_reason_.empty()) broken_reason_ = reason;
}

std::string ProgressEngine::describe(const EngineOp& op, uint64_t seq) const {
  std::string text = "fsdp_ext " + op.name + " (group '" + config_.group_name +
                     "', rank " + std::to_string(config_.rank) + "/" +
                     std::to_string(config_.size);
  if (seq != 0) text += ", op #" + std::to_string(seq);
  return text + ")";
}

void ProgressEngine::finish(EngineOp& op, const OpOutcome& outcome) {
  // Drop the op's hold on its buffers before completing it, so that when
  // wait() returns, buffers the caller already freed are back in their pool.
  // (Requests still in flight after a failure keep their own reference.)
  op.keepalive.reset();
  if (op.on_done) op.on_done(outcome);
  op.on_done = nullptr;
}

void ProgressEngine::thread_main() {
  auto spin_until = Clock::now() + config_.spin;
  for (;;) {
    EngineOp op;
    bool have_op = false;
    bool stopping = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!queue_.empty()) {
        op = std::move(queue_.front());
        queue_.pop_front();
        have_op = true;
      }
      stopping = stop_requested_;
    }
    if (have_op) {
      run_op(op);
      spin_until = Clock::now() + config_.spin;
      continue;
    }
    if (stopping) {
      // Drained: cancel what can never complete now, then leave.
      poll_in_flight(/*cancel_all=*/true);
      return;
    }
    const unsigned progressed = transport_->progress();
    const bool completed = poll_in_flight(false);
    const auto now = Clock::now();
    if (progressed > 0 || completed) {
      spin_until = now + config_.spin;
      continue;
    }
    if (now < spin_until) {
      sched_yield();
      continue;
    }
    if (!transport_->arm()) continue;
    sleep_on(idle_epoll_fd_, nearest_deadline());
    drain_event_fd(submit_event_fd_);
    spin_until = Clock::now() + config_.spin;
  }
}

void ProgressEngine::run_op(EngineOp& op) {
  ops_run_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t seq = op.collective ? next_seq_++ : 0;
  const std::string description = describe(op, seq);
  OpOutcome failure;
  failure.ok = false;
  if (aborting_) {
    failure.kind = ErrorKind::kAborted;
    failure.message = description + ": aborted (" + abort_reason_ + ")";
    return finish(op, failure);
  }
  const std::string broken = broken_reason();
  if (!broken.empty()) {
    failure.kind = ErrorKind::kBroken;
    failure.message = description +
                      ": the group is unusable after an earlier failure: " + broken;
    return finish(op, failure);
  }
  scratch_->reset();
  const auto deadline = Clock::now() + op.timeout;
  OpContext context(*this, *transport_, *scratch_, description, seq, deadline,
                    op.timeout);
  running_ = &op;
  try {
    op.body(context);
  } catch (const CommError& error) {
    failure.kind = error.kind();
    failure.message = error.what();
  } catch (const std::exception& error) {
    failure.kind = ErrorKind::kTransport;
    failure.message = description + ": " + error.what();
  }
  running_ = nullptr;
  if (!failure.message.empty()) {
    // Peers may still be inside this op: later tags would no longer line up.
    if (op.collective) mark_broken(failure.message);
    orphan_unfinished(context.detached(), op.keepalive, false);
    return finish(op, failure);
  }
  if (!context.detached().empty()) {
    in_flight_.push_back(
        InFlight{std::move(op), std::move(context.detached()), deadline, description});
    return;
  }
  finish(op, OpOutcome{});
}

bool ProgressEngine::poll_in_flight(bool cancel_all) {
  bool any_finished = false;
  const auto now = Clock::now();
  for (size_t i = 0; i < in_flight_.size();) {
    InFlight& entry = in_flight_[i];
    bool all_done = true;
    for (Request& request : entry.requests) {
      if (!transport_->test(request)) all_done = false;
    }
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
    } else if (cancel_all || aborting_ || now >= entry.deadline) {
      outcome.ok = false;
      if (now >= entry.deadline && !cancel_all && !aborting_) {
        outcome.kind = ErrorKind::kTimeout;
        outcome.message = entry.description + ": timed out after " +
                          std::to_string(entry.op.timeout.count()) +
                          " ms waiting for the peer";
      } else {
        outcome.kind = ErrorKind::kAborted;
        outcome.message = entry.description +
                          ": the process group was shut down or aborted with this "
                          "operation pending";
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

void ProgressEngine::sleep_on(int epoll_fd, Clock::time_point wake_by) {
  const auto now = Clock::now();
  const auto remaining =
      std::chrono::duration_cast<std::chrono::milliseconds>(wake_by - now);
  const int timeout_ms =
      static_cast<int>(std::clamp<int64_t>(remaining.count() + 1, 0, kMaxSleep.count()));
  epoll_event events[3];
  epoll_wait(epoll_fd, events, 3, timeout_ms);
}

void ProgressEngine::orphan_unfinished(std::vector<Request>& requests,
                                       std::shared_ptr<void> keepalive,
                                       bool scratch_in_use) {
  // Cancel receives, give UCX a moment to retire them, and keep whatever is
  // still pending (plus the memory it points into) until shutdown.
  for (Request& request : requests) transport_->cancel(request);
  for (int round = 0; round < 100; ++round) {
    transport_->progress();
    bool all_done = true;
    for (Request& request : requests) {
      if (!transport_->test(request)) all_done = false;
    }
    if (all_done) return;
  }
  Orphan orphan;
  for (Request& request : requests) {
    if (!request.finished) orphan.requests.push_back(request);
  }
  orphan.keepalive = std::move(keepalive);
  if (scratch_in_use) {
    orphan.scratch = std::move(scratch_);
    scratch_ = std::make_unique<ScratchArena>();
  }
  orphans_.push_back(std::move(orphan));
}

void ProgressEngine::wait_for(OpContext& context, std::vector<Request>& requests,
                              size_t only) {
  auto spin_until = Clock::now() + config_.spin;
  for (;;) {
    const unsigned progressed = transport_->progress();
    bool all_done = true;
    if (only == kAllRequests) {
      for (Request& request : requests) {
        if (!transport_->test(request)) all_done = false;
      }
    } else {
      all_done = transport_->test(requests[only]);
    }
    if (all_done) break;
    // A request that already failed dooms the op: report it now rather than
    // waiting for the deadline on the others.
    for (Request& request : requests) {
      if (request.finished && request.status != UCS_OK) {
        Request failed = request;
        orphan_unfinished(requests, running_ ? running_->keepalive : nullptr, true);
        check_finished_request(failed, context.description());
      }
    }
    const auto now = Clock::now();
    std::string failure;
    ErrorKind kind = ErrorKind::kTimeout;
    if (aborting_) {
      kind = ErrorKind::kAborted;
      failure = context.description() + ": aborted (" + abort_reason_ + ")";
    } else if (now >= context.deadline()) {
      std::string waiting_on;
      for (const Request& request : requests) {
        if (request.finished) continue;
        waiting_on += waiting_on.empty() ? "" : ", ";
        waiting_on += (request.is_recv ? "receive from rank " : "send to rank ") +
                      std::to_string(request.peer) + " (step " +
                      std::to_string(request.step) + ", " +
                      std::to_string(request.bytes) + " bytes)";
      }
      failure = context.description() + ": timed out after " +
                std::to_string(context.timeout().count()) +
                " ms; still waiting for " + waiting_on +
                ". A peer did not reach this collective (set the timeout with "
                "init_process_group(timeout=...)).";
    }
    if (!failure.empty()) {
      orphan_unfinished(requests, running_ ? running_->keepalive : nullptr, true);
      throw CommError(kind, failure);
    }
    if (progressed > 0) {
      spin_until = now + config_.spin;
      continue;
    }
    // Point-to-point ops posted earlier complete while a collective waits.
    if (poll_in_flight(false)) continue;
    if (now < spin_until) {
      sched_yield();
      continue;
    }
    if (!transport_->arm()) continue;
    sleep_on(wait_epoll_fd_, std::min(context.deadline(), now + kMaxSleep));
  }
  if (only != kAllRequests) {
    const Request& done = requests[only];
    const bool failed = done.status != UCS_OK || (done.is_recv && done.received != done.bytes);
    if (failed) orphan_unfinished(requests, running_ ? running_->keepalive : nullptr, true);
    check_finished_request(done, context.description());
    return;
  }
  for (const Request& request : requests) {
    check_finished_request(request, context.description());
  }
}

}  // namespace fsdp_ext::comm
