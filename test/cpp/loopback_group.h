// A process group of the comm core with its ranks as threads of this test
// process: one UCX worker, progress engine and shared-memory domain per rank,
// connected over UCX loopback exactly as the backend connects real ranks
// (worker addresses exchanged, then endpoints), but with no torch and no
// store. Shared memory works between threads as between processes: segments
// are memfds, mapped through the (here common) pid.
//
// Optionally the ranks are split into pretend hosts (a HostTopology), so the
// hierarchical algorithms run too: each host's ranks share a domain, and only
// the column exchange goes through UCX messages.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "comm/progress_engine.h"
#include "comm/shared_buffer_pool.h"
#include "comm/shared_memory_domain.h"
#include "comm/transport.h"
#include "scoped_variable.h"

namespace fsdp_ext::comm::testing {

struct LoopbackOptions {
  bool shared_memory = true;  // enable each rank's domain (as the init agreement would)
  bool process_reads = true;  // and process_vm_readv of ordinary memory
  int hosts = 1;              // pretend hosts, ranks split evenly in rank order
  // Instead: pretend hosts of these sizes, in rank order (unequal hosts get
  // no shared memory, as the init agreement decides for real groups).
  std::vector<int> host_sizes;
  std::string name = "loopback";
};

// What one rank runs inside its op: its rank and the op's context.
using RankBody = std::function<void(int rank, OpContext& context)>;

// Long enough for a sanitized build on a loaded 2-core machine; a test that
// needs a timeout to fire passes its own.
constexpr std::chrono::milliseconds kDefaultOpTimeout{60000};

class LoopbackGroup {
 public:
  explicit LoopbackGroup(int size, LoopbackOptions options = {}) : size_(size) {
    std::vector<std::unique_ptr<Transport>> transports;
    std::vector<std::vector<uint8_t>> addresses;
    for (int rank = 0; rank < size; ++rank) {
      transports.push_back(std::make_unique<Transport>(rank, size));
      addresses.push_back(transports.back()->worker_address());
      pools_.push_back(std::make_shared<SharedBufferPool>(transports.back()->context()));
      domains_.push_back(std::make_shared<SharedMemoryDomain>(pools_.back()));
    }
    for (auto& transport : transports) transport->connect(addresses);

    std::vector<int> host_sizes = options.host_sizes;
    if (host_sizes.empty()) host_sizes.assign(options.hosts, size / options.hosts);
    HostTopology topology;
    std::vector<int> host_of, local_of;
    for (int host = 0, rank = 0; host < static_cast<int>(host_sizes.size()); ++host) {
      topology.hosts.emplace_back();
      for (int local = 0; local < host_sizes[host]; ++local, ++rank) {
        topology.hosts.back().push_back(rank);
        host_of.push_back(host);
        local_of.push_back(local);
      }
    }
    if (static_cast<int>(host_of.size()) != size) {
      ADD_FAILURE() << "pretend host sizes add up to " << host_of.size() << ", not the group's "
                    << size << " ranks";
      std::abort();
    }
    const bool equal_hosts =
        std::all_of(host_sizes.begin(), host_sizes.end(),
                    [&](int ranks) { return ranks == host_sizes.front(); });
    for (int rank = 0; rank < size; ++rank) {
      EngineConfig config;
      config.rank = rank;
      config.size = size;
      config.group_name = options.name;
      config.topology = topology;
      config.topology.host = host_of[rank];
      config.topology.local = local_of[rank];
      if (options.shared_memory && equal_hosts) {
        // Every rank of a pretend host is this process: the domain names its
        // peers by their position on the host.
        domains_[rank]->enable(std::vector<pid_t>(host_sizes[host_of[rank]], getpid()),
                               options.process_reads);
        config.shared_memory = domains_[rank];
      }
      engines_.push_back(std::make_unique<ProgressEngine>(std::move(config),
                                                          std::move(transports[rank])));
    }
  }

  ~LoopbackGroup() {
    for (auto& engine : engines_) engine->shutdown();
  }

  int size() const { return size_; }
  ProgressEngine& engine(int rank) { return *engines_[rank]; }
  SharedBufferPool& pool(int rank) { return *pools_[rank]; }
  SharedMemoryDomain& domain(int rank) { return *domains_[rank]; }

  // Submits one op on `rank`; the future holds its outcome.
  std::future<OpOutcome> submit(int rank, const std::string& name, RankBody body,
                                std::chrono::milliseconds timeout = kDefaultOpTimeout,
                                bool collective = true,
                                CollectiveKind kind = CollectiveKind::kUnnamed) {
    auto done = std::make_shared<std::promise<OpOutcome>>();
    auto future = done->get_future();
    EngineOp op;
    op.name = name;
    op.collective = collective;
    op.kind = kind;
    op.timeout = timeout;
    op.body = [rank, body = std::move(body)](OpContext& context) { body(rank, context); };
    op.on_done = [done](const OpOutcome& outcome) { done->set_value(outcome); };
    engines_[rank]->submit(std::move(op));
    return future;
  }

  // Runs `body` as one collective on every rank and returns their outcomes.
  // A rank that does not finish within the op timeout plus a margin is a
  // test failure (the engine's own timeout should have fired), not a hang.
  std::vector<OpOutcome> run(const std::string& name, const RankBody& body,
                             std::chrono::milliseconds timeout = kDefaultOpTimeout) {
    std::vector<std::future<OpOutcome>> futures;
    for (int rank = 0; rank < size_; ++rank) futures.push_back(submit(rank, name, body, timeout));
    return collect(futures, timeout);
  }

  // Like run(), but fails the test on any rank's error.
  void run_ok(const std::string& name, const RankBody& body) {
    const auto outcomes = run(name, body);
    for (int rank = 0; rank < size_; ++rank) {
      EXPECT_TRUE(outcomes[rank].ok) << name << " on rank " << rank << ": "
                                     << outcomes[rank].message;
    }
  }

  // The outcome of one submitted op. An op that has not completed within
  // `budget` is a test failure, not a hang.
  static OpOutcome await(std::future<OpOutcome>& future, std::chrono::milliseconds budget) {
    if (future.wait_for(budget) != std::future_status::ready) {
      ADD_FAILURE() << "an op did not complete within " << budget.count() << " ms";
      std::abort();  // the engines still reference this test's buffers
    }
    return future.get();
  }

  // Every op's outcome, each allowed its timeout plus a margin (the engine's
  // own timeout should have fired by then).
  static std::vector<OpOutcome> collect(std::vector<std::future<OpOutcome>>& futures,
                                        std::chrono::milliseconds timeout) {
    std::vector<OpOutcome> outcomes;
    for (auto& future : futures) outcomes.push_back(await(future, timeout + std::chrono::seconds(30)));
    return outcomes;
  }

 private:
  int size_;
  std::vector<std::shared_ptr<SharedBufferPool>> pools_;
  std::vector<std::shared_ptr<SharedMemoryDomain>> domains_;
  std::vector<std::unique_ptr<ProgressEngine>> engines_;
};

}  // namespace fsdp_ext::comm::testing
