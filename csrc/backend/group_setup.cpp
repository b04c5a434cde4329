// A group's creation and end: what each rank publishes and agrees on at
// init (hosts, shared memory, process reads, liveness connections), the
// one log line per group, shutdown and abort.
#include "backend/fsdp_ext_backend.hpp"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <set>
#include <string>

#include "backend/environment.hpp"
#include "backend/peer_identity.hpp"
#include "backend/store_address_exchange.hpp"
#include "comm/algorithms/algorithms.h"
#include "comm/peer_liveness.h"
#include "comm/tag_scheme.h"
#include "comm/ucx_library.h"

namespace fsdp_ext::backend {
namespace {

// How many cores this rank may run on, for the group's log line; the
// progress thread inherits it from the thread creating the group. When the
// rank is not bound to its own cores and the ranks of this host have fewer
// than two cores each, a rank's caller and progress thread may be scheduled
// on different cores, and two ranks' progress threads on the same one: the
// 1 MiB collectives of an unbound run on 2 cores swing between two speeds, up
// to 2x apart, by placement alone (docs/design.md). The line says so.
std::string describe_cores(size_t ranks_on_host) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return "";
  const size_t cores = static_cast<size_t>(CPU_COUNT(&allowed));
  std::string text = ", may run on " + std::to_string(cores) + (cores == 1 ? " core" : " cores");
  if (cores > 1 && ranks_on_host * 2 > cores) {
    const size_t others = ranks_on_host - 1;
    text += " shared with " + std::to_string(others) + (others == 1 ? " other rank" : " other ranks") +
            " (bind each rank to its own cores for steady collective times)";
  }
  return text;
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

// Which ranks share a host (this_host(): machine and PID namespace), hosts
// in order of their lowest rank.
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

// Whether this rank can use the small-op channel: every rank on this host
// offered one and this rank mapped them all. Returns why not ("" when it can).
std::string why_no_small_ops(comm::SmallOpChannel* channel, const std::vector<PeerIdentity>& peers,
                             size_t hosts, const std::string& no_shared_memory,
                             const BackendEnvironment& environment) {
  if (!no_shared_memory.empty() || !environment.shared_memory) return "no shared memory";
  if (!environment.small_ops) return "FSDP_EXT_SMALL_OPS=0";
  if (peers.size() < 2) return "a group of one";
  if (hosts > 1) return "the group spans hosts";
  if (channel == nullptr) return "no channel";
  std::vector<pid_t> pids;
  std::vector<int> fds;
  for (size_t peer = 0; peer < peers.size(); ++peer) {
    if (peers[peer].small_ops_fd < 0) return "rank " + std::to_string(peer) + " has none";
    pids.push_back(peers[peer].pid);
    fds.push_back(peers[peer].small_ops_fd);
  }
  try {
    channel->connect(pids, fds);
  } catch (const comm::CommError& error) {
    return std::string("a peer's region could not be mapped: ") + error.what();
  }
  return "";
}

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::vector<FsdpExtBackend*>& registry() {
  static std::vector<FsdpExtBackend*> live;
  return live;
}

// "UCX transports: sysv/memory cma/memory (this host), tcp/eth0 (other
// hosts)": what UCX chose for the endpoints this rank made during the init
// op (rank 0: to every rank; the others: to rank 0), from the progress
// thread.
std::string describe_transports(comm::OpContext& context, const std::vector<bool>& remote_peers) {
  std::set<std::string> local, remote;
  for (int peer = 0; peer < context.size(); ++peer) {
    if (peer == context.rank()) continue;
    for (std::string& transport : context.transports_to(peer)) {
      (remote_peers[peer] ? remote : local).insert(std::move(transport));
    }
  }
  auto joined = [](const std::set<std::string>& names, const char* where) {
    std::string out;
    for (const std::string& name : names) out += (out.empty() ? "" : " ") + name;
    return out + " (" + where + ")";
  };
  if (local.empty() && remote.empty()) return "UCX transports: none (no endpoint yet)";
  std::string out = "UCX transports: ";
  if (!local.empty()) out += joined(local, "this host");
  if (!remote.empty()) out += (local.empty() ? "" : ", ") + joined(remote, "other hosts");
  return out;
}

}  // namespace

FsdpExtBackend::FsdpExtBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                               int size, std::chrono::milliseconds timeout,
                               std::string group_name, NcclFactory nccl_factory)
    : c10d::Backend(rank, size),
      default_timeout_(timeout),
      group_name_(std::move(group_name)),
      store_(store),
      nccl_factory_(std::move(nccl_factory)) {
  const OpLabel init_label = label("init");
  set_global_ranks({});
  TORCH_CHECK_VALUE(size >= 1 && size < comm::tag::kMaxRanks, init_label.prefix(),
                    "group size ", size, " is out of range");
  const BackendEnvironment environment = read_environment(init_label.prefix());
  cuda_choice_.path = environment.cuda_path;
  cuda_choice_.ipc_handles = environment.cuda_ipc_handles;
  std::string no_shared_memory, no_process_reads, no_small_ops, unwatched_peers, layout, cores,
      hosts_detail;
  size_t hosts = 0;
  // [0]: every peer's shared memory maps; [1]: process_vm_readv works too;
  // [2]: the small-op channel is connected.
  auto shared_ok = std::make_shared<std::array<int32_t, 3>>();
  std::vector<pid_t> pids;  // this host's ranks, by position (what the domain names)
  std::vector<bool> remote_peers;  // by rank: on another host
  try {
    auto transport = std::make_unique<comm::Transport>(rank, size);
    pool_ = std::make_shared<comm::SharedBufferPool>(transport->context());
    shared_memory_ = std::make_shared<comm::SharedMemoryDomain>(pool_);
    if (size >= 2 && environment.small_ops && environment.shared_memory) {
      small_ops_ = std::make_shared<comm::SmallOpChannel>(rank, size);
    }
    comm::PeerLiveness& liveness = comm::PeerLiveness::of_this_process();
    PeerIdentity mine{transport->worker_address(), this_host(), getpid(),
                      shared_memory_->probe_piece(),
                      reinterpret_cast<uint64_t>(&kProcessReadProbeValue), liveness.endpoint(),
                      liveness.address().token};
    mine.small_ops_fd = small_ops_ ? small_ops_->fd() : -1;
    std::vector<PeerIdentity> peers;
    std::vector<std::vector<uint8_t>> addresses;
    for (const auto& blob :
         exchange_addresses(*store, rank, size, serialize(mine), default_timeout_)) {
      peers.push_back(deserialize_peer_identity(blob, static_cast<int>(peers.size())));
      addresses.push_back(peers.back().worker_address);
    }
    transport->connect(addresses);
    const comm::HostTopology topology = host_topology(peers, rank);
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
    hosts = topology.hosts.size();
    std::set<std::string> machines;
    for (const PeerIdentity& peer : peers) machines.insert(machine_of(peer.host));
    if (machines.size() < hosts) {
      hosts_detail = " on " + std::to_string(machines.size()) +
                     (machines.size() == 1 ? " machine" : " machines") +
                     " (separate PID namespaces count as hosts)";
    }
    cores = describe_cores(topology.hosts[topology.host].size());
    no_small_ops =
        why_no_small_ops(small_ops_.get(), peers, hosts, no_shared_memory, environment);
    (*shared_ok)[0] = no_shared_memory.empty() ? 1 : 0;
    (*shared_ok)[1] = (*shared_ok)[0] && no_process_reads.empty() ? 1 : 0;
    (*shared_ok)[2] = (*shared_ok)[0] && no_small_ops.empty() ? 1 : 0;
    // Peers on other hosts are watched through an idle TCP connection per
    // pair of processes, shared by all their groups; one that cannot be
    // reached is not watched (its loss then surfaces at the op's timeout),
    // which the group's log line says.
    std::vector<comm::PeerLiveness::Address> addresses_of_peers;
    for (const PeerIdentity& peer : peers) {
      addresses_of_peers.push_back({peer.liveness_endpoint, peer.liveness_token});
      remote_peers.push_back(peer.host != peers[rank].host);
    }
    comm::PeerLiveness::Connected watched =
        liveness.connect(rank, addresses_of_peers, remote_peers,
                         std::min(default_timeout_, std::chrono::milliseconds(10000)));
    for (int peer : watched.missing) unwatched_peers += " " + std::to_string(peer);
    // Connections on the liveness port that were not this job's peers, since
    // the last group's creation: one line, at most once per group.
    if (const uint64_t refused = liveness.take_unreported_refusals(); refused > 0) {
      LOG(INFO) << "fsdp_ext group '" << group_name_ << "': rank " << rank
                << ": the liveness listener (" << liveness.endpoint() << ") refused "
                << refused
                << " connection(s) that did not prove to be this job's peers (no valid hello)";
    }
    comm::EngineConfig config;
    config.topology = topology;
    config.rank = rank;
    config.size = size;
    config.group_name = group_name_;
    config.spin = environment.spin;
    config.shared_memory = shared_memory_;
    config.small_ops = small_ops_;
    config.liveness = std::move(watched.connections);
    config.explain_timeout = [this](const comm::EngineActivity& mine) {
      return activity_board_ ? activity_board_->describe_others(
                                   mine, [this](int peer) { return engine_->describe_peer(peer); })
                             : std::string();
    };
    for (const PeerIdentity& peer : peers) {
      // Same host (this_host(): machine and PID namespace): the pid names the
      // peer's process here too, so the engine can watch it exit through a pidfd.
      config.peers.push_back(comm::PeerInfo{describe_host(peer.host, peers[rank].host), peer.pid,
                                            peer.host == peers[rank].host});
    }
    engine_ = std::make_unique<comm::ProgressEngine>(std::move(config), std::move(transport));
    activity_board_ = std::make_unique<PeerActivityBoard>(
        store, rank, size, [engine = engine_.get()] { return engine->activity(); });
  } catch (const comm::CommError& error) {
    C10_THROW_ERROR(DistBackendError, init_label.prefix() + error.what());
  } catch (const std::runtime_error& error) {
    C10_THROW_ERROR(DistBackendError, init_label.prefix() + error.what());
  } catch (const c10::DistError& error) {
    // The c10d store failed under us (its server gone, a network error):
    // still an error of this group's creation, named as such.
    C10_THROW_ERROR(DistBackendError, init_label.prefix() + "the c10d store failed: " +
                                          error.what_without_backtrace());
  }
  // Find a missing peer at init (within the timeout) rather than at the
  // first collective, and agree on shared memory: on only if every rank
  // could map every other rank's memory. A reduce to rank 0 and a broadcast
  // rather than an all-reduce: the small all-reduce's direct algorithm sends
  // to every rank, which would give every rank an endpoint to every other
  // (Note [an endpoint on first use]); this way the others send to rank 0
  // (and, in groups of more than 8, along the broadcast's ring) only.
  auto domain = shared_memory_;
  auto transports = std::make_shared<std::string>();
  auto work = enqueue(init_label, c10d::OpType::BARRIER, nullptr, true, default_timeout_, {},
                      {}, [shared_ok, domain, pids, remote_peers, transports](
                              comm::OpContext& context) {
                        const comm::MutableSpan agreed{shared_ok->data(), sizeof(*shared_ok)};
                        comm::reduce(context, agreed, 0,
                                     comm::ReduceSpec{comm::DataType::kInt32,
                                                      comm::ReduceKind::kMin});
                        comm::broadcast(context, agreed, 0);
                        if ((*shared_ok)[0] == 1) domain->enable(pids, (*shared_ok)[1] == 1);
                        // The endpoints made so far carried a message; their lanes are final.
                        *transports = describe_transports(context, remote_peers);
                      });
  work->wait();
  small_ops_enabled_ = (*shared_ok)[2] == 1;
  // One line per group (TORCH_CPP_LOG_LEVEL=INFO): what was agreed and, where
  // a feature is off, why this rank could not (or that another rank could not).
  auto state = [](bool on, const std::string& local_reason) {
    if (on) return std::string("on");
    return "off (" + (local_reason.empty() ? std::string("another rank could not")
                                           : local_reason) + ")";
  };
  LOG(INFO) << "fsdp_ext group '" << group_name_ << "': rank " << rank << "/" << size << ", "
            << hosts << (hosts == 1 ? " host" : " hosts") << hosts_detail << ", shared memory "
            << state((*shared_ok)[0] == 1, no_shared_memory) << ", process reads "
            << state((*shared_ok)[1] == 1, no_process_reads) << ", small-op channel "
            << state(small_ops_enabled_, no_small_ops) << ((*shared_ok)[0] == 1 ? layout : "")
            << cores << ", " << comm::describe_ucx_library() << ", " << *transports
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
  std::shared_ptr<CudaCollectives> cuda;
  {
    std::lock_guard<std::mutex> lock(cuda_mutex_);
    cuda = cuda_;
  }
  if (cuda) cuda->shutdown();
  if (activity_board_) activity_board_->stop();
  if (engine_) engine_->shutdown();
}

}  // namespace fsdp_ext::backend
