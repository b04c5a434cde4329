// Dead-peer detection without torch: EngineWakeup's pidfd and socket
// watches, and PeerLiveness connections over loopback.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
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
  const std::vector<PeerLiveness::Address> endpoints = {first.address(), second->address()};
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
    const std::vector<PeerLiveness::Address> endpoints = {low.address(), high.address()};
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
  const std::vector<PeerLiveness::Address> endpoints = {{"127.0.0.1:1", "?"}, lone.address()};
  const std::vector<bool> remote = {true, true};
  // Expects rank 0 to connect, which never happens.
  EXPECT_EQ(lone.connect(1, endpoints, remote, std::chrono::milliseconds(300)).missing,
            std::vector<int>{0});
  PeerLiveness caller("127.0.0.1");
  EXPECT_EQ(caller.connect(0, {caller.address(), {"127.0.0.1:1", "?"}}, remote,
                           std::chrono::milliseconds(300)).missing,
            std::vector<int>{1});
  EXPECT_EQ(caller.connection_count(), 0u);
}

// A raw TCP client of a PeerLiveness listener on loopback, as anything on
// the network could open one: it sends `bytes` (maybe nothing) and stays
// open until destroyed.
struct StrayClient {
  int fd = -1;
  StrayClient(const std::string& endpoint, const std::string& bytes) {
    const auto port = static_cast<uint16_t>(std::stoi(endpoint.substr(endpoint.rfind(':') + 1)));
    fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in target{};
    target.sin_family = AF_INET;
    target.sin_port = htons(port);
    inet_pton(AF_INET, "127.0.0.1", &target.sin_addr);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&target), sizeof(target)), 0);
    if (!bytes.empty()) EXPECT_EQ(send(fd, bytes.data(), bytes.size(), 0), ssize_t(bytes.size()));
  }
  ~StrayClient() { close(fd); }
};

// The wire format of a hello (peer_liveness.cpp), for forging one.
std::string hello(const std::string& endpoint, const std::string& token) {
  std::string out = "fsdpxlv1";
  const auto length = static_cast<uint32_t>(endpoint.size());
  out.append(reinterpret_cast<const char*>(&length), sizeof(length));
  return out + endpoint + token;
}

TEST(PeerLiveness, StrayConnectionsNeitherDelayNorImpersonateAPeer) {
  PeerLiveness listener("127.0.0.1");  // rank 1: accepts
  auto peer = std::make_unique<PeerLiveness>("127.0.0.1");  // rank 0: connects
  // Queued before the real peer: a silent client (a health check, a half-open
  // scan), a forged hello (the real peer's endpoint, a wrong token), garbage,
  // and a hello whose length no hello has.
  StrayClient silent(listener.endpoint(), "");
  auto forged = std::make_unique<StrayClient>(listener.endpoint(),
                                              hello(peer->endpoint(), std::string(32, '0')));
  StrayClient garbage(listener.endpoint(), "GET / HTTP/1.0\r\n\r\n");
  std::string huge = "fsdpxlv1";
  const uint32_t length = 1u << 30;
  huge.append(reinterpret_cast<const char*>(&length), sizeof(length));
  StrayClient oversized(listener.endpoint(), huge);

  const std::vector<PeerLiveness::Address> peers = {peer->address(), listener.address()};
  const std::vector<bool> remote = {true, true};
  const auto start = Clock::now();
  PeerLiveness::Connected mine;
  std::thread higher([&] { mine = listener.connect(1, peers, remote, std::chrono::seconds(10)); });
  const PeerLiveness::Connected theirs = peer->connect(0, peers, remote, std::chrono::seconds(10));
  higher.join();
  const auto took = Clock::now() - start;
  // Not held up by the silent client's hello deadline (1 s), nor anything else.
  EXPECT_LT(took, std::chrono::milliseconds(500));
  ASSERT_TRUE(mine.missing.empty());
  ASSERT_EQ(mine.connections.size(), 1u);
  EXPECT_EQ(theirs.connections.size(), 1u);
  // The forged, garbage and oversized ones are refused as soon as they are read.
  EXPECT_GE(listener.refused_connections(), 3u);

  QuietFd worker;
  EngineWakeup wakeup(worker.fds[0]);
  wakeup.watch_socket(0, mine.connections[0].socket);
  // The forged client leaving is not the peer leaving: the watched
  // connection is the peer's own.
  forged.reset();
  wakeup.sleep(Clock::now() + std::chrono::milliseconds(50), false);
  EXPECT_TRUE(wakeup.take_lost_peers().empty());
  peer.reset();
  const auto lost = sleep_until_lost(wakeup, std::chrono::seconds(5));
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].rank, 0);
}

TEST(PeerLiveness, ASilentClientIsRefusedAtItsHelloDeadline) {
  PeerLiveness listener("127.0.0.1");
  StrayClient silent(listener.endpoint(), "");
  const std::vector<bool> remote = {true, true};
  // Waits (for a rank 0 that never comes) long enough to see the deadline pass.
  listener.connect(1, {{"127.0.0.1:1", "?"}, listener.address()}, remote,
                   PeerLiveness::kHelloDeadline + std::chrono::milliseconds(300));
  EXPECT_EQ(listener.refused_connections(), 1u);
  EXPECT_EQ(listener.connection_count(), 0u);
  // A group's creation reports the refusal once; the next has none to report.
  EXPECT_EQ(listener.take_unreported_refusals(), 1u);
  EXPECT_EQ(listener.take_unreported_refusals(), 0u);
  EXPECT_EQ(listener.refused_connections(), 1u);
}

TEST(PeerLiveness, TheListenerBindsOnlyTheAddressItAdvertises) {
  PeerLiveness listener("127.0.0.1");
  const std::string& endpoint = listener.endpoint();
  ASSERT_EQ(endpoint.rfind("127.0.0.1:", 0), 0u) << endpoint;
  // 127.0.0.2 is loopback too: a listener on every interface would take it.
  const auto port = static_cast<uint16_t>(std::stoi(endpoint.substr(endpoint.rfind(':') + 1)));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in other{};
  other.sin_family = AF_INET;
  other.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.2", &other.sin_addr);
  EXPECT_NE(::connect(fd, reinterpret_cast<sockaddr*>(&other), sizeof(other)), 0);
  close(fd);
}

}  // namespace
}  // namespace fsdp_ext::comm
