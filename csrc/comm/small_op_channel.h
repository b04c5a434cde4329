// The small-op channel: collectives of at most a few KiB among the ranks of
// one host complete through flags in shared memory -- no UCX message, and no
// hand-off to the progress thread when the engine is idle (see
// ProgressEngine::try_take_turn).
//
// Each rank owns a region that its peers map: a header line with `arrived`
// (the number of the last channel op this rank published; the futex word
// peers sleep on), `sleepers` (how many peers sleep on it) and the
// collective numbers of its last channel and UCX ops (see the note on
// straddling sizes below), then two
// slots, used by ops of even and odd number, each a small header (the op's
// number and what the op is) and up to kMaxBytes of this rank's data.
//
// Op n: every rank writes its contribution into its slot n % 2, publishes
// arrived = n, waits until every peer's `arrived` reaches n, and reads the
// peers' slots n % 2. Two slots are enough: a rank writes slot n % 2 again
// only in op n + 2, which it starts after seeing every peer publish n + 1,
// which a peer does only once it has finished reading op n. For the same
// reason every op is a full exchange, even a broadcast, whose root would
// otherwise race ahead and overwrite a slot still being read.
//
// Waiting: poll, yielding the core between polls (with 4 ranks on 2 cores a
// peer that has not run yet may need this one), for the engine's spin time,
// and only then sleep on the slowest peer's futex word, in slices between
// which the deadline and the group's health are checked. The publisher wakes
// sleepers only when `sleepers` says there are any, so a hot exchange costs
// no system call.
//
// Note [a peer that stopped]: a rank whose group failed (a timeout, a
// mismatch it saw first, a lost peer, an abort) starts no channel op again
// (one its caller was already running may still publish). Its `stopped`
// word says so, and a peer waiting for it fails at once, naming it, instead
// of waiting out the timeout.
//
// Every slot header also carries the op's exchange number and the group's
// collective number, and readers compare both with their own before the
// data (out_of_step): ranks whose collectives drifted apart fail, saying
// so, instead of reading a part that belongs to another op.
//
// One op at a time per channel: its owner (the engine's turn holder, see
// progress_engine.h) serialises begin/publish/wait/read.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/shared_memory_segment.h"

namespace fsdp_ext::comm {

// The collectives the channel carries (algorithms/small_ops.h runs them).
enum class SmallOp : uint32_t {
  kAllreduce = 1,
  kAllgather = 2,
  kBroadcast = 3,
  kBarrier = 4,
  kReduceScatter = 5,
};

// What an op is, written by every rank beside its data: ranks compare them
// to catch a peer that called a different collective or another size.
struct ChannelOpKind {
  uint32_t op = 0;      // which collective (small_ops.h numbers them)
  uint32_t detail = 0;  // its dtype / reduce op / root, as the op encodes them
  uint64_t bytes = 0;   // the op's size as every rank must agree on it
  bool operator==(const ChannelOpKind& other) const {
    return op == other.op && detail == other.detail && bytes == other.bytes;
  }
  bool operator!=(const ChannelOpKind& other) const { return !(*this == other); }
};

// "all_reduce (float32 SUM) of 8 bytes": how errors name an op.
std::string describe_small_op(const ChannelOpKind& kind);

// How a blocking wait behaves (SmallOpChannel::wait).
struct ChannelWait {
  std::chrono::steady_clock::time_point deadline;
  std::chrono::milliseconds timeout{0};
  std::chrono::microseconds spin{100};
  // Called between sleeps; throws CommError when the group failed meanwhile
  // (a peer lost, an abort). May be empty.
  std::function<void()> check_health;
  // The op as errors name it, e.g. "fsdp_ext all_reduce (group 'g', rank
  // 0/2, op #7)".
  std::string description;
  // How peers are named in errors ("rank 1 (host h, pid 12)"). May be empty.
  std::function<std::string(int rank)> describe_peer;
  // Appended to a timeout's message: what the other ranks were doing
  // instead (ProgressEngine::explain_timeout). May be empty.
  std::function<std::string()> explain_timeout;
};

class SmallOpChannel {
 public:
  // Per rank and op: what fits in a slot.
  static constexpr size_t kMaxBytes = 64 << 10;

  // Creates this rank's region (zeroed; nothing published yet).
  SmallOpChannel(int rank, int size);
  SmallOpChannel(const SmallOpChannel&) = delete;
  SmallOpChannel& operator=(const SmallOpChannel&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // How peers open this rank's region: /proc/<pid>/<fd>.
  int fd() const { return own_.fd(); }
  static size_t region_bytes();

  // Maps every peer's region (pids and fds by rank; this rank's entries are
  // ignored). Throws CommError if one cannot be mapped.
  void connect(const std::vector<pid_t>& pids, const std::vector<int>& fds);
  bool connected() const { return connected_; }

  // --- one op at a time, by the turn holder ------------------------------
  // Starts the next op, the group's collective number `seq` (the engine's
  // sequence number): returns where this rank's contribution of `bytes` (at
  // most kMaxBytes) goes. The channel's own number is op_number().
  char* begin(const ChannelOpKind& kind, size_t bytes, uint64_t seq);
  // Makes the contribution visible and wakes peers that sleep on it.
  void publish();
  // Whether every peer has published the current op (never blocks).
  bool all_arrived() const;
  // Polls (yielding the core) until every peer published or
  // `until` passes; never sleeps. True when all have arrived.
  bool poll_until(std::chrono::steady_clock::time_point until) const;
  // Blocks until every peer published: polls for `wait.spin`, then sleeps.
  // Throws CommError on timeout (naming the ranks that did not arrive) or
  // when check_health throws.
  void wait(const ChannelWait& wait) const;

  // After all_arrived(): rank r's kind and contribution for the current op.
  const ChannelOpKind& kind_of(int rank) const;
  const char* data_of(int rank) const;
  size_t bytes_of(int rank) const;
  uint32_t op_number() const { return op_number_; }

  // Ranks that have not published the current op yet (for messages).
  std::vector<int> missing() const;

  // After all_arrived(): "" when `peer`'s part is this op's (same exchange
  // and collective numbers), else what differs, for the error.
  std::string out_of_step(int peer) const;

  // This rank will publish no more (its group failed): peers waiting for it
  // fail at once (Note [a peer that stopped]). Any thread; idempotent.
  void mark_stopped();
  // The same at a clean shutdown (Note [a peer that destroyed the group],
  // progress_engine.cpp): its published parts stand, a peer waiting for a
  // later one fails at once, told that the rank destroyed the group.
  void mark_departed();

  // Note [a size that straddles the channel's limit]: ranks whose sizes
  // differ around kMaxBytes disagree on the path, one waiting in the channel
  // and one on UCX messages. Each side looks for the other instead of
  // waiting out the timeout: the engine announces each collective it runs
  // over UCX here, and
  //   - wait() fails with kMismatch when an absent peer announced this op's
  //     sequence number (it runs the op over UCX);
  //   - the engine, waiting on UCX, asks peer_in_channel_op for its op's
  //     number and fails the same way.
  // Progress thread only; harmless (and never matching) before connect.
  void announce_engine_collective(uint64_t seq);
  // "" or "rank 2 called all_reduce (float32 SUM) of 8 bytes": a peer that
  // published collective `seq` in the channel.
  std::string peer_in_channel_op(uint64_t seq) const;

 private:
  char* slot(int rank, uint32_t op_number) const;
  // Whether `peer` has published the current op.
  bool has_arrived(int peer) const;
  // Whether `peer` marked itself stopped (or departed).
  bool has_stopped(int peer) const;
  bool has_departed(int peer) const;
  void mark(uint32_t how);

  int rank_;
  int size_;
  SharedMemorySegment own_;
  std::vector<SharedMemorySegment> peers_;  // by rank; own_ for this rank is not here
  std::vector<char*> regions_;              // by rank, this one included
  bool connected_ = false;
  uint32_t op_number_ = 0;
  uint64_t seq_ = 0;  // the current op's collective number
};

}  // namespace fsdp_ext::comm
