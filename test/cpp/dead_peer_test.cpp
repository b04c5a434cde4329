// Dead-peer detection without torch: EngineWakeup's pidfd and socket
// watches, and PeerLiveness connections over loopback.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <thread>

#include "comm/engine_wakeup.h"
#include "comm/peer_liveness.h"

namespace fsdp_ext::comm {
namespace {

using Clock = std::chrono::steady_clock;

// An fd that never fires, standing in for the UCX worker's.
struct QuietFd {
  int fds[2];
  QuietFd() { EXPECT_EQ(pipe(fds), 0); }
  ~QuietFd() {
    close(fds[0]);
    close(fds[1]);
  }
};

std::vector<EngineWakeup::LostPeer> sleep_until_lost(EngineWakeup& wakeup,
                                                     std::chrono::milliseconds budget) {
  const auto deadline = Clock::now() + budget;
  while (Clock::now() < deadline) {
    wakeup.sleep(deadline, /*wake_on_submit=*/false);
    auto lost = wakeup.take_lost_peers();
    if (!lost.empty()) return lost;
  }
  return {};
}

TEST(EngineWakeup, SleepsUntilTheDeadlineWhenNothingFires) {
  QuietFd worker;
  EngineWakeup wakeup(worker.fds[0]);
  const auto start = Clock::now();
  wakeup.sleep(start + std::chrono::milliseconds(30), false);
  const auto slept = Clock::now() - start;
  EXPECT_GE(slept, std::chrono::milliseconds(29));
  EXPECT_LT(slept, std::chrono::milliseconds(500));
  EXPECT_TRUE(wakeup.take_lost_peers().empty());
}

TEST(EngineWakeup, SubmissionWakesOnlyAnIdleSleeper) {
  QuietFd worker;
  EngineWakeup wakeup(worker.fds[0]);
  wakeup.notify_submitted();
  auto start = Clock::now();
  wakeup.sleep(start + std::chrono::seconds(5), /*wake_on_submit=*/true);
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(500));
  // Inside an op a queued submission must not cut the sleep short.
  start = Clock::now();
  wakeup.sleep(start + std::chrono::milliseconds(30), /*wake_on_submit=*/false);
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(29));
  wakeup.drain_submitted();
}

TEST(EngineWakeup, AbortWakesAnySleeper) {
  QuietFd worker;
  EngineWakeup wakeup(worker.fds[0]);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    wakeup.notify_abort();
  });
  const auto start = Clock::now();
  wakeup.sleep(start + std::chrono::seconds(5), false);
  aborter.join();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(1));
}

TEST(EngineWakeup, AChildThatDiesIsReportedOnceWithItsRank) {
  QuietFd worker;
  EngineWakeup wakeup(worker.fds[0]);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    pause();
    _exit(0);
  }
  ASSERT_TRUE(wakeup.watch_process(3, child));
  // Alive: nothing reported.
  wakeup.sleep(Clock::now() + std::chrono::milliseconds(20), false);
  EXPECT_TRUE(wakeup.take_lost_peers().empty());
  const auto killed = Clock::now();
  kill(child, SIGKILL);
  const auto lost = sleep_until_lost(wakeup, std::chrono::seconds(5));
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].rank, 3);
  EXPECT_LT(Clock::now() - killed, std::chrono::seconds(1));
  waitpid(child, nullptr, 0);
  // Reported once: the fd is no longer watched.
  wakeup.sleep(Clock::now() + std::chrono::milliseconds(20), false);
  EXPECT_TRUE(wakeup.take_lost_peers().empty());
}

TEST(EngineWakeup, WatchingAProcessThatDoesNotExistFails) {
  QuietFd worker;
  EngineWakeup wakeup(worker.fds[0]);
  EXPECT_FALSE(wakeup.watch_process(1, 0x3ffffff0));
}

TEST(PeerLiveness, LoopbackPairConnectsAndAClosedEndIsReported) {
  // Two registries stand for two processes; loopback is their "network".
  PeerLiveness first("127.0.0.1");
  auto second = std::make_unique<PeerLiveness>("127.0.0.1");
  const std::vector<std::string> endpoints = {first.endpoint(), second->endpoint()};
  const std::vector<bool> remote = {true, true};
  PeerLiveness::Connected theirs;
  std::thread higher([&] { theirs = second->connect(1, endpoints, remote, std::chrono::seconds(5)); });
  const PeerLiveness::Connected mine = first.connect(0, endpoints, remote, std::chrono::seconds(5));
  higher.join();
  EXPECT_TRUE(mine.missing.empty());
  EXPECT_TRUE(theirs.missing.empty());
  ASSERT_EQ(mine.connections.size(), 1u);
  ASSERT_EQ(theirs.connections.size(), 1u);
  EXPECT_EQ(mine.connections[0].rank, 1);
  EXPECT_EQ(theirs.connections[0].rank, 0);

  QuietFd worker;
  EngineWakeup wakeup(worker.fds[0]);
  wakeup.watch_socket(1, mine.connections[0].socket);
  wakeup.sleep(Clock::now() + std::chrono::milliseconds(20), false);
  EXPECT_TRUE(wakeup.take_lost_peers().empty()) << "an open connection is not a loss";
  second.reset();  // the peer's process is gone: its kernel closes its end
  const auto lost = sleep_until_lost(wakeup, std::chrono::seconds(5));
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].rank, 1);
}

TEST(PeerLiveness, LaterGroupsShareTheConnectionOfAPairOfProcesses) {
  PeerLiveness first("127.0.0.1"), second("127.0.0.1");
  const std::vector<bool> remote = {true, true};
  // Three groups over the same two processes, with their ranks in either
  // order: one connection between them in all.
  std::vector<int> mine, theirs;
  for (int group = 0; group < 3; ++group) {
    const bool swapped = group == 1;
    PeerLiveness& low = swapped ? second : first;
    PeerLiveness& high = swapped ? first : second;
    const std::vector<std::string> endpoints = {low.endpoint(), high.endpoint()};
    PeerLiveness::Connected high_side;
    std::thread higher([&] { high_side = high.connect(1, endpoints, remote, std::chrono::seconds(5)); });
    const PeerLiveness::Connected low_side = low.connect(0, endpoints, remote, std::chrono::seconds(5));
    higher.join();
    ASSERT_EQ(low_side.connections.size(), 1u);
    ASSERT_EQ(high_side.connections.size(), 1u);
    mine.push_back((swapped ? high_side : low_side).connections[0].socket);
    theirs.push_back((swapped ? low_side : high_side).connections[0].socket);
  }
  EXPECT_EQ(first.connection_count(), 1u);
  EXPECT_EQ(second.connection_count(), 1u);
  EXPECT_EQ(mine, std::vector<int>(3, mine[0]));
  EXPECT_EQ(theirs, std::vector<int>(3, theirs[0]));
}

TEST(PeerLiveness, AnUnreachablePeerIsMissingNotAnError) {
  PeerLiveness lone("127.0.0.1");
  // Port 1 on loopback: refused at once.
  const std::vector<std::string> endpoints = {"127.0.0.1:1", lone.endpoint()};
  const std::vector<bool> remote = {true, true};
  // Expects rank 0 to connect, which never happens.
  EXPECT_EQ(lone.connect(1, endpoints, remote, std::chrono::milliseconds(300)).missing,
            std::vector<int>{0});
  PeerLiveness caller("127.0.0.1");
  EXPECT_EQ(caller.connect(0, {caller.endpoint(), "127.0.0.1:1"}, remote,
                           std::chrono::milliseconds(300)).missing,
            std::vector<int>{1});
  EXPECT_EQ(caller.connection_count(), 0u);
}

}  // namespace
}  // namespace fsdp_ext::comm
