// Transport on its own: tagged messages between two workers of this process,
// and the transports UCX picked for each endpoint (what the group's log line
// reports).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/tag_scheme.h"
#include "comm/transport.h"
#include "scoped_variable.h"

namespace fsdp_ext::comm {
namespace {

struct Pair {
  std::vector<std::unique_ptr<Transport>> ranks;
  Pair() {
    std::vector<std::vector<uint8_t>> addresses;
    for (int r = 0; r < 2; ++r) {
      ranks.push_back(std::make_unique<Transport>(r, 2));
      addresses.push_back(ranks.back()->worker_address());
    }
    for (auto& transport : ranks) transport->connect(addresses);
  }
  ~Pair() {
    // Flush-closing needs the peer to progress too: both close at once, each
    // worker on its own thread, and each goes away once closed, as ranks do.
    auto close = [](std::unique_ptr<Transport>& transport) {
      if (!transport) return;
      transport->close_endpoints(std::chrono::milliseconds(2000));
      transport.reset();
    };
    std::thread other([&] { close(ranks[1]); });
    close(ranks[0]);
    other.join();
  }
  // One byte from rank 0 to rank 1, so the endpoint's lanes are wired up.
  bool carry_one_message() {
    char byte = 1, into = 0;
    Request send, recv;
    recv.peer = 0;
    ranks[1]->post_recv(recv, 5, tag::kMatchAll, &into, 1);
    ranks[0]->post_send(send, 1, 5, &byte, 1);
    return complete(send, recv) && into == 1;
  }
  // Progresses both workers until both requests finished (or ten million
  // polls passed: a test failure, not a hang).
  bool complete(Request& a, Request& b) {
    for (int spins = 0; spins < 10000000; ++spins) {
      ranks[0]->progress();
      ranks[1]->progress();
      const bool done_a = ranks[0]->test(a) || a.finished;
      const bool done_b = ranks[1]->test(b) || b.finished;
      if (done_a && done_b) return true;
    }
    return false;
  }
};

TEST(Transport, TaggedMessageOfAwkwardSizesArrive) {
  Pair pair;
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{3}, size_t{8191}, size_t{1 << 20}}) {
    std::vector<char> sent(bytes + 1, 'a'), received(bytes + 1, 0);
    for (size_t i = 0; i < bytes; ++i) sent[i] = static_cast<char>(i * 31);
    Request send, recv;
    recv.peer = 0;
    const uint64_t tag = tag::collective(1, 2, 0);
    pair.ranks[1]->post_recv(recv, tag, tag::kMatchAll, received.data(), bytes);
    pair.ranks[0]->post_send(send, 1, tag, sent.data(), bytes);
    ASSERT_TRUE(pair.complete(send, recv)) << bytes << " bytes never arrived";
    EXPECT_EQ(recv.status, UCS_OK);
    EXPECT_EQ(recv.received, bytes);
    EXPECT_EQ(std::memcmp(sent.data(), received.data(), bytes), 0) << bytes << " bytes";
  }
}

TEST(Transport, ReportsTheTransportsOfEachEndpoint) {
  Pair pair;
  ASSERT_TRUE(pair.carry_one_message());
  const std::vector<std::string> to_peer = pair.ranks[0]->transports_to(1);
  ASSERT_FALSE(to_peer.empty());
  for (const std::string& transport : to_peer) {
    // "name/device", e.g. "posix/memory" or "tcp/lo".
    EXPECT_NE(transport.find('/'), std::string::npos) << transport;
    EXPECT_EQ(transport.find(' '), std::string::npos) << transport;
  }
  EXPECT_TRUE(std::is_sorted(to_peer.begin(), to_peer.end()));
  // No endpoint, so nothing to report, where no message went (to itself).
  EXPECT_TRUE(pair.ranks[0]->transports_to(0).empty());
}

TEST(Transport, MakesAnEndpointOnlyToRanksItSendsTo) {
  // Note [an endpoint on first use]: rank 1 only received, so it has no
  // endpoint; it answers over one made now, which UCX pairs with rank 0's.
  Pair pair;
  EXPECT_TRUE(pair.ranks[0]->connected_peers().empty());
  ASSERT_TRUE(pair.carry_one_message());
  EXPECT_EQ(pair.ranks[0]->connected_peers(), std::vector<int>{1});
  EXPECT_TRUE(pair.ranks[1]->connected_peers().empty());
  char byte = 7, into = 0;
  Request send, recv;
  recv.peer = 1;
  pair.ranks[0]->post_recv(recv, 6, tag::kMatchAll, &into, 1);
  pair.ranks[1]->post_send(send, 0, 6, &byte, 1);
  ASSERT_TRUE(pair.complete(send, recv));
  EXPECT_EQ(into, 7);
  EXPECT_EQ(pair.ranks[1]->connected_peers(), std::vector<int>{0});
  EXPECT_EQ(pair.ranks[0]->connected_peers(), std::vector<int>{1});
}

TEST(Transport, ClosingWhileThePeerDoesNotProgressGivesUpWithinTheBudget) {
  // Rank 1's worker is never progressed during rank 0's close: the flush
  // cannot be acknowledged, and close_endpoints must return after its budget
  // and leave nothing that makes destroying the worker abort.
  testing::ScopedVariable tls("UCX_TLS", "tcp");
  testing::ScopedVariable devices("UCX_NET_DEVICES", "lo");
  auto pair = std::make_unique<Pair>();
  ASSERT_TRUE(pair->carry_one_message());
  const auto start = std::chrono::steady_clock::now();
  pair->ranks[0]->close_endpoints(std::chrono::milliseconds(200));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  pair->ranks[0].reset();  // destroys the worker: must not abort
  pair->ranks[1].reset();
}

TEST(Transport, ClosingAfterThePeerLeftIsQuiet) {
  // Note [closing after the peer left]: rank 0 closes and goes away (its
  // worker destroyed, its TCP connection closed) before rank 1 closes. Rank
  // 1's close must end within its budget without a UCX error on the output
  // (UCX logged "error during flush: Endpoint timeout" here).
  testing::ScopedVariable tls("UCX_TLS", "tcp");
  testing::ScopedVariable devices("UCX_NET_DEVICES", "lo");
  auto pair = std::make_unique<Pair>();
  ASSERT_TRUE(pair->carry_one_message());
  std::atomic<bool> closed{false};
  std::thread survivor([&] {
    while (!closed.load()) pair->ranks[1]->progress();
  });
  pair->ranks[0]->close_endpoints(std::chrono::milliseconds(2000));
  pair->ranks[0].reset();
  closed = true;
  survivor.join();
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 1000; ++i) pair->ranks[1]->progress();  // sees the connection close
  pair->ranks[1]->close_endpoints(std::chrono::milliseconds(2000));
  pair->ranks[1].reset();
  std::fflush(nullptr);
  const std::string logged =
      ::testing::internal::GetCapturedStdout() + ::testing::internal::GetCapturedStderr();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(logged.find("UCX  ERROR"), std::string::npos) << logged;
}

TEST(Transport, ReportsTcpWhenThatIsAllUcxMayUse) {
  // UCX reads UCX_TLS / UCX_NET_DEVICES when a context is created.
  testing::ScopedVariable tls("UCX_TLS", "tcp");
  testing::ScopedVariable devices("UCX_NET_DEVICES", "lo");
  Pair pair;
  ASSERT_TRUE(pair.carry_one_message());
  EXPECT_EQ(pair.ranks[0]->transports_to(1), std::vector<std::string>{"tcp/lo"});
}

TEST(Transport, MessagesNobodyReceivedAreDroppedAndTheirSendersReleased) {
  // Note [messages nobody received]: what a failed collective leaves behind,
  // an eager message and a rendezvous one (1 MiB), neither ever received.
  Pair pair;
  ASSERT_TRUE(pair.carry_one_message());
  std::vector<char> small(8, 's'), large(1 << 20, 'l');
  const uint64_t small_tag = tag::collective(3, 0, 0), large_tag = tag::collective(3, 1, 0);
  Request small_send, large_send;
  pair.ranks[0]->post_send(small_send, 1, small_tag, small.data(), small.size());
  pair.ranks[0]->post_send(large_send, 1, large_tag, large.data(), large.size());
  uint64_t found = 0;
  auto waiting = [&](uint64_t tag) { return pair.ranks[1]->find_unexpected(tag, tag::kMatchAll, &found); };
  for (int spins = 0; spins < 1000000 && !(waiting(small_tag) && waiting(large_tag)); ++spins) {
    pair.ranks[0]->progress();
    pair.ranks[1]->progress();
  }
  ASSERT_TRUE(waiting(small_tag) && waiting(large_tag)) << "the messages never arrived";
  pair.ranks[0]->test(large_send);
  EXPECT_FALSE(large_send.finished) << "a rendezvous send completed before any receive";

  pair.ranks[1]->discard_unexpected();
  EXPECT_FALSE(waiting(small_tag));
  EXPECT_FALSE(waiting(large_tag));
  // The rendezvous sender is answered (its message was taken, cut to the
  // sink), so its request ends instead of waiting for the worker's end.
  for (int spins = 0; spins < 1000000 && !(pair.ranks[0]->test(large_send) &&
                                           pair.ranks[0]->test(small_send));
       ++spins) {
    pair.ranks[0]->progress();
    pair.ranks[1]->progress();
  }
  EXPECT_TRUE(small_send.finished);
  EXPECT_TRUE(large_send.finished) << "the rendezvous send was never released";
  // The worker still works: a later message arrives whole.
  ASSERT_TRUE(pair.carry_one_message());
}

}  // namespace
}  // namespace fsdp_ext::comm
