// Tagged point-to-point messaging between the ranks of one group over one UCX
// worker. Everything here is non-blocking: post, then test or progress.
// Only the group's progress thread calls into a Transport after set-up.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/ucx_handles.h"

namespace fsdp_ext::comm {

// One posted send or receive. Plain data so algorithms can keep them in
// vectors; the UCX request handle is released by Transport::test once done.
struct Request {
  void* handle = nullptr;
  bool finished = false;
  ucs_status_t status = UCS_OK;
  bool is_recv = false;
  int peer = -1;       // -1: receive from any sender
  uint32_t step = 0;   // algorithm step, for error messages
  size_t bytes = 0;    // bytes posted
  size_t received = 0; // receives: bytes that actually arrived
  uint64_t matched_tag = 0;
  uint64_t posted_tag = 0;  // receives: the tag asked for (with the sender's rank)
};

class Transport {
 public:
  Transport(int rank, int size);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::vector<uint8_t> worker_address() const { return worker_->address(); }
  // Shared so that memory registrations can outlive the transport.
  const std::shared_ptr<UcxContext>& context() const { return context_; }

  // Keeps the exchanged worker addresses (one per rank). The endpoint to a
  // rank is made when the first message goes to it: Note [an endpoint on
  // first use].
  void connect(const std::vector<std::vector<uint8_t>>& addresses);
  // The ranks this one has an endpoint to (it sent them a message), sorted.
  std::vector<int> connected_peers() const;

  void post_send(Request& request, int peer, uint64_t tag, const void* data,
                 size_t bytes);
  // `request.peer` (or -1 for any sender) is set by the caller beforehand.
  void post_recv(Request& request, uint64_t tag, uint64_t tag_mask, void* data,
                 size_t bytes);
  // Updates `request` from UCX; returns whether it has finished.
  bool test(Request& request);
  // Asks UCX to cancel a pending receive; it then finishes as canceled.
  void cancel(Request& request);
  // The tag of a message that arrived and that no receive has taken yet,
  // the first whose tag matches `tag` under `tag_mask`; false if none.
  bool find_unexpected(uint64_t tag, uint64_t tag_mask, uint64_t* found_tag);

  unsigned progress() { return ucp_worker_progress(worker_->get()); }
  int event_fd() const { return worker_->event_fd(); }
  // Arms the wakeup fd. Returns false when events are already pending, in
  // which case the caller must progress instead of sleeping.
  bool arm();

  // The UCX transports the endpoint to `peer` uses, as "name/device" (e.g.
  // "posix/memory", "cma/memory", "tcp/eth0"), sorted and without repeats;
  // from ucp_ep_print_info, the only place UCX 1.13 reports them. Progress
  // thread only, after the endpoint carried a message (lanes are final then);
  // empty for a rank never sent to.
  std::vector<std::string> transports_to(int peer) const;

  // Receives and drops the messages no receive took (Note [messages nobody
  // received]). close_endpoints does it first (a rendezvous message's
  // sender is released through the endpoints), the destructor once more
  // before the worker goes.
  void discard_unexpected();
  // Drops the messages no receive took, flush-closes every endpoint,
  // waiting at most `budget`, then force-closes what is left. Safe to call
  // twice.
  void close_endpoints(std::chrono::milliseconds budget);

 private:
  int rank_;
  int size_;
  std::shared_ptr<UcxContext> context_;
  std::unique_ptr<UcxWorker> worker_;
  // The endpoint to `peer`, made now if this is the first message to it.
  ucp_ep_h endpoint_to(int peer);

  char discard_sink_[1] = {};

  std::vector<std::vector<uint8_t>> addresses_;
  std::vector<ucp_ep_h> endpoints_;  // by rank; null until first used
};

}  // namespace fsdp_ext::comm
