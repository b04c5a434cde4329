// What a collective algorithm sees while it runs on the progress thread:
// its rank and group size, tagged send/receive scoped to this operation, a
// wait that honours the deadline and abort, and scratch memory.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/collective_kind.h"
#include "comm/small_op_channel.h"
#include "comm/transport.h"

namespace fsdp_ext::comm {

class ProgressEngine;
class ScratchArena;
class SharedMemoryDomain;
struct HostTopology;

using Clock = std::chrono::steady_clock;

// Sequence numbers each phase of a hierarchical op reserves (its nested
// begin_next_collective calls: a ring all-reduce's second half, windows of
// very large buckets).
constexpr uint64_t kSeqsPerPhase = 16;

class OpContext {
 public:
  OpContext(ProgressEngine& engine, Transport& transport, ScratchArena& scratch,
            std::string description, uint64_t seq, Clock::time_point deadline,
            std::chrono::milliseconds timeout, CollectiveKind kind = CollectiveKind::kUnnamed);

  // This rank and the group size -- within the sub-group for a phase of a
  // hierarchical op (sub_group), where peers are named by their position.
  int rank() const { return members_ ? member_index_ : transport_.rank(); }
  int size() const {
    return members_ ? static_cast<int>(members_->size()) : transport_.size();
  }
  uint64_t seq() const { return seq_; }
  // What this op is, in its messages' tags (a phase keeps its op's kind).
  CollectiveKind kind() const { return kind_; }
  const std::string& description() const { return description_; }
  Clock::time_point deadline() const { return deadline_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Collective messages: tagged with this op's sequence number and `step`.
  Request send(int peer, uint32_t step, const void* data, size_t bytes);
  Request recv(int peer, uint32_t step, void* data, size_t bytes);

  // User point-to-point messages (dist.send / dist.recv); peer -1 = any.
  Request send_user(int peer, int user_tag, const void* data, size_t bytes);
  Request recv_user(int peer, int user_tag, void* data, size_t bytes);

  // Blocks (progressing, then sleeping on the worker's fd) until every
  // request has finished. Throws CommError on timeout, abort, transport
  // failure or a byte count that differs from the one expected.
  void wait_all(std::vector<Request>& requests);
  // Waits for requests[index] only (to overlap reduction with the other
  // transfers). On failure every unfinished request in the vector is
  // cancelled or orphaned, so none is left pointing at freed memory.
  void wait_one(std::vector<Request>& requests, size_t index);

  // For an op that fails while `requests` are posted but not being waited on
  // (an exception from another phase): cancels them or hands them to the
  // engine with the op's buffers, so none is left writing into memory the
  // caller may free. Safe to call on requests a failed wait already dealt with.
  void abandon(std::vector<Request>& requests);

  // Hands a posted request to the engine; the op completes when it finishes.
  void detach(Request request) { detached_.push_back(request); }
  std::vector<Request>& detached() { return detached_; }

  void* scratch(size_t bytes);

  // The shared memory this context's ranks have in common: the group's when
  // it is on one host (or, in a phase, the host's ranks); null otherwise (then
  // only UCX messages are used).
  SharedMemoryDomain* shared_memory() const;

  // How an op that waits on the small-op channel instead of UCX requests
  // waits: this op's deadline and name, the engine's spin, and the engine
  // kept alive between sleeps (UCX progress, lost peers, abort).
  ChannelWait channel_wait() const;

  // A batch of coalesced collectives runs in one op; each collective after
  // the first takes a fresh sequence number so their tags stay apart.
  void begin_next_collective();

  // The group's shared memory for a phase among this host's ranks (enabled
  // for exactly those in a group over several hosts), or null.
  SharedMemoryDomain* shared_memory_of_host() const;

  // The hosts of a group that spans several with the same number of ranks
  // (at least two) on each: collectives then run hierarchically. Null for
  // other groups and inside a phase.
  const HostTopology* hierarchy() const;
  // The hosts of any group that spans several (equal or not). Null for a
  // group on one host and inside a phase.
  const HostTopology* host_layout() const;
  // Whether this context's ranks are on more than one host: a group that
  // spans hosts, or a phase of one whose members do (a column).
  bool spans_hosts() const;

  // The UCX transports the endpoint to `peer` uses (Transport::transports_to).
  std::vector<std::string> transports_to(int peer) const {
    return transport_.transports_to(global(peer));
  }
  // The group's ranks (global) this rank has sent a message to, and so holds
  // an endpoint to (Transport::connected_peers).
  std::vector<int> connected_peers() const { return transport_.connected_peers(); }

  // A phase of a hierarchical op: `members` (global ranks, this one among
  // them) as a group of their own, with `shared_memory` the domain enabled
  // for exactly those ranks (or null). Reserves a block of sequence numbers
  // on every rank alike, so phases never share tags even when a peer runs
  // ahead into the next one; messages carry global ranks.
  OpContext sub_group(std::vector<int> members, SharedMemoryDomain* shared_memory);

 private:
  ProgressEngine& engine_;
  Transport& transport_;
  ScratchArena& scratch_;
  std::string description_;
  uint64_t seq_;
  Clock::time_point deadline_;
  std::chrono::milliseconds timeout_;
  CollectiveKind kind_;
  std::vector<Request> detached_;
  // Set for a sub-group: its members (global ranks), this rank's position,
  // its shared memory, and the end of its reserved sequence numbers.
  std::shared_ptr<const std::vector<int>> members_;
  int member_index_ = -1;
  SharedMemoryDomain* sub_shared_memory_ = nullptr;
  uint64_t seq_end_ = 0;
  int global(int peer) const { return members_ ? (*members_)[peer] : peer; }
};

// Turns a finished request's status into a CommError (or nothing when it
// succeeded with the expected size). Shared by waits and detached requests.
void check_finished_request(const Request& request, const std::string& description);

}  // namespace fsdp_ext::comm
