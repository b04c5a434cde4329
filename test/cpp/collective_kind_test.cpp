// Ranks that call different collectives at the same point: the op's kind in
// every collective tag keeps their messages apart, and a rank waiting on a
// peer reports the peer's other collective at once (Note [ranks that run
// different collectives], progress_engine.cpp) instead of exchanging data
// with it (an all-reduce and a broadcast of equal size used to complete
// with wrong results) or waiting for its timeout. A rank that only sends
// learns it from the failing peer's notice (Note [a failure told to the
// peers], comm/failure_notice.h).
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "comm/algorithms/algorithms.h"
#include "comm/collective_kind.h"
#include "comm/error.h"
#include "comm/tag_scheme.h"
#include "loopback_group.h"

namespace fsdp_ext::comm {
namespace {

using testing::LoopbackGroup;
using testing::LoopbackOptions;

TEST(CollectiveKindTags, KindRoundTripsWithoutTouchingOtherFields) {
  const uint64_t t = tag::collective(tag::kSeqMask, tag::kMaxSteps - 1, tag::kMaxRanks - 1,
                                     CollectiveKind::kCoalescedBatch);
  EXPECT_EQ(tag::kind_of(t), CollectiveKind::kCoalescedBatch);
  EXPECT_EQ(tag::sender_of(t), tag::kMaxRanks - 1);
  EXPECT_EQ((t >> tag::kSeqShift) & tag::kSeqMask, tag::kSeqMask);
  EXPECT_EQ(t & tag::kP2PBit, 0u);
  EXPECT_NE(tag::collective(7, 1, 2, CollectiveKind::kAllReduce),
            tag::collective(7, 1, 2, CollectiveKind::kBroadcast));
}

TEST(CollectiveKindTags, CollectiveSenderMaskKeepsOnlyTheSender) {
  const uint64_t posted = tag::collective(9, 0, 3, CollectiveKind::kAllGather);
  auto matches = [&](uint64_t incoming) {
    return (incoming & tag::kMatchCollectiveSender) == (posted & tag::kMatchCollectiveSender);
  };
  EXPECT_TRUE(matches(tag::collective(9, 5, 3, CollectiveKind::kReduceScatter)));
  EXPECT_TRUE(matches(tag::collective(10, 0, 3, CollectiveKind::kAllGather)));
  EXPECT_FALSE(matches(tag::collective(9, 0, 4, CollectiveKind::kAllGather)));
  EXPECT_FALSE(matches(tag::point_to_point(0, 3)));
  EXPECT_EQ(tag::seq_of(tag::collective(tag::kSeqMask + 12, 1, 2)), 11u);
}

// Each rank runs its own collective (and kind) as op #1 of a group whose
// ranks exchange UCX messages only, as across hosts.
struct Divergent {
  CollectiveKind kind;
  std::function<void(OpContext&)> body;
};

std::vector<OpOutcome> run_divergent(LoopbackGroup& group, const std::vector<Divergent>& ranks,
                                     std::chrono::milliseconds timeout,
                                     std::vector<std::chrono::milliseconds>* elapsed) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::future<OpOutcome>> futures;
  for (int r = 0; r < group.size(); ++r) {
    futures.push_back(group.submit(
        r, "divergent", [body = ranks[r].body](int, OpContext& context) { body(context); },
        timeout, /*collective=*/true, ranks[r].kind));
  }
  // Each rank's outcome and when it came, whichever finishes first.
  std::vector<OpOutcome> outcomes(futures.size());
  elapsed->assign(futures.size(), std::chrono::milliseconds(-1));
  const auto give_up = start + timeout + std::chrono::seconds(30);
  for (size_t pending = futures.size(); pending > 0;) {
    if (std::chrono::steady_clock::now() > give_up) {
      ADD_FAILURE() << "an op did not complete within its timeout and 30 s";
      std::abort();  // the engines still reference this test's buffers
    }
    for (size_t r = 0; r < futures.size(); ++r) {
      if (elapsed->at(r).count() >= 0 ||
          futures[r].wait_for(std::chrono::milliseconds(1)) != std::future_status::ready) {
        continue;
      }
      outcomes[r] = futures[r].get();
      (*elapsed)[r] = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - start);
      --pending;
    }
  }
  return outcomes;
}

const ReduceSpec kSum{DataType::kFloat32, ReduceKind::kSum};

TEST(DifferentCollectives, AllReduceAgainstBroadcastOfTheSameSizeIsReported) {
  LoopbackOptions options;
  options.shared_memory = false;
  LoopbackGroup group(2, options);
  // The broadcast's receiver (rank 1) holds rank 0's all-reduce message:
  // it reports at once. Rank 0 waits for a part rank 1 never sends (a
  // broadcast's receiver sends nothing) and learns of it from rank 1's
  // notice, also at once, not at its timeout.
  std::vector<std::vector<float>> data(2, std::vector<float>(1024, 1.0f));
  std::vector<std::chrono::milliseconds> elapsed;
  const auto timeout = std::chrono::milliseconds(4000);
  const auto outcomes = run_divergent(
      group,
      {{CollectiveKind::kAllReduce,
        [&](OpContext& c) { allreduce(c, MutableSpan{data[0].data(), 4096}, kSum); }},
       {CollectiveKind::kBroadcast,
        [&](OpContext& c) { broadcast(c, MutableSpan{data[1].data(), 4096}, 0); }}},
      timeout, &elapsed);
  ASSERT_FALSE(outcomes[1].ok) << "rank 1's broadcast took rank 0's all-reduce data";
  EXPECT_EQ(outcomes[1].kind, ErrorKind::kMismatch) << outcomes[1].message;
  for (const char* fragment : {"divergent", "rank 0", "is in an all-reduce",
                               "where this rank is in a broadcast", "different collectives"}) {
    EXPECT_NE(outcomes[1].message.find(fragment), std::string::npos)
        << fragment << " not in: " << outcomes[1].message;
  }
  EXPECT_LT(elapsed[1], timeout / 4) << "rank 1 waited for the timeout";
  ASSERT_FALSE(outcomes[0].ok);
  EXPECT_EQ(outcomes[0].kind, ErrorKind::kPeerFailed) << outcomes[0].message;
  for (const char* fragment : {"divergent (group 'loopback', rank 0/2, op #1)",
                               "rank 1 stopped the group after its op #1 failed there",
                               "is in an all-reduce where this rank is in a broadcast"}) {
    EXPECT_NE(outcomes[0].message.find(fragment), std::string::npos)
        << fragment << " not in: " << outcomes[0].message;
  }
  EXPECT_LT(elapsed[0], timeout / 4) << "rank 0 waited for the timeout";
}

TEST(DifferentCollectives, AllGatherAgainstReduceScatterFailsBothRanksAtOnce) {
  LoopbackOptions options;
  options.shared_memory = false;
  LoopbackGroup group(2, options);
  // Byte counts chosen so both ops move 8 KiB each way: by size alone the
  // ranks would match.
  std::vector<float> gather_input(2048, 1.0f), gather_output(4096);
  std::vector<float> scatter_input(4096, 2.0f), scatter_output(2048);
  std::vector<std::chrono::milliseconds> elapsed;
  const auto timeout = std::chrono::milliseconds(20000);
  const auto outcomes = run_divergent(
      group,
      {{CollectiveKind::kAllGather,
        [&](OpContext& c) {
          allgather(c, ConstSpan{gather_input.data(), 8192},
                    {MutableSpan{gather_output.data(), 8192},
                     MutableSpan{gather_output.data() + 2048, 8192}});
        }},
       {CollectiveKind::kReduceScatter,
        [&](OpContext& c) {
          reduce_scatter(c, {ConstSpan{scatter_input.data(), 8192},
                             ConstSpan{scatter_input.data() + 2048, 8192}},
                         MutableSpan{scatter_output.data(), 8192}, kSum);
        }}},
      timeout, &elapsed);
  const char* kinds[] = {"an all-gather", "a reduce-scatter"};
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(outcomes[r].ok) << "rank " << r << " completed against another collective";
    // Each rank sees the other's message; the one that looks first may
    // also tell the other before it looks (then the other reports that
    // notice, which carries the first one's view).
    const std::string& message = outcomes[r].message;
    if (outcomes[r].kind == ErrorKind::kPeerFailed) {
      EXPECT_NE(message.find("rank " + std::to_string(1 - r) + " stopped the group"),
                std::string::npos) << message;
      EXPECT_NE(message.find(std::string("where this rank is in ") + kinds[1 - r]),
                std::string::npos) << message;
    } else {
      EXPECT_EQ(outcomes[r].kind, ErrorKind::kMismatch) << message;
      EXPECT_NE(message.find(std::string("where this rank is in ") + kinds[r]),
                std::string::npos) << message;
      EXPECT_NE(message.find(std::string(" is in ") + kinds[1 - r]), std::string::npos)
          << message;
    }
  }
  EXPECT_TRUE(outcomes[0].kind == ErrorKind::kMismatch || outcomes[1].kind == ErrorKind::kMismatch)
      << "neither rank saw the other's collective itself";
  for (int r = 0; r < 2; ++r) {
    EXPECT_LT(elapsed[r], timeout / 4) << "rank " << r << " waited for the timeout";
  }
}

TEST(DifferentCollectives, HostsInDifferentCollectivesFailAcrossTheColumns) {
  // Two pretend hosts of two ranks: host 0 all-reduces while host 1
  // all-gathers, each host in agreement with itself. Only the exchange
  // between the hosts (UCX messages, inside a phase of the hierarchical op)
  // sees both; it must carry the op's kind and report it.
  LoopbackOptions options;
  options.hosts = 2;
  LoopbackGroup group(4, options);
  std::vector<std::vector<float>> data(4, std::vector<float>(8192, 1.0f));
  std::vector<std::vector<float>> gathered(4, std::vector<float>(4 * 2048));
  std::vector<Divergent> ranks;
  for (int r = 0; r < 4; ++r) {
    if (r < 2) {
      ranks.push_back({CollectiveKind::kAllReduce, [&, r](OpContext& c) {
                         allreduce(c, MutableSpan{data[r].data(), 8192 * sizeof(float)}, kSum);
                       }});
    } else {
      ranks.push_back({CollectiveKind::kAllGather, [&, r](OpContext& c) {
                         std::vector<MutableSpan> outputs;
                         for (int p = 0; p < 4; ++p) {
                           outputs.push_back({gathered[r].data() + p * 2048, 2048 * sizeof(float)});
                         }
                         allgather(c, ConstSpan{data[r].data(), 2048 * sizeof(float)}, outputs);
                       }});
    }
  }
  std::vector<std::chrono::milliseconds> elapsed;
  const auto timeout = std::chrono::milliseconds(4000);
  const auto outcomes = run_divergent(group, ranks, timeout, &elapsed);
  // Some rank of a column sees the other host's collective; every other
  // rank (its own host's peer in the phase within the host, the ranks
  // whose part across was only sends) learns it from that rank's notice.
  int reported = 0;
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(outcomes[r].ok) << "rank " << r << " completed against another collective";
    const std::string& message = outcomes[r].message;
    EXPECT_NE(message.find("(the ranks called different collectives"), std::string::npos)
        << "rank " << r << ": " << message;
    if (outcomes[r].kind == ErrorKind::kMismatch) {
      ++reported;
    } else {
      EXPECT_EQ(outcomes[r].kind, ErrorKind::kPeerFailed) << message;
      EXPECT_NE(message.find("stopped the group after its op #"), std::string::npos) << message;
    }
    EXPECT_LT(elapsed[r], timeout / 2) << "rank " << r << ": " << message;
  }
  EXPECT_GE(reported, 1) << outcomes[0].message << "\n" << outcomes[2].message;
}

}  // namespace
}  // namespace fsdp_ext::comm
