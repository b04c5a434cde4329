#include "comm/transport.h"

#include <ucs/debug/log_def.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>

#include "comm/error.h"

namespace fsdp_ext::comm {
namespace {
void noop_send_callback(void*, ucs_status_t, void*) {}
void noop_recv_callback(void*, ucs_status_t, const ucp_tag_recv_info_t*, void*) {}

// Note [closing after the peer left]
// Ranks do not leave together: one finishes its last op and exits while a
// peer on another host still runs. When that peer closes its endpoints, the
// flush meets a TCP connection the departed rank closed, and UCX (its
// default error handling) logs "UCX ERROR ... error during flush: Endpoint
// timeout", on every such exit, though every op had completed and nothing is
// lost. UCX's peer error handling would end such a flush quietly, but it
// takes the put lane from TCP endpoints, so large messages then go through
// bounce buffers (one interleaved A/B across two emulated hosts: a 16 MiB
// all-gather took 5.9-6.1 ms with it against 4.5-5.4 ms without). So the
// flush stays as it is, and while a thread closes endpoints (and destroys
// the worker) a log filter drops exactly that message on that thread. The
// filter is UCX's own hook (ucs_log_push_handler), installed once per
// process; every other UCX message, and every message of other threads,
// still reaches UCX's printer. A flush that fails at close means the peer
// is gone, which its own liveness connection reports where it matters
// (during an op, peer_liveness.h).
thread_local bool closing_endpoints = false;

ucs_log_func_rc_t drop_flush_failures_while_closing(const char*, unsigned, const char*,
                                                    ucs_log_level_t level,
                                                    const ucs_log_component_config_t*,
                                                    const char* format, va_list) {
  const bool flush_failure = level == UCS_LOG_LEVEL_ERROR && format != nullptr &&
                             std::strstr(format, "error during flush") != nullptr;
  return closing_endpoints && flush_failure ? UCS_LOG_FUNC_RC_STOP : UCS_LOG_FUNC_RC_CONTINUE;
}

// Marks this thread as closing endpoints for its lifetime.
class ClosingEndpoints {
 public:
  ClosingEndpoints() : outer_(closing_endpoints) {
    static std::once_flag installed;
    std::call_once(installed, [] { ucs_log_push_handler(drop_flush_failures_while_closing); });
    closing_endpoints = true;
  }
  ~ClosingEndpoints() { closing_endpoints = outer_; }
  ClosingEndpoints(const ClosingEndpoints&) = delete;
  ClosingEndpoints& operator=(const ClosingEndpoints&) = delete;

 private:
  bool outer_;
};
}  // namespace

Transport::Transport(int rank, int size)
    : rank_(rank),
      size_(size),
      context_(std::make_shared<UcxContext>(static_cast<size_t>(size))),
      worker_(std::make_unique<UcxWorker>(context_->get())) {}

Transport::~Transport() {
  ClosingEndpoints closing;  // Note [closing after the peer left]
  close_endpoints(std::chrono::milliseconds(2000));
  if (worker_) discard_unexpected();  // what arrived while they closed
  worker_.reset();
  context_.reset();
}

// Note [an endpoint on first use]
// A group's algorithms talk to few of its ranks: ring neighbours, the
// ranks of the same position on the other hosts (the column phase of a
// hierarchical op), while data within a host goes through shared memory.
// Endpoints made up front to every rank cost, per group and process, a TCP
// connection to every rank of every other host (992 for a 1000-rank job of
// 8 ranks per host) and their wire-up at init. So an endpoint is made on the
// progress thread when the first message goes to its rank. The receiving
// side needs none: UCX accepts a connection from a worker it has no endpoint
// to, and pairs it with the one that worker later makes back. A rank that
// cannot be reached is still found at init: the init op includes every rank,
// and peers on other hosts are watched through the process's liveness
// connections, made at init (peer_liveness.h).
void Transport::connect(const std::vector<std::vector<uint8_t>>& addresses) {
  if (static_cast<int>(addresses.size()) != size_) {
    throw std::invalid_argument("connect: " + std::to_string(addresses.size()) +
                                " worker addresses for " + std::to_string(size_) + " ranks");
  }
  addresses_ = addresses;
  endpoints_.assign(size_, nullptr);
}

ucp_ep_h Transport::endpoint_to(int peer) {
  ucp_ep_h& endpoint = endpoints_.at(peer);
  if (endpoint == nullptr) {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = reinterpret_cast<const ucp_address_t*>(addresses_[peer].data());
    check_ucs(ucp_ep_create(worker_->get(), &params, &endpoint),
              ("ucp_ep_create to rank " + std::to_string(peer)).c_str());
  }
  return endpoint;
}

std::vector<int> Transport::connected_peers() const {
  std::vector<int> peers;
  for (int peer = 0; peer < static_cast<int>(endpoints_.size()); ++peer) {
    if (endpoints_[peer] != nullptr) peers.push_back(peer);
  }
  return peers;
}

std::vector<std::string> Transport::transports_to(int peer) const {
  if (peer < 0 || peer >= static_cast<int>(endpoints_.size()) || endpoints_[peer] == nullptr) {
    return {};
  }
  // ucp_ep_print_info writes lines like
  //   "#                 lane[1]:  8:cma/memory.0 md[5] -> md[5]/cma/... rma_bw#0"
  // to a FILE: capture them and keep the local "name/device" of each lane.
  char* text = nullptr;
  size_t length = 0;
  FILE* stream = open_memstream(&text, &length);
  if (stream == nullptr) return {};
  ucp_ep_print_info(endpoints_[peer], stream);
  std::fclose(stream);
  std::set<std::string> found;
  std::istringstream lines(std::string(text, length));
  std::free(text);
  for (std::string line; std::getline(lines, line);) {
    const size_t lane = line.find("lane[");
    if (lane == std::string::npos) continue;
    // After "lane[i]:" comes "<resource index>:<name>/<device>.<n> ...".
    const size_t colon = line.find(':', line.find("]:", lane) + 2);
    if (colon == std::string::npos) continue;
    const size_t end = line.find_first_of(" \t", colon);
    std::string resource = line.substr(colon + 1, end - colon - 1);
    if (const size_t dot = resource.rfind('.'); dot != std::string::npos) resource.resize(dot);
    if (resource.find('/') != std::string::npos) found.insert(resource);
  }
  return {found.begin(), found.end()};
}

void Transport::post_send(Request& request, int peer, uint64_t tag,
                          const void* data, size_t bytes) {
  request.peer = peer;
  request.is_recv = false;
  request.bytes = bytes;
  request.finished = false;
  request.status = UCS_OK;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
  param.cb.send = noop_send_callback;
  ucs_status_ptr_t result =
      ucp_tag_send_nbx(endpoint_to(peer), data, bytes, tag, &param);
  if (result == nullptr) {
    request.finished = true;
  } else if (UCS_PTR_IS_ERR(result)) {
    request.finished = true;
    request.status = UCS_PTR_STATUS(result);
  } else {
    request.handle = result;
  }
}

void Transport::post_recv(Request& request, uint64_t tag, uint64_t tag_mask,
                          void* data, size_t bytes) {
  request.is_recv = true;
  request.finished = false;
  request.status = UCS_OK;
  request.bytes = bytes;
  ucp_request_param_t param{};
  // Always get a request back: UCX 1.13 does not report the received length
  // and sender tag for a receive that completes inside the call, and those
  // are how size mismatches and any-source senders are detected.
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = noop_recv_callback;
  ucs_status_ptr_t result =
      ucp_tag_recv_nbx(worker_->get(), data, bytes, tag, tag_mask, &param);
  if (UCS_PTR_IS_ERR(result)) {
    request.finished = true;
    request.status = UCS_PTR_STATUS(result);
  } else {
    request.handle = result;
  }
}

bool Transport::test(Request& request) {
  if (request.finished) return true;
  ucs_status_t status;
  if (request.is_recv) {
    ucp_tag_recv_info_t info{};
    status = ucp_tag_recv_request_test(request.handle, &info);
    if (status != UCS_INPROGRESS) {
      request.received = info.length;
      request.matched_tag = info.sender_tag;
    }
  } else {
    status = ucp_request_check_status(request.handle);
  }
  if (status == UCS_INPROGRESS) return false;
  request.status = status;
  request.finished = true;
  ucp_request_free(request.handle);
  request.handle = nullptr;
  return true;
}

void Transport::cancel(Request& request) {
  if (!request.finished && request.handle) {
    ucp_request_cancel(worker_->get(), request.handle);
  }
}

bool Transport::find_unexpected(uint64_t tag, uint64_t tag_mask, uint64_t* found_tag) {
  ucp_tag_recv_info_t info{};
  // remove=0: the message stays for the receive that may still come.
  if (ucp_tag_probe_nb(worker_->get(), tag, tag_mask, 0, &info) == nullptr) return false;
  *found_tag = info.sender_tag;
  return true;
}

bool Transport::arm() {
  const ucs_status_t status = ucp_worker_arm(worker_->get());
  if (status == UCS_ERR_BUSY) return false;
  check_ucs(status, "ucp_worker_arm");
  return true;
}

// Note [messages nobody received]
// After a failed collective the peers' messages of that op (and of the ops
// they ran on before they heard of it), a second failure notice, or a user's
// send never received are left in the worker's unexpected queue, and
// ucp_worker_destroy prints a UCX warning for each ("unexpected tag-receive
// descriptor ... was not matched") after the real error: noise that reads
// like a second fault. So before its endpoints close, and again before the
// worker goes, the transport receives each of them, oldest first, into a
// one-byte sink: UCX cuts the message (truncated) and drops it. For a
// rendezvous message that also answers its sender, whose request then
// completes (as a send to a receiver that took it: UCX reports it done);
// the answer needs the endpoints still open. A sender that already went is
// not waited for.
void Transport::discard_unexpected() {
  constexpr int kMaxMessages = 4096;  // against a peer that keeps sending
  constexpr int kRoundsPerMessage = 100;
  ucp_tag_recv_info_t info{};
  for (int taken = 0; taken < kMaxMessages; ++taken) {
    if (ucp_tag_probe_nb(worker_->get(), 0, 0, /*remove=*/0, &info) == nullptr) return;
    Request request;
    post_recv(request, info.sender_tag, ~uint64_t{0}, discard_sink_, sizeof(discard_sink_));
    for (int round = 0; round < kRoundsPerMessage && !test(request); ++round) {
      ucp_worker_progress(worker_->get());
    }
    if (!request.finished) {
      // A message still arriving in fragments (a sender that stalled or
      // went): leave it, and the rest of the queue, to the worker's
      // destruction (released, as close_endpoints does).
      ucp_request_cancel(worker_->get(), request.handle);
      ucp_request_free(request.handle);
      return;
    }
  }
}

void Transport::close_endpoints(std::chrono::milliseconds budget) {
  if (endpoints_.empty() || !worker_) return;
  ClosingEndpoints closing;  // Note [closing after the peer left]
  // While the endpoints can still answer a rendezvous sender.
  discard_unexpected();
  std::vector<void*> pending;
  for (ucp_ep_h& endpoint : endpoints_) {
    if (!endpoint) continue;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = 0;  // flush: let queued sends reach the peer first
    ucs_status_ptr_t result = ucp_ep_close_nbx(endpoint, &param);
    if (result != nullptr && !UCS_PTR_IS_ERR(result)) pending.push_back(result);
    endpoint = nullptr;
  }
  const auto deadline = std::chrono::steady_clock::now() + budget;
  for (void* request : pending) {
    while (ucp_request_check_status(request) == UCS_INPROGRESS &&
           std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker_->get());
    }
    if (ucp_request_check_status(request) == UCS_INPROGRESS) {
      // A peer that stopped progressing (or is gone) never acknowledges:
      // leave the request to the worker's destruction rather than block.
      ucp_request_cancel(worker_->get(), request);
      ucp_worker_progress(worker_->get());
    }
    // Released even while in progress (UCX then frees it on completion or
    // with the worker): an unreleased request makes ucp_worker_destroy fail
    // an assertion and abort the process (found by a C++ test closing one
    // endpoint of a TCP pair whose other worker did not progress).
    ucp_request_free(request);
  }
  endpoints_.clear();
}

}  // namespace fsdp_ext::comm
