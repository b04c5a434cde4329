// The small-op channel and its collectives, with ranks as threads of this
// process (regions are memfds mapped through /proc/<our pid>/fd, as between
// processes), and the engine's Turn that lets a caller run them itself.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "comm/algorithms/small_ops.h"
#include "comm/error.h"
#include "comm/small_op_channel.h"
#include "loopback_group.h"

namespace fsdp_ext::comm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<std::unique_ptr<SmallOpChannel>> connected_channels(int size) {
  std::vector<std::unique_ptr<SmallOpChannel>> channels;
  std::vector<int> fds;
  for (int rank = 0; rank < size; ++rank) {
    channels.push_back(std::make_unique<SmallOpChannel>(rank, size));
    fds.push_back(channels.back()->fd());
  }
  const std::vector<pid_t> pids(size, getpid());
  for (auto& channel : channels) channel->connect(pids, fds);
  return channels;
}

ChannelWait wait_for(std::chrono::milliseconds timeout) {
  ChannelWait wait;
  wait.deadline = Clock::now() + timeout;
  wait.timeout = timeout;
  wait.spin = 50us;
  wait.description = "test op";
  return wait;
}

// Runs `body(rank)` on one thread per rank; returns each rank's exception
// message ("" when it returned normally).
template <typename Body>
std::vector<std::string> on_every_rank(int size, Body body) {
  std::vector<std::future<std::string>> futures;
  for (int rank = 0; rank < size; ++rank) {
    futures.push_back(std::async(std::launch::async, [rank, &body]() -> std::string {
      try {
        body(rank);
        return "";
      } catch (const CommError& error) {
        return std::string(error.kind() == ErrorKind::kMismatch ? "mismatch: " : "other: ") +
               error.what();
      }
    }));
  }
  std::vector<std::string> out;
  for (auto& future : futures) {
    if (future.wait_for(60s) != std::future_status::ready) {
      ADD_FAILURE() << "a rank did not finish within 60 s";
      std::abort();
    }
    out.push_back(future.get());
  }
  return out;
}

class SmallOps : public ::testing::TestWithParam<int> {};

// Many consecutive ops of every kind and awkward sizes, so both slots are
// reused many times over while fast ranks run ahead of slow ones.
TEST_P(SmallOps, ThousandsOfMixedOpsGiveExactResults) {
  const int n = GetParam();
  auto channels = connected_channels(n);
  const std::vector<size_t> counts = {0, 1, 3, 1023, 8191, SmallOpChannel::kMaxBytes / 4};
  const auto errors = on_every_rank(n, [&](int rank) {
    SmallOpChannel& channel = *channels[rank];
    const ReduceSpec sum{DataType::kInt32, ReduceKind::kSum};
    for (int iteration = 0; iteration < 1000; ++iteration) {
      const size_t count = counts[iteration % counts.size()];
      std::vector<int32_t> data(count);
      for (size_t i = 0; i < count; ++i) data[i] = rank * 1000 + iteration + static_cast<int>(i);
      const size_t bytes = count * sizeof(int32_t);
      switch (iteration % 5) {
        case 0: {
          start_small_allreduce(channel, iteration + 1, {data.data(), bytes}, sum);
          channel.wait(wait_for(30s));
          finish_small_allreduce(channel, {data.data(), bytes}, sum);
          for (size_t i = 0; i < count; ++i) {
            const int expected = 1000 * n * (n - 1) / 2 + n * (iteration + static_cast<int>(i));
            ASSERT_EQ(data[i], expected) << "all-reduce, iteration " << iteration << ", i " << i;
          }
          break;
        }
        case 1: {
          std::vector<int32_t> gathered(count * n, -1);
          std::vector<MutableSpan> outputs;
          for (int r = 0; r < n; ++r) outputs.push_back({gathered.data() + r * count, bytes});
          start_small_allgather(channel, iteration + 1, {data.data(), bytes});
          channel.wait(wait_for(30s));
          finish_small_allgather(channel, outputs);
          for (int r = 0; r < n; ++r) {
            for (size_t i = 0; i < count; ++i) {
              ASSERT_EQ(gathered[r * count + i], r * 1000 + iteration + static_cast<int>(i));
            }
          }
          break;
        }
        case 2: {
          const int root = iteration % n;
          start_small_broadcast(channel, iteration + 1, {data.data(), bytes}, root);
          channel.wait(wait_for(30s));
          finish_small_broadcast(channel, {data.data(), bytes}, root);
          for (size_t i = 0; i < count; ++i) {
            ASSERT_EQ(data[i], root * 1000 + iteration + static_cast<int>(i));
          }
          break;
        }
        case 3: {
          // The input: the first n blocks of count / n elements.
          const size_t block = count / n;
          std::vector<int32_t> mine(block, -1);
          start_small_reduce_scatter(channel, iteration + 1,
                                     {data.data(), block * n * sizeof(int32_t)}, sum);
          channel.wait(wait_for(30s));
          finish_small_reduce_scatter(channel, {mine.data(), block * sizeof(int32_t)}, sum);
          for (size_t i = 0; i < block; ++i) {
            const int index = static_cast<int>(rank * block + i);
            ASSERT_EQ(mine[i], 1000 * n * (n - 1) / 2 + n * (iteration + index))
                << "reduce-scatter, iteration " << iteration << ", i " << i;
          }
          break;
        }
        default:
          start_small_barrier(channel, iteration + 1);
          channel.wait(wait_for(30s));
          finish_small_barrier(channel);
      }
    }
  });
  for (int rank = 0; rank < n; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}

INSTANTIATE_TEST_SUITE_P(Ranks, SmallOps, ::testing::Values(2, 3, 4, 5),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

TEST(SmallOpsReductions, AverageAndPremultipliedSumOfFloats) {
  auto channels = connected_channels(3);
  const auto errors = on_every_rank(3, [&](int rank) {
    SmallOpChannel& channel = *channels[rank];
    std::vector<double> values = {1.0 + rank, 2.0 * rank, -3.0};
    ReduceSpec average{DataType::kFloat64, ReduceKind::kSum, 1.0, 3.0};
    start_small_allreduce(channel, 1, {values.data(), 24}, average);
    channel.wait(wait_for(30s));
    finish_small_allreduce(channel, {values.data(), 24}, average);
    EXPECT_DOUBLE_EQ(values[0], 2.0);
    EXPECT_DOUBLE_EQ(values[1], 2.0);
    EXPECT_DOUBLE_EQ(values[2], -3.0);
    std::vector<float> halves = {1.0f, static_cast<float>(rank)};
    ReduceSpec premul{DataType::kFloat32, ReduceKind::kSum, 0.5, 1.0};
    start_small_allreduce(channel, 2, {halves.data(), 8}, premul);
    channel.wait(wait_for(30s));
    finish_small_allreduce(channel, {halves.data(), 8}, premul);
    EXPECT_FLOAT_EQ(halves[0], 1.5f);
    EXPECT_FLOAT_EQ(halves[1], 1.5f);
  });
  for (const std::string& error : errors) EXPECT_EQ(error, "");
}

TEST(SmallOpsErrors, DifferentOpsOrSizesFailOnEveryRankNamingBoth) {
  auto channels = connected_channels(3);
  const auto errors = on_every_rank(3, [&](int rank) {
    SmallOpChannel& channel = *channels[rank];
    std::vector<float> data(rank == 2 ? 3 : 2, 1.0f);
    start_small_allreduce(channel, 1, {data.data(), data.size() * 4},
                          ReduceSpec{DataType::kFloat32, ReduceKind::kMax});
    channel.wait(wait_for(30s));
    finish_small_allreduce(channel, {data.data(), data.size() * 4},
                           ReduceSpec{DataType::kFloat32, ReduceKind::kMax});
  });
  EXPECT_NE(errors[0].find("mismatch: "), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("rank 2 called all_reduce (float32 MAX) of 12 bytes where rank 0 "
                           "called all_reduce (float32 MAX) of 8 bytes"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[2].find("rank 0 called all_reduce (float32 MAX) of 8 bytes where rank 2"),
            std::string::npos)
      << errors[2];
  EXPECT_NE(errors[1].find("mismatch: "), std::string::npos) << errors[1];
}

// The same op and size, but the ranks number it differently: their
// collectives on the group drifted apart (one issued one more). Both say so,
// with both numbers, instead of combining parts of different collectives.
TEST(SmallOpsErrors, RanksAtDifferentCollectivesFailNamingBothNumbers) {
  auto channels = connected_channels(2);
  const auto errors = on_every_rank(2, [&](int rank) {
    SmallOpChannel& channel = *channels[rank];
    float value = 1.0f;
    const ReduceSpec spec{DataType::kFloat32, ReduceKind::kSum};
    start_small_allreduce(channel, rank == 0 ? 41 : 42, {&value, 4}, spec);
    channel.wait(wait_for(30s));
    finish_small_allreduce(channel, {&value, 4}, spec);
  });
  EXPECT_NE(errors[0].find("mismatch: rank 1's part is its exchange 1 (the group's collective "
                           "#42, all_reduce (float32 SUM) of 4 bytes) where rank 0 is at "
                           "exchange 1 (collective #41"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("mismatch: rank 0's part is its exchange 1 (the group's collective #41"),
            std::string::npos)
      << errors[1];
  EXPECT_NE(errors[1].find("out of step"), std::string::npos) << errors[1];
}

TEST(SmallOpsErrors, AContributionLargerThanASlotIsRefused) {
  SmallOpChannel channel(0, 2);
  std::vector<char> data(SmallOpChannel::kMaxBytes + 1);
  try {
    start_small_allgather(channel, 1, {data.data(), data.size()});
    FAIL() << "no error";
  } catch (const CommError& error) {
    EXPECT_NE(std::string(error.what()).find("65537 bytes exceeds the 65536-byte slot"),
              std::string::npos)
        << error.what();
  }
  EXPECT_TRUE(takes_small_op_channel(SmallOpChannel::kMaxBytes, nullptr));
  EXPECT_FALSE(takes_small_op_channel(SmallOpChannel::kMaxBytes + 1, nullptr));
  // A forced algorithm keeps even the smallest op off the channel.
  testing::ScopedVariable forced("FSDP_EXT_ALLREDUCE_ALGO", "direct");
  EXPECT_FALSE(takes_small_op_channel(8, "FSDP_EXT_ALLREDUCE_ALGO"));
  EXPECT_TRUE(takes_small_op_channel(8, "FSDP_EXT_ALLGATHER_ALGO"));
}

TEST(SmallOpsWaiting, AnAbsentPeerTimesOutNamingIt) {
  auto channels = connected_channels(3);
  const auto start = Clock::now();
  // Ranks 0 and 1 publish; rank 2 never does.
  start_small_barrier(*channels[1], 1);
  start_small_barrier(*channels[0], 1);
  ChannelWait wait = wait_for(300ms);
  wait.describe_peer = [](int rank) { return "peer " + std::to_string(rank); };
  wait.explain_timeout = [] { return std::string(" (what the others did)"); };
  try {
    channels[0]->wait(wait);
    FAIL() << "no timeout";
  } catch (const CommError& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kTimeout);
    const std::string message = error.what();
    EXPECT_NE(message.find("test op: timed out after 300 ms; still waiting for peer 2 "),
              std::string::npos)
        << message;
    EXPECT_EQ(message.find("peer 1"), std::string::npos) << message;
    EXPECT_NE(message.find("(what the others did)"), std::string::npos) << message;
  }
  const auto elapsed = Clock::now() - start;
  EXPECT_GE(elapsed, 300ms);
  EXPECT_LT(elapsed, 5s);
  EXPECT_EQ(channels[0]->missing(), std::vector<int>{2});
}

TEST(SmallOpsWaiting, AFailedHealthCheckEndsTheWait) {
  auto channels = connected_channels(2);
  start_small_barrier(*channels[0], 1);
  std::atomic<int> checks{0};
  ChannelWait wait = wait_for(30s);
  wait.check_health = [&] {
    if (++checks == 3) throw CommError(ErrorKind::kPeerLost, "rank 1 exited");
  };
  const auto start = Clock::now();
  try {
    channels[0]->wait(wait);
    FAIL() << "no error";
  } catch (const CommError& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kPeerLost);
  }
  EXPECT_LT(Clock::now() - start, 5s);
}

// Note [a peer that stopped]: a peer whose group failed never publishes;
// the waiter, asleep on its futex word, is woken and fails at once.
TEST(SmallOpsWaiting, APeerThatStoppedEndsTheWaitAtOnce) {
  auto channels = connected_channels(3);
  start_small_barrier(*channels[0], 1);
  start_small_barrier(*channels[1], 1);
  std::thread stopping([&] {
    std::this_thread::sleep_for(50ms);  // long past the spin: rank 0 sleeps
    channels[2]->mark_stopped();
  });
  ChannelWait wait = wait_for(30s);
  wait.describe_peer = [](int rank) { return "peer " + std::to_string(rank); };
  const auto start = Clock::now();
  try {
    channels[0]->wait(wait);
    FAIL() << "no error";
  } catch (const CommError& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kBroken);
    EXPECT_NE(std::string(error.what())
                  .find("test op: peer 2 has not published its part of barrier (small-op "
                        "channel, exchange 1): that rank has stopped taking part"),
              std::string::npos)
        << error.what();
  }
  EXPECT_LT(Clock::now() - start, 5s);
  stopping.join();
}

// A peer that comes long after the spin: the waiter sleeps on its futex
// word and is woken by its publish (not by the 1 ms slices alone: the
// sleeper count makes the publisher wake it).
TEST(SmallOpsWaiting, ALatePeerWakesASleepingWaiter) {
  auto channels = connected_channels(2);
  for (int round = 0; round < 20; ++round) {
    std::thread late([&] {
      std::this_thread::sleep_for(5ms);
      int32_t value = 7;
      start_small_broadcast(*channels[1], round + 1, {&value, 4}, 1);
      channels[1]->wait(wait_for(30s));
      finish_small_broadcast(*channels[1], {&value, 4}, 1);
    });
    int32_t value = 0;
    start_small_broadcast(*channels[0], round + 1, {&value, 4}, 1);
    channels[0]->wait(wait_for(30s));
    finish_small_broadcast(*channels[0], {&value, 4}, 1);
    late.join();
    EXPECT_EQ(value, 7);
  }
}

// Note [a size that straddles the channel's limit]: one rank in the channel,
// the other over UCX with the same collective number; each side says so.
TEST(SmallOpsWaiting, APeerRunningTheOpOverUcxIsAMismatchNotATimeout) {
  auto channels = connected_channels(2);
  channels[1]->announce_engine_collective(7);
  float value = 1.0f;
  start_small_allreduce(*channels[0], 7, {&value, 4},
                        ReduceSpec{DataType::kFloat32, ReduceKind::kSum});
  const auto start = Clock::now();
  try {
    channels[0]->wait(wait_for(30s));
    FAIL() << "no error";
  } catch (const CommError& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kMismatch);
    EXPECT_NE(std::string(error.what())
                  .find("rank 1 runs this collective over UCX messages where rank 0 called "
                        "all_reduce (float32 SUM) of 4 bytes through the small-op channel"),
              std::string::npos)
        << error.what();
  }
  EXPECT_LT(Clock::now() - start, 5s);
  // And from the UCX side: rank 1 finds rank 0 in the channel at op 7.
  EXPECT_EQ(channels[1]->peer_in_channel_op(7), "rank 0 called all_reduce (float32 SUM) of 4 bytes");
  EXPECT_EQ(channels[1]->peer_in_channel_op(8), "");
  SmallOpChannel unconnected(0, 2);
  EXPECT_EQ(unconnected.peer_in_channel_op(7), "");
}

// --- the engine's Turn ---------------------------------------------------

TEST(EngineTurn, TakenOnlyWhileTheEngineIsIdleAndHoldsBackQueuedOps) {
  testing::LoopbackGroup group(1);
  ProgressEngine& engine = group.engine(0);
  ProgressEngine::Turn turn = engine.try_take_turn("all_reduce");
  ASSERT_TRUE(turn);
  const uint64_t seq = turn.seq();
  // What peers are told of this rank while it runs the op itself.
  EngineActivity activity = engine.activity();
  EXPECT_TRUE(activity.in_collective);
  EXPECT_EQ(activity.seq, seq);
  EXPECT_EQ(activity.op, "all_reduce");
  EXPECT_FALSE(engine.try_take_turn()) << "a second turn while one is held";
  std::atomic<bool> ran{false};
  auto queued = group.submit(0, "queued", [&](int, OpContext& context) {
    ran = true;
    EXPECT_EQ(context.seq(), seq + 1);
  });
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(ran) << "a queued op ran while the turn was held";
  EXPECT_FALSE(engine.try_take_turn()) << "a turn past a queued op";
  turn.end();
  EXPECT_TRUE(testing::LoopbackGroup::await(queued, 10000ms).ok);
  EXPECT_TRUE(ran);
  activity = engine.activity();
  EXPECT_FALSE(activity.in_collective);
  EXPECT_EQ(activity.seq, seq + 1) << "the last op begun: the queued one";
  // The op's outcome is delivered just before the engine marks itself idle.
  bool granted = false;
  for (auto until = Clock::now() + 5s; !granted && Clock::now() < until;) {
    granted = static_cast<bool>(engine.try_take_turn());
  }
  EXPECT_TRUE(granted);
}

TEST(EngineTurn, TheRestRunsBeforeOpsSubmittedMeanwhileWithTheTurnsNumber) {
  testing::LoopbackGroup group(1);
  ProgressEngine& engine = group.engine(0);
  ProgressEngine::Turn turn = engine.try_take_turn();
  ASSERT_TRUE(turn);
  const uint64_t seq = turn.seq();
  std::vector<std::string> order;
  std::mutex order_mutex;
  auto later = group.submit(0, "later", [&](int, OpContext& context) {
    std::lock_guard<std::mutex> lock(order_mutex);
    order.push_back("later #" + std::to_string(context.seq()));
  });
  std::promise<OpOutcome> rest_done;
  EngineOp rest;
  rest.name = "rest";
  rest.collective = true;
  rest.timeout = 10000ms;
  rest.body = [&](OpContext& context) {
    std::lock_guard<std::mutex> lock(order_mutex);
    order.push_back("rest #" + std::to_string(context.seq()));
  };
  rest.on_done = [&](const OpOutcome& outcome) { rest_done.set_value(outcome); };
  turn.hand_over(std::move(rest));
  auto rest_future = rest_done.get_future();
  EXPECT_TRUE(testing::LoopbackGroup::await(rest_future, 10000ms).ok);
  EXPECT_TRUE(testing::LoopbackGroup::await(later, 10000ms).ok);
  const std::vector<std::string> expected = {"rest #" + std::to_string(seq),
                                             "later #" + std::to_string(seq + 1)};
  EXPECT_EQ(order, expected);
}

TEST(EngineTurn, AFailedTurnBreaksTheGroupAndNoTurnIsGivenAfter) {
  testing::LoopbackGroup group(1);
  ProgressEngine& engine = group.engine(0);
  ProgressEngine::Turn turn = engine.try_take_turn();
  ASSERT_TRUE(turn);
  turn.fail("fsdp_ext all_reduce (group 'g', rank 0/1, op #1): rank 1 called broadcast");
  EXPECT_NE(engine.broken_reason().find("rank 1 called broadcast"), std::string::npos);
  EXPECT_FALSE(engine.try_take_turn());
  auto refused = group.submit(0, "after", [](int, OpContext&) {});
  const OpOutcome outcome = testing::LoopbackGroup::await(refused, 10000ms);
  EXPECT_FALSE(outcome.ok);
  EXPECT_NE(outcome.message.find("unusable"), std::string::npos) << outcome.message;
}

TEST(EngineTurn, NoTurnWhileAnOpRunsOrAfterShutdown) {
  testing::LoopbackGroup group(1);
  ProgressEngine& engine = group.engine(0);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> running{false};
  auto blocking = group.submit(0, "blocking", [&](int, OpContext&) {
    running = true;
    released.wait();
  });
  while (!running) std::this_thread::sleep_for(1ms);
  EXPECT_FALSE(engine.try_take_turn());
  release.set_value();
  EXPECT_TRUE(testing::LoopbackGroup::await(blocking, 10000ms).ok);
  engine.shutdown();
  EXPECT_FALSE(engine.try_take_turn());
}

// The engine thread's half of a small op (the continuation the backend
// hands over): waiting in the channel with the op's deadline and the engine
// kept alive, over a real group of engines.
TEST(EngineTurn, ChannelWaitOnTheEngineSeesAbsentPeersTimeOut) {
  testing::LoopbackGroup group(2);
  auto channels = connected_channels(2);
  auto future = group.submit(
      0, "all_reduce",
      [&](int, OpContext& context) {
        start_small_barrier(*channels[0], context.seq());
        channels[0]->wait(context.channel_wait());
      },
      std::chrono::milliseconds(300));
  const OpOutcome outcome = testing::LoopbackGroup::await(future, 10000ms);
  EXPECT_FALSE(outcome.ok);
  EXPECT_EQ(outcome.kind, ErrorKind::kTimeout);
  EXPECT_NE(outcome.message.find("fsdp_ext all_reduce (group 'loopback', rank 0/2"),
            std::string::npos)
      << outcome.message;
  EXPECT_NE(outcome.message.find("still waiting for rank 1"), std::string::npos)
      << outcome.message;
}

}  // namespace
}  // namespace fsdp_ext::comm
