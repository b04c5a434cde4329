#include "comm/op_context.h"

#include <algorithm>

#include "comm/error.h"
#include "comm/progress_engine.h"
#include "comm/scratch_arena.h"
#include "comm/shared_memory_domain.h"
#include "comm/tag_scheme.h"

namespace fsdp_ext::comm {
namespace {
// UCX wants a valid address even for 0-byte messages, and empty tensors may
// have none.
char zero_length_target;
const void* usable(const void* data) { return data ? data : &zero_length_target; }
void* usable(void* data) { return data ? data : &zero_length_target; }
}  // namespace

OpContext::OpContext(ProgressEngine& engine, Transport& transport,
                     ScratchArena& scratch, std::string description, uint64_t seq,
                     Clock::time_point deadline, std::chrono::milliseconds timeout,
                     CollectiveKind kind)
    : engine_(engine),
      transport_(transport),
      scratch_(scratch),
      description_(std::move(description)),
      seq_(seq),
      deadline_(deadline),
      timeout_(timeout),
      kind_(kind) {}

ChannelWait OpContext::channel_wait() const {
  ChannelWait wait;
  wait.deadline = deadline_;
  wait.timeout = timeout_;
  wait.spin = engine_.config().spin;
  wait.description = description_;
  ProgressEngine* engine = &engine_;
  wait.check_health = [engine, description = description_] {
    engine->keep_alive_while_waiting(description);
  };
  wait.describe_peer = [engine](int peer) { return engine->describe_peer(peer); };
  wait.explain_timeout = [engine] { return engine->explain_timeout(); };
  return wait;
}

Request OpContext::send(int peer, uint32_t step, const void* data, size_t bytes) {
  Request request;
  transport_.post_send(request, global(peer),
                       tag::collective(seq_, step, transport_.rank(), kind_), usable(data),
                       bytes);
  request.step = step;
  return request;
}

Request OpContext::recv(int peer, uint32_t step, void* data, size_t bytes) {
  Request request;
  request.peer = global(peer);
  request.posted_tag = tag::collective(seq_, step, global(peer), kind_);
  transport_.post_recv(request, request.posted_tag, tag::kMatchAll, usable(data), bytes);
  request.step = step;
  return request;
}

Request OpContext::send_user(int peer, int user_tag, const void* data, size_t bytes) {
  Request request;
  transport_.post_send(request, peer, tag::point_to_point(user_tag, rank()),
                       usable(data), bytes);
  return request;
}

Request OpContext::recv_user(int peer, int user_tag, void* data, size_t bytes) {
  Request request;
  request.peer = peer;
  const bool any = peer < 0;
  request.posted_tag = tag::point_to_point(user_tag, any ? 0 : peer);
  transport_.post_recv(request, request.posted_tag,
                       any ? tag::kMatchAnySender : tag::kMatchAll, usable(data), bytes);
  return request;
}

void OpContext::wait_all(std::vector<Request>& requests) {
  engine_.wait_for(description_, deadline_, timeout_, requests, kAllRequests);
}

void OpContext::wait_one(std::vector<Request>& requests, size_t index) {
  engine_.wait_for(description_, deadline_, timeout_, requests, index);
}

void OpContext::abandon(std::vector<Request>& requests) { engine_.abandon(requests); }

void* OpContext::scratch(size_t bytes) { return scratch_.allocate(bytes); }

SharedMemoryDomain* OpContext::shared_memory() const {
  if (members_) {
    return sub_shared_memory_ && sub_shared_memory_->enabled() ? sub_shared_memory_ : nullptr;
  }
  // A group over several hosts enables its domain for each host's ranks:
  // only a phase within one host may use it.
  if (engine_.config().topology.hosts.size() > 1) return nullptr;
  return shared_memory_of_host();
}

void OpContext::begin_next_collective() {
  if (!members_) {
    seq_ = engine_.allocate_seq();
    return;
  }
  if (++seq_ >= seq_end_) {
    throw CommError(ErrorKind::kTransport,
                    description_ + ": a phase of this hierarchical collective needed more than " +
                        std::to_string(kSeqsPerPhase) + " sequence numbers (a bucket this large "
                        "is not supported across hosts; split it)");
  }
}

SharedMemoryDomain* OpContext::shared_memory_of_host() const {
  SharedMemoryDomain* domain = engine_.config().shared_memory.get();
  return domain && domain->enabled() ? domain : nullptr;
}

const HostTopology* OpContext::hierarchy() const {
  const HostTopology& topology = engine_.config().topology;
  return !members_ && topology.hierarchical() ? &topology : nullptr;
}

const HostTopology* OpContext::host_layout() const {
  const HostTopology& topology = engine_.config().topology;
  return !members_ && topology.hosts.size() > 1 ? &topology : nullptr;
}

bool OpContext::spans_hosts() const {
  const HostTopology& topology = engine_.config().topology;
  if (topology.hosts.size() < 2) return false;
  if (!members_) return true;
  const int first = topology.position_of(members_->front()).host;
  return std::any_of(members_->begin(), members_->end(),
                     [&](int rank) { return topology.position_of(rank).host != first; });
}

OpContext OpContext::sub_group(std::vector<int> members, SharedMemoryDomain* shared_memory) {
  OpContext phase(engine_, transport_, scratch_, description_, engine_.reserve_seqs(kSeqsPerPhase),
                  deadline_, timeout_, kind_);
  phase.seq_end_ = phase.seq_ + kSeqsPerPhase;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == transport_.rank()) phase.member_index_ = static_cast<int>(i);
  }
  phase.members_ = std::make_shared<const std::vector<int>>(std::move(members));
  phase.sub_shared_memory_ = shared_memory;
  return phase;
}

void check_finished_request(const Request& request, const std::string& description) {
  const std::string peer =
      request.peer < 0 ? std::string("any rank") : "rank " + std::to_string(request.peer);
  const char* direction = request.is_recv ? "receive from " : "send to ";
  if (request.status == UCS_ERR_MESSAGE_TRUNCATED) {
    throw CommError(ErrorKind::kMismatch,
                    description + ": " + peer + " sent more than the " +
                        std::to_string(request.bytes) +
                        " bytes this rank expected (tensor sizes differ between ranks)");
  }
  if (request.status == UCS_ERR_CANCELED) {
    throw CommError(ErrorKind::kAborted,
                    description + ": " + direction + peer + " was canceled");
  }
  if (request.status != UCS_OK) {
    throw CommError(ErrorKind::kTransport, description + ": " + direction + peer +
                                               " failed: " +
                                               ucs_status_string(request.status));
  }
  if (request.is_recv && request.received != request.bytes) {
    throw CommError(ErrorKind::kMismatch,
                    description + ": " + peer + " sent " +
                        std::to_string(request.received) + " bytes but this rank expected " +
                        std::to_string(request.bytes) +
                        " (tensor sizes differ between ranks)");
  }
}

}  // namespace fsdp_ext::comm
