#include "backend/fsdp_ext_backend.hpp"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>

#include "backend/environment.hpp"
#include "backend/peer_identity.hpp"
#include "backend/store_address_exchange.hpp"
#include "backend/tensor_validation.hpp"
#include "backend/type_mapping.hpp"
#include "comm/algorithms/algorithms.h"
#include "comm/tag_scheme.h"

namespace fsdp_ext::backend {
namespace {

comm::MutableSpan span_of(const at::Tensor& tensor) {
  return comm::MutableSpan{tensor.data_ptr(), tensor.nbytes()};
}
comm::ConstSpan const_span_of(const at::Tensor& tensor) {
  return comm::ConstSpan{tensor.data_ptr(), tensor.nbytes()};
}

// Equal slices of a flat tensor, one per rank (all_gather_into_tensor /
// reduce_scatter_tensor layouts).
std::vector<comm::MutableSpan> split_evenly(const at::Tensor& flat, int parts) {
  std::vector<comm::MutableSpan> spans(parts);
  const size_t part_bytes = flat.nbytes() / parts;
  char* base = static_cast<char*>(flat.data_ptr());
  for (int p = 0; p < parts; ++p) spans[p] = {base + p * part_bytes, part_bytes};
  return spans;
}

std::vector<comm::ConstSpan> to_const_spans(const std::vector<comm::MutableSpan>& spans) {
  std::vector<comm::ConstSpan> out(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) out[i] = {spans[i].data, spans[i].bytes};
  return out;
}

// Spans along dim 0 with the given row counts (alltoall_base splits).
std::vector<comm::MutableSpan> split_rows(const at::Tensor& tensor,
                                          const std::vector<int64_t>& rows) {
  size_t row_bytes = tensor.element_size();
  for (int64_t d = 1; d < tensor.dim(); ++d) row_bytes *= tensor.size(d);
  std::vector<comm::MutableSpan> spans(rows.size());
  char* cursor = static_cast<char*>(tensor.data_ptr());
  for (size_t i = 0; i < rows.size(); ++i) {
    const size_t bytes = static_cast<size_t>(rows[i]) * row_bytes;
    spans[i] = {cursor, bytes};
    if (cursor) cursor += bytes;
  }
  return spans;
}

std::vector<int64_t> resolve_splits(const OpLabel& label, const at::Tensor& tensor,
                                    const std::vector<int64_t>& splits, const char* role) {
  TORCH_CHECK_VALUE(tensor.dim() >= 1, label.prefix(), role, " must have at least one dimension");
  const int64_t rows = tensor.size(0);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(rows % label.size == 0, label.prefix(), role, " has ", rows,
                      " rows along dim 0, which the group size ", label.size,
                      " does not divide; pass split sizes");
    return std::vector<int64_t>(label.size, rows / label.size);
  }
  check_count(label, splits.size(), static_cast<size_t>(label.size), role);
  for (int64_t split : splits) {
    TORCH_CHECK_VALUE(split >= 0, label.prefix(), role, " split sizes must be >= 0, got ", split);
  }
  const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  TORCH_CHECK_VALUE(total == rows, label.prefix(), role, " split sizes sum to ", total,
                    " but the tensor has ", rows, " rows along dim 0");
  return splits;
}

// Whether this rank can read every peer's ordinary memory with
// process_vm_readv (needs ptrace permission: same uid, no Yama restriction).
// FSDP_EXT_PROCESS_READS=0 (`wanted` false) turns it off (large ordinary
// tensors are then staged in shared memory, as on hosts that refuse it).
// Returns why not ("" when every read works), for the group's log line.
std::string why_no_process_reads(const std::vector<PeerIdentity>& peers, int rank, bool wanted) {
  if (!wanted) return "FSDP_EXT_PROCESS_READS=0";
  for (int p = 0; p < static_cast<int>(peers.size()); ++p) {
    if (p == rank || peers[p].host != peers[rank].host) continue;
    uint64_t value = 0;
    try {
      comm::SharedMemoryDomain::read_process_memory(peers[p].pid, peers[p].probe_address, &value,
                                                    sizeof(value));
    } catch (const comm::CommError& error) {
      return "reading rank " + std::to_string(p) + "'s memory failed: " + error.what();
    }
    if (value != kProcessReadProbeValue) {
      return "reading rank " + std::to_string(p) + "'s memory gave a wrong value";
    }
  }
  return "";
}

// Which ranks share a host (hostname and boot id), hosts in order of their
// lowest rank.
comm::HostTopology host_topology(const std::vector<PeerIdentity>& peers, int rank) {
  comm::HostTopology topology;
  std::vector<std::string> names;
  for (int p = 0; p < static_cast<int>(peers.size()); ++p) {
    const auto found = std::find(names.begin(), names.end(), peers[p].host);
    const size_t h = static_cast<size_t>(found - names.begin());
    if (found == names.end()) {
      names.push_back(peers[p].host);
      topology.hosts.emplace_back();
    }
    if (p == rank) {
      topology.host = static_cast<int>(h);
      topology.local = static_cast<int>(topology.hosts[h].size());
    }
    topology.hosts[h].push_back(p);
  }
  return topology;
}

// Whether this rank can share memory with the peers of its host: each
// peer's probe segment maps. A group over several hosts shares memory
// within each host when collectives can go hierarchical (the same number of
// ranks, at least two, on every host). FSDP_EXT_SHARED_MEMORY=0 (`wanted`
// false) keeps a group on UCX messages only (and makes supports_tensor_alloc
// false). Returns why not ("" when it can), for the group's log line.
std::string why_no_shared_memory(comm::SharedMemoryDomain& domain,
                                 const std::vector<PeerIdentity>& peers,
                                 const comm::HostTopology& topology, bool wanted) {
  if (!wanted) return "FSDP_EXT_SHARED_MEMORY=0";
  if (topology.hosts.size() > 1 && !topology.hierarchical()) {
    return topology.hosts[0].size() == 1 && topology.hosts.size() == peers.size()
               ? std::string("one rank per host")
               : std::string("hosts hold different numbers of ranks");
  }
  const std::vector<int>& mine = topology.hosts[topology.host];
  for (int local = 0; local < static_cast<int>(mine.size()); ++local) {
    if (local == topology.local) continue;
    const PeerIdentity& peer = peers[mine[local]];
    try {
      // The domain names peers by their position on this host.
      domain.probe_peer(local, peer.pid, peer.probe);
    } catch (const comm::CommError& error) {
      return "rank " + std::to_string(mine[local]) + "'s memory could not be mapped: " +
             error.what();
    }
  }
  return "";
}

size_t distinct_hosts(const std::vector<PeerIdentity>& peers) {
  std::vector<std::string> hosts;
  for (const PeerIdentity& peer : peers) hosts.push_back(peer.host);
  std::sort(hosts.begin(), hosts.end());
  return static_cast<size_t>(std::unique(hosts.begin(), hosts.end()) - hosts.begin());
}

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::vector<FsdpExtBackend*>& registry() {
  static std::vector<FsdpExtBackend*> live;
  return live;
}

}  // namespace

FsdpExtBackend::FsdpExtBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                               int size, std::chrono::milliseconds timeout,
                               std::string group_name)
    : c10d::Backend(rank, size),
      default_timeout_(timeout),
      group_name_(std::move(group_name)) {
  const OpLabel init_label = label("init");
  TORCH_CHECK_VALUE(size >= 1 && size < comm::tag::kMaxRanks, init_label.prefix(),
                    "group size ", size, " is out of range");
  const BackendEnvironment environment = read_environment(init_label.prefix());
  std::string no_shared_memory, no_process_reads, unwatched_peers, layout;
  size_t hosts = 0;
  // [0]: every peer's shared memory maps; [1]: process_vm_readv works too.
  auto shared_ok = std::make_shared<std::array<int32_t, 2>>();
  std::vector<pid_t> pids(size);
  try {
    auto transport = std::make_unique<comm::Transport>(rank, size);
    pool_ = std::make_shared<comm::SharedBufferPool>(transport->context());
    shared_memory_ = std::make_shared<comm::SharedMemoryDomain>(pool_);
    comm::PeerLiveness liveness;
    PeerIdentity mine{transport->worker_address(), this_host(), getpid(),
                      shared_memory_->probe_piece(),
                      reinterpret_cast<uint64_t>(&kProcessReadProbeValue), liveness.endpoint()};
    std::vector<PeerIdentity> peers;
    std::vector<std::vector<uint8_t>> addresses;
    for (const auto& blob : exchange_addresses(*store, rank, size, serialize(mine))) {
      peers.push_back(deserialize_peer_identity(blob));
      addresses.push_back(peers.back().worker_address);
      pids[peers.size() - 1] = peers.back().pid;
    }
    transport->connect(addresses);
    const comm::HostTopology topology = host_topology(peers, rank);
    // The domain names peers by their position on this host.
    pids.clear();
    for (int peer : topology.hosts[topology.host]) pids.push_back(peers[peer].pid);
    no_shared_memory = why_no_shared_memory(*shared_memory_, peers, topology,
                                            environment.shared_memory);
    if (no_shared_memory.empty() && topology.hosts.size() > 1) {
      layout = ", hierarchical collectives (" + std::to_string(topology.hosts.size()) +
               " hosts x " + std::to_string(topology.hosts[0].size()) + " ranks)";
    }
    if (no_shared_memory.empty()) {
      no_process_reads = why_no_process_reads(peers, rank, environment.process_reads);
    } else {
      no_process_reads = "no shared memory";
    }
    hosts = distinct_hosts(peers);
    (*shared_ok)[0] = no_shared_memory.empty() ? 1 : 0;
    (*shared_ok)[1] = (*shared_ok)[0] && no_process_reads.empty() ? 1 : 0;
    // Peers on other hosts are watched through an idle TCP connection each;
    // one that cannot be reached is not watched (its loss then surfaces at
    // the op's timeout), which the group's log line says.
    std::vector<std::string> endpoints;
    std::vector<bool> remote;
    for (const PeerIdentity& peer : peers) {
      endpoints.push_back(peer.liveness_endpoint);
      remote.push_back(peer.host != peers[rank].host);
    }
    liveness.connect(rank, endpoints, remote,
                     std::min(default_timeout_, std::chrono::milliseconds(10000)));
    for (int peer : liveness.missing()) unwatched_peers += " " + std::to_string(peer);
    comm::EngineConfig config;
    config.topology = topology;
    config.rank = rank;
    config.size = size;
    config.group_name = group_name_;
    config.spin = environment.spin;
    config.shared_memory = shared_memory_;
    config.liveness = liveness.take_connections();
    config.explain_timeout = [this](const comm::EngineActivity& mine) {
      return activity_board_ ? activity_board_->describe_others(
                                   mine, [this](int peer) { return engine_->describe_peer(peer); })
                             : std::string();
    };
    for (const PeerIdentity& peer : peers) {
      // Same host (hostname and boot id): the pid names the peer's process
      // here too, so the engine can watch it exit through a pidfd.
      config.peers.push_back(comm::PeerInfo{peer.host.substr(0, peer.host.find('/')), peer.pid,
                                            peer.host == peers[rank].host});
    }
    engine_ = std::make_unique<comm::ProgressEngine>(std::move(config), std::move(transport));
    activity_board_ = std::make_unique<PeerActivityBoard>(
        store, rank, size, [engine = engine_.get()] { return engine->activity(); });
  } catch (const comm::CommError& error) {
    C10_THROW_ERROR(DistBackendError, init_label.prefix() + error.what());
  } catch (const std::runtime_error& error) {
    C10_THROW_ERROR(DistBackendError, init_label.prefix() + error.what());
  }
  // Wire up every connection now, find a missing peer at init (within the
  // timeout) rather than at the first collective, and agree on shared
  // memory: on only if every rank could map every other rank's memory.
  auto domain = shared_memory_;
  auto work = enqueue(init_label, c10d::OpType::BARRIER, nullptr, true, default_timeout_, {},
                      {}, [shared_ok, domain, pids](comm::OpContext& context) {
                        comm::allreduce(context,
                                        comm::MutableSpan{shared_ok->data(), sizeof(*shared_ok)},
                                        comm::ReduceSpec{comm::DataType::kInt32,
                                                         comm::ReduceKind::kMin});
                        if ((*shared_ok)[0] == 1) domain->enable(pids, (*shared_ok)[1] == 1);
                      });
  work->wait();
  // One line per group (TORCH_CPP_LOG_LEVEL=INFO): what was agreed and, where
  // a feature is off, why this rank could not (or that another rank could not).
  auto state = [](bool on, const std::string& local_reason) {
    if (on) return std::string("on");
    return "off (" + (local_reason.empty() ? std::string("another rank could not")
                                           : local_reason) + ")";
  };
  LOG(INFO) << "fsdp_ext group '" << group_name_ << "': rank " << rank << "/" << size << ", "
            << hosts << (hosts == 1 ? " host" : " hosts") << ", shared memory "
            << state((*shared_ok)[0] == 1, no_shared_memory) << ", process reads "
            << state((*shared_ok)[1] == 1, no_process_reads) << ((*shared_ok)[0] == 1 ? layout : "")
            << (unwatched_peers.empty() ? ""
                                        : ", not watched for loss (unreachable):" + unwatched_peers);
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().push_back(this);
}

FsdpExtBackend::~FsdpExtBackend() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto& live = registry();
    live.erase(std::remove(live.begin(), live.end(), this), live.end());
  }
  shutdown();
}

void FsdpExtBackend::shutdown_all() {
  std::vector<FsdpExtBackend*> live;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    live = registry();
  }
  for (FsdpExtBackend* backend : live) backend->shutdown();
}

void FsdpExtBackend::setTimeout(std::chrono::milliseconds timeout) {
  default_timeout_ = timeout;
}

void FsdpExtBackend::abort() {
  if (engine_) engine_->abort("abort() was called on the process group");
}

void FsdpExtBackend::shutdown() {
  if (activity_board_) activity_board_->stop();
  if (engine_) engine_->shutdown();
}

OpLabel FsdpExtBackend::label(const char* op) const {
  std::string group = "'" + group_name_ + "'";
  if (!pg_desc_.empty()) group += " (" + pg_desc_ + ")";
  return OpLabel{op, std::move(group), rank_, size_};
}

std::chrono::milliseconds FsdpExtBackend::resolve_timeout(
    std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? default_timeout_ : requested;
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::enqueue(
    const OpLabel& label, c10d::OpType type, const char* profiling_title, bool collective,
    std::chrono::milliseconds timeout, std::vector<at::Tensor> outputs,
    std::vector<at::Tensor> keep_alive, Body body, std::shared_ptr<const BucketMembers> bucket) {
  auto work = c10::make_intrusive<FsdpExtWork>(rank_, type, profiling_title, outputs);
  keep_alive.insert(keep_alive.end(), outputs.begin(), outputs.end());
  {
    std::lock_guard<std::mutex> lock(coalescing_mutex_);
    if (coalescing_ && std::this_thread::get_id() == coalescing_thread_) {
      coalesced_ops_.push_back(CoalescedOp{collective, std::move(body), work, std::move(bucket)});
      coalesced_tensors_.insert(coalesced_tensors_.end(), keep_alive.begin(),
                                keep_alive.end());
      coalesced_timeout_ = std::max(coalesced_timeout_, timeout);
      return work;
    }
  }
  comm::EngineOp op;
  op.name = label.op;
  op.collective = collective;
  op.timeout = timeout;
  op.body = std::move(body);
  op.keepalive = std::make_shared<std::vector<at::Tensor>>(std::move(keep_alive));
  op.on_done = [work](const comm::OpOutcome& outcome) { work->complete(outcome); };
  engine_->submit(std::move(op));
  return work;
}

void FsdpExtBackend::startCoalescing() {
  std::lock_guard<std::mutex> lock(coalescing_mutex_);
  TORCH_CHECK(!coalescing_, label("start_coalescing").prefix(),
              "coalescing is already active; nested coalescing is not supported");
  coalescing_ = true;
  coalescing_thread_ = std::this_thread::get_id();
  coalesced_timeout_ = default_timeout_;
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::endCoalescing() {
  std::vector<CoalescedOp> members;
  std::vector<at::Tensor> tensors;
  std::chrono::milliseconds timeout;
  {
    std::lock_guard<std::mutex> lock(coalescing_mutex_);
    TORCH_CHECK(coalescing_, label("end_coalescing").prefix(),
                "endCoalescing() without a matching startCoalescing()");
    coalescing_ = false;
    members = std::move(coalesced_ops_);
    coalesced_ops_.clear();
    tensors = std::move(coalesced_tensors_);
    coalesced_tensors_.clear();
    timeout = coalesced_timeout_;
  }
  const bool any_collective = std::any_of(members.begin(), members.end(),
                                          [](const CoalescedOp& m) { return m.collective; });
  auto work = c10::make_intrusive<FsdpExtWork>(rank_, c10d::OpType::COALESCED,
                                               "fsdp_ext:coalesced", tensors);
  auto shared_members = std::make_shared<std::vector<CoalescedOp>>(std::move(members));
  comm::EngineOp op;
  op.name = "coalesced";
  op.collective = any_collective;
  op.timeout = timeout;
  op.body = coalesced_body(shared_members);
  op.keepalive = std::make_shared<std::vector<at::Tensor>>(std::move(tensors));
  op.on_done = [shared_members, work](const comm::OpOutcome& outcome) {
    for (CoalescedOp& member : *shared_members) member.work->complete(outcome);
    work->complete(outcome);
  };
  engine_->submit(std::move(op));
  return work;
}

FsdpExtBackend::Body FsdpExtBackend::bucket_body(std::shared_ptr<const BucketMembers> members) {
  return [members](comm::OpContext& context) {
    if (!members->allgather.empty()) comm::allgather(context, members->allgather);
    if (!members->reduce_scatter.empty()) comm::reduce_scatter(context, members->reduce_scatter);
    if (!members->allreduce.empty()) comm::allreduce(context, members->allreduce);
  };
}

FsdpExtBackend::Body FsdpExtBackend::coalesced_body(
    std::shared_ptr<std::vector<CoalescedOp>> members) {
  // Members of one kind (all all-gathers, all reduce-scatters or all
  // all-reduces: what FSDP and _coalescing_manager issue) fuse into one
  // bucket: one algorithm pass.
  auto fused = std::make_shared<BucketMembers>();
  bool fusible = !members->empty();
  for (const CoalescedOp& member : *members) {
    if (!member.bucket) {
      fusible = false;
      break;
    }
    const BucketMembers& b = *member.bucket;
    fused->allgather.insert(fused->allgather.end(), b.allgather.begin(), b.allgather.end());
    fused->reduce_scatter.insert(fused->reduce_scatter.end(), b.reduce_scatter.begin(),
                                 b.reduce_scatter.end());
    fused->allreduce.insert(fused->allreduce.end(), b.allreduce.begin(), b.allreduce.end());
  }
  const int kinds_seen = !fused->allgather.empty() + !fused->reduce_scatter.empty() +
                         !fused->allreduce.empty();
  if (fusible && kinds_seen <= 1) return bucket_body(fused);
  // Anything else (mixed kinds, point-to-point): one queued op whose
  // point-to-point members are posted (non-blocking) and whose collective
  // members run in issue order, each with its own sequence number.
  return [members](comm::OpContext& context) {
    bool first_collective = true;
    for (CoalescedOp& member : *members) {
      if (member.collective) {
        if (!first_collective) context.begin_next_collective();
        first_collective = false;
      }
      member.body(context);
    }
  };
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::enqueue_bucket(
    const OpLabel& label, c10d::OpType type, const char* profiling_title,
    std::chrono::milliseconds timeout, std::vector<at::Tensor> outputs,
    std::vector<at::Tensor> keep_alive, BucketMembers bucket) {
  auto members = std::make_shared<const BucketMembers>(std::move(bucket));
  return enqueue(label, type, profiling_title, true, timeout, std::move(outputs),
                 std::move(keep_alive), bucket_body(members), members);
}

// ------------------------------------------------------------ allocation

bool FsdpExtBackend::supportsTensorAlloc(c10::DeviceIndex device_index) {
  // c10d passes only the device index; CPU's is -1 (CUDA devices are >= 0).
  return device_index < 0 && shared_memory_enabled();
}

at::Tensor FsdpExtBackend::allocateTensor(long size, at::TensorOptions options) {
  const OpLabel l = label("allocate_tensor");
  TORCH_CHECK_VALUE(size >= 0, l.prefix(), "size must be >= 0, got ", size);
  if (options.has_device() && !options.device().is_cpu()) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, l.prefix(), "only CPU tensors can be allocated from ",
                                "this group, not ", options.device().str());
  }
  TORCH_CHECK(shared_memory_enabled(), l.prefix(),
              "this group does not share memory between its ranks (ranks on several hosts, ",
              "a peer's memory could not be mapped, or FSDP_EXT_SHARED_MEMORY=0); check ",
              "supports_tensor_alloc() first");
  const caffe2::TypeMeta dtype = options.dtype();
  const size_t bytes = static_cast<size_t>(size) * dtype.itemsize();
  void* data = nullptr;
  try {
    data = pool_->allocate(bytes);
  } catch (const comm::CommError& error) {
    C10_THROW_ERROR(DistBackendError, l.prefix() + error.what());
  }
  // The tensor's deleter returns the buffer to the pool. Ops hold their
  // tensors until they finish, so a buffer freed by Python while an op uses
  // it only returns once the op is done; the pool itself lives as long as
  // any of its tensors, even past the group's destruction.
  std::shared_ptr<comm::SharedBufferPool> pool = pool_;
  return at::from_blob(
      data, {static_cast<int64_t>(size)},
      [pool](void* buffer) {
        try {
          pool->release(buffer);
        } catch (const std::exception&) {
          // Not reachable for buffers from allocate(); never throw from a deleter.
        }
      },
      options.device(at::kCPU));
}

size_t FsdpExtBackend::mapped_peer_segments() const {
  return shared_memory_ ? shared_memory_->mapped_peer_segments() : 0;
}

// ---------------------------------------------------------------- collectives

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                         const c10d::BroadcastOptions& opts) {
  const OpLabel l = label("broadcast");
  check_count(l, tensors.size(), 1, "tensor");
  check_tensor(l, tensors[0], "tensor");
  check_rank(l, opts.rootRank, "root");
  at::Tensor tensor = tensors[0];
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(l, c10d::OpType::BROADCAST, "fsdp_ext:broadcast", true,
                 resolve_timeout(opts.timeout), {tensor}, {},
                 [tensor, root](comm::OpContext& context) {
                   comm::broadcast(context, span_of(tensor), root);
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  const OpLabel l = label("all_reduce");
  check_count(l, tensors.size(), 1, "tensor");
  check_tensor(l, tensors[0], "tensor");
  at::Tensor tensor = tensors[0];
  const comm::ReduceSpec spec = reduce_spec(l, opts.reduceOp, tensor.scalar_type(), size_);
  BucketMembers bucket;
  bucket.allreduce.push_back({span_of(tensor), spec});
  return enqueue_bucket(l, c10d::OpType::ALLREDUCE, "fsdp_ext:all_reduce",
                        resolve_timeout(opts.timeout), {tensor}, {}, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const OpLabel l = label("all_reduce_coalesced");
  TORCH_CHECK_VALUE(!tensors.empty(), l.prefix(), "needs at least one tensor");
  check_tensors(l, tensors, "tensor");
  BucketMembers bucket;
  for (const at::Tensor& tensor : tensors) {
    bucket.allreduce.push_back(
        {span_of(tensor), reduce_spec(l, opts.reduceOp, tensor.scalar_type(), size_)});
  }
  return enqueue_bucket(l, c10d::OpType::ALLREDUCE_COALESCED, "fsdp_ext:all_reduce_coalesced",
                        resolve_timeout(opts.timeout), tensors, {}, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::reduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::ReduceOptions& opts) {
  const OpLabel l = label("reduce");
  check_count(l, tensors.size(), 1, "tensor");
  check_tensor(l, tensors[0], "tensor");
  check_rank(l, opts.rootRank, "root");
  at::Tensor tensor = tensors[0];
  const comm::ReduceSpec spec = reduce_spec(l, opts.reduceOp, tensor.scalar_type(), size_);
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(l, c10d::OpType::REDUCE, "fsdp_ext:reduce", true,
                 resolve_timeout(opts.timeout), {tensor}, {},
                 [tensor, spec, root](comm::OpContext& context) {
                   comm::reduce(context, span_of(tensor), root, spec);
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const OpLabel l = label("all_gather");
  check_count(l, inputs.size(), 1, "input tensor");
  check_count(l, outputs.size(), 1, "output tensor list");
  check_count(l, outputs[0].size(), static_cast<size_t>(size_), "output tensors (one per rank)");
  check_tensor(l, inputs[0], "input");
  check_tensors(l, outputs[0], "output");
  for (const at::Tensor& output : outputs[0]) check_same_dtype(l, output, "an output", inputs[0], "the input");
  check_numel(l, outputs[0][rank_].numel(), inputs[0].numel(),
              "the output for this rank must match the input");
  at::Tensor input = inputs[0];
  std::vector<at::Tensor> list = outputs[0];
  BucketMembers bucket;
  bucket.allgather.push_back({const_span_of(input), {}});
  for (const at::Tensor& output : list) bucket.allgather[0].outputs.push_back(span_of(output));
  return enqueue_bucket(l, c10d::OpType::ALLGATHER, "fsdp_ext:all_gather",
                        resolve_timeout(opts.timeout), list, {input}, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const OpLabel l = label("all_gather_into_tensor");
  check_gather_into_tensor(l, output, input, "");
  BucketMembers bucket;
  bucket.allgather.push_back({const_span_of(input), split_evenly(output, size_)});
  return enqueue_bucket(l, c10d::OpType::_ALLGATHER_BASE, "fsdp_ext:all_gather_into_tensor",
                        resolve_timeout(opts.timeout), {output}, {input}, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const OpLabel l = label("all_gather_into_tensor_coalesced");
  check_count(l, outputs.size(), inputs.size(), "output tensors (one per input)");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_gather_into_tensor(l, outputs[i], inputs[i], " " + std::to_string(i));
  }
  BucketMembers bucket;
  for (size_t i = 0; i < inputs.size(); ++i) {
    bucket.allgather.push_back({const_span_of(inputs[i]), split_evenly(outputs[i], size_)});
  }
  return enqueue_bucket(l, c10d::OpType::COALESCED, "fsdp_ext:all_gather_into_tensor_coalesced",
                        resolve_timeout(opts.timeout), outputs, inputs, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const OpLabel l = label("gather");
  check_rank(l, opts.rootRank, "root");
  const int root = static_cast<int>(opts.rootRank);
  check_count(l, inputs.size(), 1, "input tensor");
  check_tensor(l, inputs[0], "input");
  const std::vector<at::Tensor> list =
      root_tensor_list(l, outputs, root, inputs[0], "output", "input");
  at::Tensor input = inputs[0];
  return enqueue(l, c10d::OpType::GATHER, "fsdp_ext:gather", true,
                 resolve_timeout(opts.timeout), list, {input},
                 [input, list, root](comm::OpContext& context) {
                   std::vector<comm::MutableSpan> spans;
                   for (const at::Tensor& output : list) spans.push_back(span_of(output));
                   comm::gather(context, const_span_of(input), spans, root);
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const OpLabel l = label("scatter");
  check_rank(l, opts.rootRank, "root");
  const int root = static_cast<int>(opts.rootRank);
  check_count(l, outputs.size(), 1, "output tensor");
  check_tensor(l, outputs[0], "output");
  const std::vector<at::Tensor> list =
      root_tensor_list(l, inputs, root, outputs[0], "input", "output");
  at::Tensor output = outputs[0];
  return enqueue(l, c10d::OpType::SCATTER, "fsdp_ext:scatter", true,
                 resolve_timeout(opts.timeout), {output}, list,
                 [output, list, root](comm::OpContext& context) {
                   std::vector<comm::ConstSpan> spans;
                   for (const at::Tensor& input : list) spans.push_back(const_span_of(input));
                   comm::scatter(context, spans, span_of(output), root);
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const OpLabel l = label("reduce_scatter");
  check_count(l, outputs.size(), 1, "output tensor");
  check_count(l, inputs.size(), 1, "input tensor list");
  check_count(l, inputs[0].size(), static_cast<size_t>(size_), "input tensors (one per rank)");
  check_tensor(l, outputs[0], "output");
  check_tensors(l, inputs[0], "input");
  for (const at::Tensor& input : inputs[0]) check_same_dtype(l, input, "an input", outputs[0], "the output");
  check_numel(l, inputs[0][rank_].numel(), outputs[0].numel(),
              "the input for this rank must match the output");
  at::Tensor output = outputs[0];
  std::vector<at::Tensor> list = inputs[0];
  const comm::ReduceSpec spec = reduce_spec(l, opts.reduceOp, output.scalar_type(), size_);
  BucketMembers bucket;
  bucket.reduce_scatter.push_back({{}, span_of(output), spec});
  for (const at::Tensor& input : list) {
    bucket.reduce_scatter[0].inputs.push_back(const_span_of(input));
  }
  return enqueue_bucket(l, c10d::OpType::REDUCE_SCATTER, "fsdp_ext:reduce_scatter",
                        resolve_timeout(opts.timeout), {output}, list, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const OpLabel l = label("reduce_scatter_tensor");
  check_scatter_from_tensor(l, output, input, "");
  const comm::ReduceSpec spec = reduce_spec(l, opts.reduceOp, output.scalar_type(), size_);
  BucketMembers bucket;
  bucket.reduce_scatter.push_back(
      {to_const_spans(split_evenly(input, size_)), span_of(output), spec});
  return enqueue_bucket(l, c10d::OpType::_REDUCE_SCATTER_BASE, "fsdp_ext:reduce_scatter_tensor",
                        resolve_timeout(opts.timeout), {output}, {input}, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const OpLabel l = label("reduce_scatter_tensor_coalesced");
  check_count(l, outputs.size(), inputs.size(), "output tensors (one per input)");
  BucketMembers bucket;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_scatter_from_tensor(l, outputs[i], inputs[i], " " + std::to_string(i));
    bucket.reduce_scatter.push_back({to_const_spans(split_evenly(inputs[i], size_)),
                                     span_of(outputs[i]),
                                     reduce_spec(l, opts.reduceOp, outputs[i].scalar_type(), size_)});
  }
  return enqueue_bucket(l, c10d::OpType::COALESCED, "fsdp_ext:reduce_scatter_tensor_coalesced",
                        resolve_timeout(opts.timeout), outputs, inputs, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  const OpLabel l = label("all_to_all_single");
  check_tensor(l, input, "input");
  check_tensor(l, output, "output");
  check_same_dtype(l, output, "output", input, "input");
  const auto out_rows = resolve_splits(l, output, output_split_sizes, "output");
  const auto in_rows = resolve_splits(l, input, input_split_sizes, "input");
  at::Tensor in = input;
  at::Tensor out = output;
  return enqueue(l, c10d::OpType::ALLTOALL_BASE, "fsdp_ext:all_to_all_single", true,
                 resolve_timeout(opts.timeout), {out}, {in},
                 [in, out, in_rows, out_rows](comm::OpContext& context) {
                   comm::alltoall(context, to_const_spans(split_rows(in, in_rows)),
                                  split_rows(out, out_rows));
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::AllToAllOptions& opts) {
  const OpLabel l = label("all_to_all");
  check_count(l, inputs.size(), static_cast<size_t>(size_), "input tensors (one per rank)");
  check_count(l, outputs.size(), static_cast<size_t>(size_), "output tensors (one per rank)");
  check_tensors(l, inputs, "input");
  check_tensors(l, outputs, "output");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_same_dtype(l, outputs[i], "an output", inputs[0], "the inputs");
    check_same_dtype(l, inputs[i], "an input", inputs[0], "the first input");
  }
  check_numel(l, outputs[rank_].numel(), inputs[rank_].numel(),
              "the output and input for this rank must match");
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  return enqueue(l, c10d::OpType::ALLTOALL, "fsdp_ext:all_to_all", true,
                 resolve_timeout(opts.timeout), outs, ins,
                 [ins, outs](comm::OpContext& context) {
                   std::vector<comm::ConstSpan> in_spans;
                   std::vector<comm::MutableSpan> out_spans;
                   for (const at::Tensor& t : ins) in_spans.push_back(const_span_of(t));
                   for (const at::Tensor& t : outs) out_spans.push_back(span_of(t));
                   comm::alltoall(context, in_spans, out_spans);
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::barrier(const c10d::BarrierOptions& opts) {
  const OpLabel l = label("barrier");
  return enqueue(l, c10d::OpType::BARRIER, "fsdp_ext:barrier", true,
                 resolve_timeout(opts.timeout), {}, {},
                 [](comm::OpContext& context) { comm::barrier(context); });
}

// ------------------------------------------------------------ point to point

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::send(std::vector<at::Tensor>& tensors,
                                                    int dst_rank, int tag) {
  const OpLabel l = label("send");
  check_count(l, tensors.size(), 1, "tensor");
  check_tensor(l, tensors[0], "tensor");
  check_rank(l, dst_rank, "destination");
  at::Tensor tensor = tensors[0];
  return enqueue(l, c10d::OpType::SEND, "fsdp_ext:send", false, default_timeout_, {tensor}, {},
                 [tensor, dst_rank, tag](comm::OpContext& context) {
                   context.detach(context.send_user(dst_rank, tag, tensor.data_ptr(),
                                                    tensor.nbytes()));
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::recv(std::vector<at::Tensor>& tensors,
                                                    int src_rank, int tag) {
  const OpLabel l = label("recv");
  check_count(l, tensors.size(), 1, "tensor");
  check_tensor(l, tensors[0], "tensor");
  check_rank(l, src_rank, "source");
  at::Tensor tensor = tensors[0];
  return enqueue(l, c10d::OpType::RECV, "fsdp_ext:recv", false, default_timeout_, {tensor}, {},
                 [tensor, src_rank, tag](comm::OpContext& context) {
                   context.detach(context.recv_user(src_rank, tag, tensor.data_ptr(),
                                                    tensor.nbytes()));
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                             int tag) {
  const OpLabel l = label("recv (any source)");
  check_count(l, tensors.size(), 1, "tensor");
  check_tensor(l, tensors[0], "tensor");
  at::Tensor tensor = tensors[0];
  return enqueue(l, c10d::OpType::RECVANYSOURCE, "fsdp_ext:recv_any_source", false,
                 default_timeout_, {tensor}, {}, [tensor, tag](comm::OpContext& context) {
                   context.detach(context.recv_user(-1, tag, tensor.data_ptr(), tensor.nbytes()));
                 });
}

}  // namespace fsdp_ext::backend
