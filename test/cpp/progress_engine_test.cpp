// The progress engine's failure paths with ranks as threads: a collective a
// peer never joins times out with a message naming what it waited for and
// leaves the group refusing work; abort() fails the running and queued ops
// at once; shutdown() finishes what can finish, fails pending point-to-point
// ops, and refuses ops submitted afterwards; a rank that left the group is
// a failure at once to the peers it told and, through them, to the rest.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "comm/algorithms/algorithms.h"
#include "comm/error.h"
#include "loopback_group.h"

namespace fsdp_ext::comm {
namespace {

using testing::LoopbackGroup;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

testing::RankBody allreduce_of(std::vector<std::vector<float>>& data) {
  return [&data](int r, OpContext& context) {
    allreduce(context, MutableSpan{data[r].data(), data[r].size() * sizeof(float)},
              ReduceSpec{DataType::kFloat32, ReduceKind::kSum});
  };
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(ProgressEngine, ACollectiveAfterAPeerDestroyedTheGroupFailsAtOnce) {
  // Note [a peer that destroyed the group]: rank 0 shuts its engine down
  // after two collectives; rank 1's second still completes (rank 0 took
  // part), its third fails at once, not at its 20 s timeout.
  LoopbackGroup group(2);
  std::vector<std::vector<float>> data(2, std::vector<float>(1024, 1.0f));
  group.run_ok("allreduce", allreduce_of(data));
  auto second = group.submit(0, "allreduce", allreduce_of(data));
  auto waiting = group.submit(1, "allreduce", allreduce_of(data), milliseconds(20000));
  EXPECT_TRUE(LoopbackGroup::await(second, milliseconds(20000)).ok);
  group.engine(0).shutdown();
  EXPECT_TRUE(LoopbackGroup::await(waiting, milliseconds(20000)).ok);
  const auto start = Clock::now();
  auto third = group.submit(1, "allreduce", allreduce_of(data), milliseconds(20000));
  const OpOutcome outcome = LoopbackGroup::await(third, milliseconds(20000));
  EXPECT_LT(Clock::now() - start, milliseconds(5000));
  ASSERT_FALSE(outcome.ok);
  EXPECT_EQ(outcome.kind, ErrorKind::kPeerLeft) << outcome.message;
  EXPECT_TRUE(contains(outcome.message, "destroyed this group")) << outcome.message;
  EXPECT_TRUE(contains(outcome.message, "after the group's collective #2; collective #3"))
      << outcome.message;
}

TEST(ProgressEngine, ARankTheDepartedPeerNeverTalkedToHearsOfItFromTheOneThatDid) {
  // Note [a peer that destroyed the group]: a departing rank tells only the
  // peers it has endpoints to. Here rank 0 has sent to rank 1 alone; rank 2
  // has exchanged nothing with it. After rank 0's shutdown, rank 1's next
  // collective (waiting on rank 0) fails once the departure notice is in,
  // whether that is before or during the op, and rank 1 passes that on: rank
  // 2, waiting in the same collective on rank 1, fails within seconds too,
  // naming rank 0, instead of at its 20 s timeout.
  testing::LoopbackOptions options;
  options.shared_memory = false;
  LoopbackGroup group(3, options);
  group.run_ok("zero_to_one", [](int r, OpContext& context) {
    int value = 7;
    std::vector<Request> requests;
    if (r == 0) requests.push_back(context.send(1, 0, &value, sizeof(value)));
    if (r == 1) requests.push_back(context.recv(0, 0, &value, sizeof(value)));
    context.wait_all(requests);
  });
  group.engine(0).shutdown();
  const auto told = Clock::now() + milliseconds(5000);
  const testing::RankBody each_waits_on_the_one_before = [](int r, OpContext& context) {
    int value = 0;
    std::vector<Request> requests{context.recv(r - 1, 0, &value, sizeof(value))};
    context.wait_all(requests);
  };
  auto waiting = group.submit(2, "wait", each_waits_on_the_one_before, milliseconds(20000));
  auto telling = group.submit(1, "wait", each_waits_on_the_one_before, milliseconds(20000));
  const OpOutcome teller = LoopbackGroup::await(telling, milliseconds(20000));
  ASSERT_FALSE(teller.ok);
  EXPECT_EQ(teller.kind, ErrorKind::kPeerLeft) << teller.message;
  EXPECT_TRUE(contains(teller.message, "rank 0")) << teller.message;
  EXPECT_TRUE(contains(teller.message, "destroyed this group")) << teller.message;
  const OpOutcome outcome = LoopbackGroup::await(waiting, milliseconds(20000));
  EXPECT_LT(Clock::now(), told) << "rank 2 waited for its timeout: " << outcome.message;
  ASSERT_FALSE(outcome.ok);
  EXPECT_EQ(outcome.kind, ErrorKind::kPeerFailed) << outcome.message;
  EXPECT_TRUE(contains(outcome.message, "fsdp_ext wait (group 'loopback', rank 2/3, op #2)"))
      << outcome.message;
  EXPECT_TRUE(contains(outcome.message, "rank 1")) << outcome.message;
  EXPECT_TRUE(contains(outcome.message, "destroyed this group")) << outcome.message;
  EXPECT_TRUE(contains(outcome.message, "after the group's collective #1; collective #2"))
      << outcome.message;
}

TEST(ProgressEngine, ACollectiveAPeerNeverJoinsTimesOutAndBreaksTheGroup) {
  LoopbackGroup group(3);
  std::vector<std::vector<float>> data(3, std::vector<float>(16, 1.0f));
  // Ranks 0 and 1 enter; rank 2 never does.
  const auto start = Clock::now();
  std::vector<std::future<OpOutcome>> futures;
  for (int r = 0; r < 2; ++r) {
    futures.push_back(group.submit(r, "allreduce", allreduce_of(data), milliseconds(300)));
  }
  const auto outcomes = LoopbackGroup::collect(futures, milliseconds(300));
  const auto took = Clock::now() - start;
  EXPECT_GE(took, milliseconds(290));
  EXPECT_LT(took, milliseconds(5000));
  int timed_out = 0;
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(outcomes[r].ok);
    const std::string& message = outcomes[r].message;
    EXPECT_TRUE(contains(message, "fsdp_ext allreduce (group 'loopback', rank " +
                                      std::to_string(r) + "/3, op #1)"))
        << message;
    // Its own timeout, or the other rank's, told a moment earlier (Note [a
    // failure told to the peers]): either way it says so and names the peer
    // waited for.
    if (outcomes[r].kind == ErrorKind::kTimeout) {
      ++timed_out;
    } else {
      EXPECT_EQ(outcomes[r].kind, ErrorKind::kPeerFailed) << message;
      EXPECT_TRUE(contains(message, "rank " + std::to_string(1 - r) + " stopped the group"))
          << message;
    }
    EXPECT_TRUE(contains(message, "timed out after 300 ms")) << message;
    EXPECT_TRUE(contains(message, "receive from rank 2")) << message;
  }
  EXPECT_GE(timed_out, 1);
  // Peers may still be in that op: the group refuses further collectives.
  auto next = group.submit(0, "broadcast", [](int, OpContext& context) {
    char byte = 0;
    broadcast(context, MutableSpan{&byte, 1}, 0);
  });
  const OpOutcome refused = LoopbackGroup::await(next, milliseconds(5000));
  EXPECT_FALSE(refused.ok);
  // The refusal keeps the kind of the failure it repeats: rank 0's own
  // timeout (kBroken), or rank 1's notice when that came first.
  EXPECT_EQ(refused.kind,
            outcomes[0].kind == ErrorKind::kTimeout ? ErrorKind::kBroken : ErrorKind::kPeerFailed)
      << refused.message;
  EXPECT_TRUE(contains(refused.message, "unusable after an earlier failure")) << refused.message;
  EXPECT_TRUE(contains(refused.message, "timed out")) << refused.message;
  EXPECT_FALSE(group.engine(0).broken_reason().empty());
  // Rank 2, which never joined, hears of it from the ranks that timed out
  // (Note [a failure told to the peers]), and refuses work at once.
  std::string told;
  for (const auto until = Clock::now() + milliseconds(5000);
       told.empty() && Clock::now() < until;) {
    told = group.engine(2).broken_reason();
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_TRUE(contains(told, "stopped the group after its op #1 failed there")) << told;
  EXPECT_TRUE(contains(told, "timed out after 300 ms")) << told;
  auto late = group.submit(2, "allreduce", allreduce_of(data), milliseconds(60000));
  const OpOutcome late_outcome = LoopbackGroup::await(late, milliseconds(5000));
  EXPECT_FALSE(late_outcome.ok);
  EXPECT_EQ(late_outcome.kind, ErrorKind::kPeerFailed) << late_outcome.message;
  EXPECT_TRUE(contains(late_outcome.message, "rank 2/3")) << late_outcome.message;
}

TEST(ProgressEngine, AbortFailsTheRunningAndQueuedOpsAtOnce) {
  LoopbackGroup group(2);
  std::vector<std::vector<float>> data(2, std::vector<float>(8191, 1.0f));
  // Rank 0 waits (up to a minute) for rank 1, which never comes; a second op
  // is queued behind it.
  auto running = group.submit(0, "allreduce", allreduce_of(data), milliseconds(60000));
  auto queued = group.submit(0, "allreduce", allreduce_of(data), milliseconds(60000));
  std::this_thread::sleep_for(milliseconds(50));
  const auto start = Clock::now();
  group.engine(0).abort("the test aborted the group");
  EXPECT_LT(Clock::now() - start, milliseconds(5000));  // abort() returns promptly
  for (auto* future : {&running, &queued}) {
    const OpOutcome outcome = LoopbackGroup::await(*future, milliseconds(5000));
    EXPECT_FALSE(outcome.ok);
    EXPECT_EQ(outcome.kind, ErrorKind::kAborted);
    EXPECT_TRUE(contains(outcome.message, "aborted (the test aborted the group)"))
        << outcome.message;
  }
  // After abort the engine is shut down: new ops are refused, not queued.
  auto late = group.submit(0, "barrier", [](int, OpContext& context) { barrier(context); });
  const OpOutcome refused = LoopbackGroup::await(late, milliseconds(1000));
  EXPECT_FALSE(refused.ok);
  EXPECT_EQ(refused.kind, ErrorKind::kAborted);
  EXPECT_TRUE(contains(refused.message, "already shut down")) << refused.message;
}

TEST(ProgressEngine, AbortAfterAStreamOfOpsFailsOnlyWhatIsLeft) {
  // Rank 0 submits 5 all-reduces, rank 1 submits 10: rank 1's first five
  // complete with rank 0's, its sixth waits for a peer that never comes and
  // the rest queue behind it. Aborting rank 1 then fails exactly those five.
  LoopbackGroup group(2);
  std::vector<std::vector<float>> data(2, std::vector<float>(100000, 1.0f));
  std::vector<std::future<OpOutcome>> futures[2];
  for (int r = 0; r < 2; ++r) {
    for (int i = 0; i < (r == 0 ? 5 : 10); ++i) {
      futures[r].push_back(group.submit(r, "allreduce", allreduce_of(data), milliseconds(60000)));
    }
  }
  for (auto& future : futures[0]) {
    const OpOutcome outcome = LoopbackGroup::await(future, milliseconds(30000));
    EXPECT_TRUE(outcome.ok) << outcome.message;
  }
  for (int i = 0; i < 5; ++i) {
    const OpOutcome outcome = LoopbackGroup::await(futures[1][i], milliseconds(30000));
    EXPECT_TRUE(outcome.ok) << outcome.message;
  }
  group.engine(1).abort("stop midway");
  for (int i = 5; i < 10; ++i) {
    const OpOutcome outcome = LoopbackGroup::await(futures[1][i], milliseconds(5000));
    EXPECT_FALSE(outcome.ok) << "op " << i;
    EXPECT_EQ(outcome.kind, ErrorKind::kAborted) << outcome.message;
  }
  // 2^5 after five sums of two ranks' equal buffers.
  EXPECT_EQ(data[0][0], 32.0f);
}

TEST(ProgressEngine, ShutdownFinishesQueuedCollectivesThatCanComplete) {
  LoopbackGroup group(2);
  std::vector<std::vector<float>> data(2, std::vector<float>(3, 2.0f));
  std::vector<std::future<OpOutcome>> futures;
  for (int r = 0; r < 2; ++r) {
    futures.push_back(group.submit(r, "allreduce", allreduce_of(data), milliseconds(30000)));
  }
  // Shut both down at once while the op may still be queued or running.
  std::thread other([&] { group.engine(1).shutdown(); });
  group.engine(0).shutdown();
  other.join();
  for (auto& future : futures) {
    const OpOutcome outcome = LoopbackGroup::await(future, milliseconds(1000));
    EXPECT_TRUE(outcome.ok) << outcome.message;
  }
  for (int r = 0; r < 2; ++r) EXPECT_EQ(data[r], std::vector<float>(3, 4.0f));
  group.engine(0).shutdown();  // idempotent
}

TEST(ProgressEngine, ShutdownFailsPendingPointToPointOps) {
  LoopbackGroup group(2);
  int32_t never_sent = 0;
  // A receive nobody will match, posted and left to complete in the
  // background as dist.irecv does.
  auto receive = group.submit(
      0, "recv",
      [&](int, OpContext& context) { context.detach(context.recv_user(1, 7, &never_sent, 4)); },
      milliseconds(60000), /*collective=*/false);
  std::this_thread::sleep_for(milliseconds(20));
  group.engine(0).shutdown();
  const OpOutcome outcome = LoopbackGroup::await(receive, milliseconds(1000));
  EXPECT_FALSE(outcome.ok);
  EXPECT_EQ(outcome.kind, ErrorKind::kAborted);
  EXPECT_TRUE(contains(outcome.message, "shut down or aborted with this operation pending"))
      << outcome.message;
}

TEST(ProgressEngine, AnUnmatchedReceiveTimesOutNamingItsPeerAndSize) {
  LoopbackGroup group(2);
  int32_t never_sent = 0;
  auto receive = group.submit(
      0, "recv",
      [&](int, OpContext& context) { context.detach(context.recv_user(1, 7, &never_sent, 4)); },
      milliseconds(300), /*collective=*/false);
  const OpOutcome outcome = LoopbackGroup::await(receive, milliseconds(5000));
  EXPECT_FALSE(outcome.ok);
  EXPECT_EQ(outcome.kind, ErrorKind::kTimeout) << outcome.message;
  EXPECT_TRUE(contains(outcome.message, "fsdp_ext recv (group 'loopback', rank 0/2): "
                                        "timed out after 300 ms; rank 1"))
      << outcome.message;
  EXPECT_TRUE(contains(outcome.message, "sent nothing to this receive of 4 bytes"))
      << outcome.message;
  // A point-to-point timeout leaves the group usable.
  EXPECT_TRUE(group.engine(0).broken_reason().empty());
}

TEST(ProgressEngine, AnErrorFromBelowTheOpIsNamedWithTheOp) {
  LoopbackGroup group(1);
  auto failing = group.submit(0, "all_gather", [](int, OpContext&) {
    throw CommError(ErrorKind::kTransport, "opening a peer's shared segment: Permission denied");
  });
  const OpOutcome outcome = LoopbackGroup::await(failing, milliseconds(5000));
  EXPECT_FALSE(outcome.ok);
  EXPECT_EQ(outcome.message,
            "fsdp_ext all_gather (group 'loopback', rank 0/1, op #1): opening a peer's shared "
            "segment: Permission denied");
}

TEST(ProgressEngine, PointToPointCompletesInTheBackgroundWhileCollectivesRun) {
  // isend / irecv posted as ops of their own complete while a later
  // collective runs, and a receive from any sender reports who sent.
  LoopbackGroup group(2);
  int32_t payload = 1234, received = 0;
  auto receive = group.submit(
      1, "recv",
      [&](int, OpContext& context) { context.detach(context.recv_user(-1, 3, &received, 4)); },
      milliseconds(30000), false);
  auto send = group.submit(
      0, "send",
      [&](int, OpContext& context) { context.detach(context.send_user(1, 3, &payload, 4)); },
      milliseconds(30000), false);
  std::vector<std::vector<float>> data(2, std::vector<float>(5, 1.0f));
  group.run_ok("allreduce", allreduce_of(data));
  const OpOutcome received_outcome = LoopbackGroup::await(receive, milliseconds(30000));
  const OpOutcome sent_outcome = LoopbackGroup::await(send, milliseconds(30000));
  EXPECT_TRUE(received_outcome.ok) << received_outcome.message;
  EXPECT_TRUE(sent_outcome.ok) << sent_outcome.message;
  EXPECT_EQ(received, 1234);
  EXPECT_EQ(received_outcome.source_rank, 0);
}

TEST(ProgressEngine, AReceiveLargerThanTheMessageSentIsAMismatch) {
  LoopbackGroup group(2);
  std::vector<char> small(10, 'x'), large(20, 0);
  const auto outcomes = group.run(
      "p2p sizes",
      [&](int r, OpContext& context) {
        std::vector<Request> requests;
        if (r == 0) requests.push_back(context.send(1, 0, small.data(), small.size()));
        if (r == 1) requests.push_back(context.recv(0, 0, large.data(), large.size()));
        context.wait_all(requests);
      },
      milliseconds(5000));
  EXPECT_TRUE(outcomes[0].ok) << outcomes[0].message;
  ASSERT_FALSE(outcomes[1].ok);
  EXPECT_EQ(outcomes[1].kind, ErrorKind::kMismatch) << outcomes[1].message;
}

TEST(ProgressEngine, CountsOpsAndSequenceNumbers) {
  LoopbackGroup group(2);
  std::vector<std::vector<float>> data(2, std::vector<float>(4, 1.0f));
  for (int i = 0; i < 3; ++i) group.run_ok("allreduce", allreduce_of(data));
  EXPECT_EQ(group.engine(0).ops_run(), 3u);
  EXPECT_EQ(group.engine(0).sequences_used(), 3u);
  const EngineActivity activity = group.engine(1).activity();
  EXPECT_FALSE(activity.in_collective);
  EXPECT_EQ(activity.seq, 3u);
  EXPECT_EQ(activity.op, "allreduce");
}

}  // namespace
}  // namespace fsdp_ext::comm
