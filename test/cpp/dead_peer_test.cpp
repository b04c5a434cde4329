// Dead-peer detection without torch: EngineWakeup's pidfd and socket
// watches, and PeerLiveness connections over loopback.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
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
  setenv("UCX_NET_DEVICES", "all", 1);
  PeerLiveness first, second;
  // Loopback only has 127.0.0.1: publish it explicitly for this test.
  const std::string ends[2] = {"127.0.0.1:" + first.endpoint().substr(first.endpoint().rfind(':') + 1),
                               "127.0.0.1:" + second.endpoint().substr(second.endpoint().rfind(':') + 1)};
  const std::vector<std::string> endpoints(ends, ends + 2);
  const std::vector<bool> remote = {true, true};
  std::thread higher([&] { second.connect(1, endpoints, remote, std::chrono::seconds(5)); });
  first.connect(0, endpoints, remote, std::chrono::seconds(5));
  higher.join();
  EXPECT_TRUE(first.missing().empty());
  EXPECT_TRUE(second.missing().empty());
  auto mine = first.take_connections();
  auto theirs = second.take_connections();
  ASSERT_EQ(mine.size(), 1u);
  ASSERT_EQ(theirs.size(), 1u);
  EXPECT_EQ(mine[0].rank, 1);
  EXPECT_EQ(theirs[0].rank, 0);

  QuietFd worker;
  EngineWakeup wakeup(worker.fds[0]);
  wakeup.watch_socket(1, std::move(mine[0].socket));
  wakeup.sleep(Clock::now() + std::chrono::milliseconds(20), false);
  EXPECT_TRUE(wakeup.take_lost_peers().empty()) << "an open connection is not a loss";
  theirs[0].socket.reset();  // the peer's process is gone: its kernel closes it
  const auto lost = sleep_until_lost(wakeup, std::chrono::seconds(5));
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].rank, 1);
}

TEST(PeerLiveness, AnUnreachablePeerIsMissingNotAnError) {
  PeerLiveness lone;
  // Port 1 on loopback: refused at once.
  const std::vector<std::string> endpoints = {"127.0.0.1:1", lone.endpoint()};
  const std::vector<bool> remote = {true, true};
  lone.connect(1, endpoints, remote, std::chrono::milliseconds(300));  // expects rank 0 to call
  EXPECT_EQ(lone.missing(), std::vector<int>{0});
  PeerLiveness caller;
  caller.connect(0, {caller.endpoint(), "127.0.0.1:1"}, remote, std::chrono::milliseconds(300));
  EXPECT_EQ(caller.missing(), std::vector<int>{1});
}

}  // namespace
}  // namespace fsdp_ext::comm
