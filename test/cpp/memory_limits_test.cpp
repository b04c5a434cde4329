// The benchmark's physical references (comm/memory_limits.h): they return
// plausible, positive figures and scale with the work asked for.
#include <gtest/gtest.h>

#include "comm/memory_limits.h"

namespace fsdp_ext::comm {
namespace {

TEST(MemoryLimits, ConcurrentPeerCopyTakesLongerForMoreBytes) {
  const double small = concurrent_peer_copy_seconds(2, 64 << 10, 5);
  const double large = concurrent_peer_copy_seconds(2, 8 << 20, 5);
  EXPECT_GT(small, 0.0);
  EXPECT_GT(large, small);
  // No machine copies 8 MiB in under a microsecond (8 TB/s).
  EXPECT_GT(large, 1e-6);
}

TEST(MemoryLimits, OneRankAndEmptyCopiesWork) {
  EXPECT_GE(concurrent_peer_copy_seconds(1, 4096, 3), 0.0);
  EXPECT_GE(concurrent_peer_copy_seconds(3, 0, 3), 0.0);
}

TEST(MemoryLimits, HandoffRoundTripIsPositiveAndBelowAMillisecond) {
  const double ns = handoff_round_trip_ns(2000);
  EXPECT_GT(ns, 0.0);
  // Even two threads sharing one core (yielding) hand off well within this.
  EXPECT_LT(ns, 1e6);
}

}  // namespace
}  // namespace fsdp_ext::comm
