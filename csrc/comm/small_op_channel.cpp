#include "comm/small_op_channel.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>

#include "comm/data_type.h"
#include "comm/error.h"

namespace fsdp_ext::comm {
namespace {

using Clock = std::chrono::steady_clock;

// Region layout (offsets in bytes). The header line holds the two futex
// words; each slot starts on its own cache lines.
constexpr size_t kArrivedOffset = 0;
constexpr size_t kSleepersOffset = 4;
constexpr size_t kChannelSeqOffset = 8;  // uint64: collective number of the last published op
constexpr size_t kEngineSeqOffset = 16;  // uint64: the last collective begun over UCX
constexpr size_t kStoppedOffset = 24;    // uint32: kStopped or kDeparted, 0 while neither
constexpr uint32_t kStopped = 1;         // this rank's group failed (or was aborted)
constexpr uint32_t kDeparted = 2;        // this rank destroyed the group (a clean shutdown)
constexpr size_t kHeaderLine = 64;
struct SlotHeader {
  uint32_t op_number;
  uint32_t data_bytes;
  ChannelOpKind kind;
  uint64_t seq;  // the group's collective number of the op (the engine's)
};
constexpr size_t kSlotData = 64;  // the data starts one line into the slot
static_assert(sizeof(SlotHeader) <= kSlotData);
constexpr size_t kSlotStride = kSlotData + SmallOpChannel::kMaxBytes;

// The longest single sleep on a futex word: bounds how late the deadline and
// the group's health are looked at.
constexpr auto kSleepSlice = std::chrono::milliseconds(1);

std::atomic_ref<uint32_t> word_at(char* region, size_t offset) {
  return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(region + offset));
}

std::atomic_ref<uint64_t> seq_at(char* region, size_t offset) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(region + offset));
}

// Op numbers wrap; `published` has reached `wanted` when it is at most 2^31
// ahead of it.
bool reached(uint32_t published, uint32_t wanted) {
  return static_cast<int32_t>(published - wanted) >= 0;
}

// Sleeps while *word == seen, at most `timeout`, on a futex shared between
// processes (the region is a MAP_SHARED mapping, so no FUTEX_PRIVATE_FLAG).
void futex_sleep(uint32_t* word, uint32_t seen, Clock::duration timeout) {
  const auto nanos = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  if (nanos <= 0) return;
  const timespec relative{static_cast<time_t>(nanos / 1000000000),
                          static_cast<long>(nanos % 1000000000)};
  // EAGAIN (the word changed), EINTR and ETIMEDOUT all mean: look again.
  syscall(SYS_futex, word, FUTEX_WAIT, seen, &relative, nullptr, 0);
}

void futex_wake_all(uint32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

}  // namespace

size_t SmallOpChannel::region_bytes() { return round_up_to_pages(kHeaderLine + 2 * kSlotStride); }

SmallOpChannel::SmallOpChannel(int rank, int size)
    : rank_(rank),
      size_(size),
      own_(SharedMemorySegment::create(region_bytes(), "fsdp_ext-small-ops")),
      peers_(static_cast<size_t>(size)),
      regions_(static_cast<size_t>(size), nullptr) {
  regions_[rank_] = static_cast<char*>(own_.data());
}

void SmallOpChannel::connect(const std::vector<pid_t>& pids, const std::vector<int>& fds) {
  if (static_cast<int>(pids.size()) != size_ || static_cast<int>(fds.size()) != size_) {
    throw CommError(ErrorKind::kMismatch,
                    "small-op channel: " + std::to_string(pids.size()) + " pids and " +
                        std::to_string(fds.size()) + " fds for a group of " +
                        std::to_string(size_));
  }
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    peers_[peer] = SharedMemorySegment::open_peer(pids[peer], fds[peer], region_bytes());
    regions_[peer] = static_cast<char*>(peers_[peer].data());
  }
  connected_ = true;
}

char* SmallOpChannel::slot(int rank, uint32_t op_number) const {
  return regions_[rank] + kHeaderLine + (op_number % 2) * kSlotStride;
}

char* SmallOpChannel::begin(const ChannelOpKind& kind, size_t bytes, uint64_t seq) {
  if (bytes > kMaxBytes) {
    throw CommError(ErrorKind::kMismatch, "small-op channel: a contribution of " +
                                              std::to_string(bytes) + " bytes exceeds the " +
                                              std::to_string(kMaxBytes) + "-byte slot");
  }
  ++op_number_;
  seq_ = seq;
  char* own = slot(rank_, op_number_);
  SlotHeader header{op_number_, static_cast<uint32_t>(bytes), kind, seq};
  std::memcpy(own, &header, sizeof(header));
  return own + kSlotData;
}

void SmallOpChannel::publish() {
  char* region = regions_[rank_];
  // seq_cst store, then seq_cst load of `sleepers`: paired with the
  // sleeper's increment-then-load in wait(), one of the two sides always
  // sees the other, so no wake-up is lost.
  word_at(region, kArrivedOffset).store(op_number_, std::memory_order_seq_cst);
  // After `arrived`: whoever sees this number also sees the op's slot
  // (peer_in_channel_op).
  seq_at(region, kChannelSeqOffset).store(seq_, std::memory_order_release);
  if (word_at(region, kSleepersOffset).load(std::memory_order_seq_cst) != 0) {
    futex_wake_all(reinterpret_cast<uint32_t*>(region + kArrivedOffset));
  }
}

bool SmallOpChannel::has_arrived(int peer) const {
  // Acquire: the peer's slot, written before it published, is visible now.
  return reached(word_at(regions_[peer], kArrivedOffset).load(std::memory_order_acquire),
                 op_number_);
}

bool SmallOpChannel::all_arrived() const {
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_ && !has_arrived(peer)) return false;
  }
  return true;
}

std::vector<int> SmallOpChannel::missing() const {
  std::vector<int> out;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_ && !has_arrived(peer)) out.push_back(peer);
  }
  return out;
}

bool SmallOpChannel::poll_until(Clock::time_point until) const {
  // Yield between polls from the start: it costs ~0.3 us when nothing else
  // wants this core, and runs a peer that shares it at once. Measured, 8 B
  // all-reduce: 2 ranks pinned to one core 15.5 us (17.3 us with a 2 us
  // pause-spin first), 2 ranks on 2 cores no slower, 4 ranks on 2 cores
  // 18 us (20 us).
  while (!all_arrived()) {
    if (Clock::now() >= until) return false;
    sched_yield();
  }
  return true;
}

void SmallOpChannel::wait(const ChannelWait& wait) const {
  if (poll_until(std::min(wait.deadline, Clock::now() + wait.spin))) return;
  for (;;) {
    if (wait.check_health) wait.check_health();
    const std::vector<int> absent = missing();
    if (absent.empty()) return;
    const auto now = Clock::now();
    if (now >= wait.deadline) {
      std::string who;
      for (int peer : absent) {
        who += (who.empty() ? "" : ", ") +
               (wait.describe_peer ? wait.describe_peer(peer) : "rank " + std::to_string(peer));
      }
      throw CommError(ErrorKind::kTimeout,
                      wait.description + ": timed out after " +
                          std::to_string(wait.timeout.count()) + " ms; still waiting for " +
                          who + " to publish its part (small-op channel, exchange " +
                          std::to_string(op_number_) +
                          "). A peer did not reach this collective (set the timeout with "
                          "init_process_group(timeout=...))." +
                          (wait.explain_timeout ? wait.explain_timeout() : std::string()));
    }
    // Note [a size that straddles the channel's limit] (the header).
    for (int peer : absent) {
      if (seq_ != 0 &&
          seq_at(regions_[peer], kEngineSeqOffset).load(std::memory_order_relaxed) == seq_) {
        throw CommError(ErrorKind::kMismatch,
                        wait.description + ": rank " + std::to_string(peer) +
                            " runs this collective over UCX messages where rank " +
                            std::to_string(rank_) + " called " +
                            describe_small_op(kind_of(rank_)) +
                            " through the small-op channel (at most " +
                            std::to_string(kMaxBytes) +
                            " bytes per rank): the ranks' sizes differ, or a forced "
                            "FSDP_EXT_*_ALGO that not every rank set");
      }
    }
    // Note [a peer that stopped] (the header); after the straddle check,
    // whose message says more.
    for (int peer : absent) {
      // Seen stopped, then looked at again: a peer that published this op
      // (its last) and departed since `absent` was taken took part. Its
      // `arrived` is stored before `stopped`, so the load that saw the
      // latter sees the former.
      if (has_stopped(peer) && !has_arrived(peer)) {
        const bool departed = has_departed(peer);
        throw CommError(departed ? ErrorKind::kPeerLeft : ErrorKind::kBroken,
                        wait.description + ": " +
                            (wait.describe_peer ? wait.describe_peer(peer)
                                                : "rank " + std::to_string(peer)) +
                            " has not published its part of " + describe_small_op(kind_of(rank_)) +
                            " (small-op channel, exchange " + std::to_string(op_number_) +
                            (departed
                                 ? "): that rank destroyed this group (destroy_process_group, or "
                                   "the group's end there) before this collective (a rank that "
                                   "called more collectives than it, e.g. one more step on "
                                   "uneven data?), so this op cannot complete"
                                 : "): that rank has stopped taking part in this group (an "
                                   "earlier failure or an abort there; its own error says "
                                   "which), so this op cannot complete"));
      }
    }
    // Sleep on the first absent peer; the others are looked at when it wakes.
    char* region = regions_[absent.front()];
    auto sleepers = word_at(region, kSleepersOffset);
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = word_at(region, kArrivedOffset).load(std::memory_order_seq_cst);
    // A peer that marked itself stopped after the look above is not waited
    // for through a whole slice (mark_stopped wakes only its own sleepers).
    const bool stopped = std::any_of(absent.begin(), absent.end(),
                                     [&](int peer) { return has_stopped(peer); });
    if (!stopped && !reached(seen, op_number_)) {
      futex_sleep(reinterpret_cast<uint32_t*>(region + kArrivedOffset), seen,
                  std::min<Clock::duration>(wait.deadline - now, kSleepSlice));
    }
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void SmallOpChannel::mark_stopped() { mark(kStopped); }

void SmallOpChannel::mark_departed() { mark(kDeparted); }

void SmallOpChannel::mark(uint32_t how) {
  char* region = regions_[rank_];
  // The first says why: a failure then a shutdown stays a failure.
  uint32_t none = 0;
  word_at(region, kStoppedOffset).compare_exchange_strong(none, how, std::memory_order_seq_cst);
  // Peers may sleep on `arrived`, which will not move again: wake them so
  // that they look at `stopped` now rather than at their next slice.
  if (word_at(region, kSleepersOffset).load(std::memory_order_seq_cst) != 0) {
    futex_wake_all(reinterpret_cast<uint32_t*>(region + kArrivedOffset));
  }
}

bool SmallOpChannel::has_stopped(int peer) const {
  return word_at(regions_[peer], kStoppedOffset).load(std::memory_order_acquire) != 0;
}

bool SmallOpChannel::has_departed(int peer) const {
  return word_at(regions_[peer], kStoppedOffset).load(std::memory_order_acquire) == kDeparted;
}

std::string SmallOpChannel::out_of_step(int peer) const {
  const auto* mine = reinterpret_cast<const SlotHeader*>(slot(rank_, op_number_));
  const auto* theirs = reinterpret_cast<const SlotHeader*>(slot(peer, op_number_));
  if (theirs->op_number == mine->op_number && theirs->seq == mine->seq) return "";
  return "rank " + std::to_string(peer) + "'s part is its exchange " +
         std::to_string(theirs->op_number) + " (the group's collective #" +
         std::to_string(theirs->seq) + ", " + describe_small_op(theirs->kind) +
         ") where rank " + std::to_string(rank_) + " is at exchange " +
         std::to_string(mine->op_number) + " (collective #" + std::to_string(mine->seq) + ", " +
         describe_small_op(mine->kind) +
         "): the ranks' collectives on this group are out of step (one rank issued a "
         "collective the other did not)";
}

void SmallOpChannel::announce_engine_collective(uint64_t seq) {
  seq_at(regions_[rank_], kEngineSeqOffset).store(seq, std::memory_order_relaxed);
}

std::string SmallOpChannel::peer_in_channel_op(uint64_t seq) const {
  if (!connected_ || seq == 0) return "";
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    if (seq_at(regions_[peer], kChannelSeqOffset).load(std::memory_order_acquire) != seq) continue;
    // Stored after `arrived` (publish): this is the op that carries `seq`.
    const uint32_t published =
        word_at(regions_[peer], kArrivedOffset).load(std::memory_order_relaxed);
    const auto* header = reinterpret_cast<const SlotHeader*>(slot(peer, published));
    return "rank " + std::to_string(peer) + " called " + describe_small_op(header->kind);
  }
  return "";
}

std::string describe_small_op(const ChannelOpKind& kind) {
  std::string what;
  switch (static_cast<SmallOp>(kind.op)) {
    case SmallOp::kAllreduce:
      what = std::string("all_reduce (") + data_type_name(static_cast<DataType>(kind.detail & 0xff)) +
             " " + reduce_kind_name(static_cast<ReduceKind>((kind.detail >> 8) & 0xff)) + ")";
      break;
    case SmallOp::kAllgather:
      what = "all_gather";
      break;
    case SmallOp::kReduceScatter:
      what = std::string("reduce_scatter (") +
             data_type_name(static_cast<DataType>(kind.detail & 0xff)) + " " +
             reduce_kind_name(static_cast<ReduceKind>((kind.detail >> 8) & 0xff)) + ")";
      break;
    case SmallOp::kBroadcast:
      what = "broadcast (root " + std::to_string(kind.detail) + ")";
      break;
    case SmallOp::kBarrier:
      return "barrier";
    default:
      return "an unknown op (" + std::to_string(kind.op) + ")";
  }
  if (const uint32_t members = kind.detail >> 16; members > 0) {
    what += ", a bucket of " + std::to_string(members);
  }
  return what + " of " + std::to_string(kind.bytes) + " bytes";
}

const ChannelOpKind& SmallOpChannel::kind_of(int rank) const {
  return reinterpret_cast<const SlotHeader*>(slot(rank, op_number_))->kind;
}

const char* SmallOpChannel::data_of(int rank) const { return slot(rank, op_number_) + kSlotData; }

size_t SmallOpChannel::bytes_of(int rank) const {
  return reinterpret_cast<const SlotHeader*>(slot(rank, op_number_))->data_bytes;
}

}  // namespace fsdp_ext::comm
