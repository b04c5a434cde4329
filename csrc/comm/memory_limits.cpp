#include "comm/memory_limits.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

namespace fsdp_ext::comm {
namespace {

using Clock = std::chrono::steady_clock;

// A reusable spinning barrier: threads wait by yielding, so more threads
// than cores (4 ranks on 2 cores) still make progress.
class YieldingBarrier {
 public:
  explicit YieldingBarrier(int parties) : parties_(parties) {}
  void arrive_and_wait() {
    const int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == parties_) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    while (phase_.load(std::memory_order_acquire) == phase) sched_yield();
  }

 private:
  const int parties_;
  std::atomic<int> arrived_{0};
  std::atomic<int> phase_{0};
};

// Spins on the flag; yields now and then so that, should both threads share
// one core, the other still gets to run (that round trip is then slow, and
// batch shows it).
void wait_for_value(const std::atomic<int>& flag, int value) {
  for (unsigned spins = 1; flag.load(std::memory_order_acquire) != value; ++spins) {
    if (spins % 4096 == 0) sched_yield();
  }
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace

double concurrent_peer_copy_seconds(int ranks, size_t bytes, int rounds) {
  ranks = std::max(ranks, 1);
  rounds = std::max(rounds, 1);
  const size_t length = std::max<size_t>(bytes, 1);
  std::vector<std::unique_ptr<char[]>> sources(ranks), destinations(ranks);
  // When each thread started and finished its copy, per round.
  std::vector<std::vector<Clock::time_point>> starts(rounds + 1, std::vector<Clock::time_point>(ranks));
  std::vector<std::vector<Clock::time_point>> ends(rounds + 1, std::vector<Clock::time_point>(ranks));
  YieldingBarrier barrier(ranks);
  auto body = [&](int rank) {
    // First touch by the owner: its pages (and, when small, its cache) are
    // where a rank's own buffer would be.
    sources[rank].reset(new char[length]);
    destinations[rank].reset(new char[length]);
    std::memset(sources[rank].get(), rank + 1, length);
    std::memset(destinations[rank].get(), 0, length);
    barrier.arrive_and_wait();
    const char* peer = sources[(rank + 1) % ranks].get();
    for (int round = 0; round <= rounds; ++round) {  // round 0 warms up
      barrier.arrive_and_wait();
      starts[round][rank] = Clock::now();
      std::memcpy(destinations[rank].get(), peer, bytes);
      ends[round][rank] = Clock::now();
      // The owner produces fresh data for the next round, as a rank does
      // between collectives: the reader must fetch it from the owner's cache
      // (or memory) again, not from its own copy of the last round.
      barrier.arrive_and_wait();
      std::memset(sources[rank].get(), round, length);
    }
  };
  std::vector<std::thread> threads;
  for (int rank = 1; rank < ranks; ++rank) threads.emplace_back(body, rank);
  body(0);
  for (auto& thread : threads) thread.join();
  // A round lasts from the first copy's start to the last one's end: with
  // more ranks than cores the copies take turns, as ranks' would. The best
  // round is the limit (what the machine allows when nothing else runs).
  double best = std::numeric_limits<double>::infinity();
  for (int round = 1; round <= rounds; ++round) {
    const auto first = *std::min_element(starts[round].begin(), starts[round].end());
    const auto last = *std::max_element(ends[round].begin(), ends[round].end());
    best = std::min(best, std::chrono::duration<double>(last - first).count());
  }
  return best;
}

double handoff_round_trip_ns(int round_trips) {
  round_trips = std::max(round_trips, 1);
  alignas(64) std::atomic<int> flag{0};
  std::thread echo([&] {
    for (int i = 0; i < round_trips; ++i) {
      wait_for_value(flag, 2 * i + 1);
      flag.store(2 * i + 2, std::memory_order_release);
    }
  });
  // The median of each batch of round trips; the best batch is the figure
  // (a batch that shared its core with another process shows up as slow).
  constexpr int kBatches = 5;
  const int per_batch = std::max(1, round_trips / kBatches);
  double best = std::numeric_limits<double>::infinity();
  std::vector<double> samples;
  for (int i = 0; i < round_trips; ++i) {
    const auto start = Clock::now();
    flag.store(2 * i + 1, std::memory_order_release);
    wait_for_value(flag, 2 * i + 2);
    samples.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count());
    if (static_cast<int>(samples.size()) == per_batch || i + 1 == round_trips) {
      best = std::min(best, median(std::move(samples)));
      samples.clear();
    }
  }
  echo.join();
  return best;
}

}  // namespace fsdp_ext::comm
