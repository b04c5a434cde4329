// ProgressCadence: the gap it reports is what the engine naps and spins by
// on a slow link, so each rule is checked on made-up times.
#include "comm/progress_cadence.h"

#include <gtest/gtest.h>

namespace fsdp_ext::comm {
namespace {

using std::chrono::microseconds;
using Clock = ProgressCadence::Clock;

TEST(ProgressCadence, KnowsNoGapBeforeTwoEvents) {
  ProgressCadence cadence;
  EXPECT_EQ(cadence.gap(), Clock::duration::zero());
  cadence.note_progress(Clock::time_point{} + microseconds(5000));
  EXPECT_EQ(cadence.gap(), Clock::duration::zero());
}

TEST(ProgressCadence, ASteadyStreamHasItsGap) {
  ProgressCadence cadence;
  auto t = Clock::time_point{} + microseconds(1000);
  for (int i = 0; i < 10; ++i, t += microseconds(700)) cadence.note_progress(t);
  EXPECT_EQ(cadence.gap(), microseconds(700));
}

TEST(ProgressCadence, FollowsAChangedCadenceWithinAFewEvents) {
  ProgressCadence cadence;
  auto t = Clock::time_point{} + microseconds(1000);
  for (int i = 0; i < 5; ++i, t += microseconds(800)) cadence.note_progress(t);
  // The first of these is still 800 us after the last; then 15 gaps of 200.
  for (int i = 0; i < 16; ++i, t += microseconds(200)) cadence.note_progress(t);
  EXPECT_GT(cadence.gap(), microseconds(200));
  EXPECT_LT(cadence.gap(), microseconds(220));
}

TEST(ProgressCadence, ABurstOfEventsOnlyShortensTheGapByAQuarterEach) {
  ProgressCadence cadence;
  auto t = Clock::time_point{} + microseconds(1000);
  for (int i = 0; i < 5; ++i, t += microseconds(800)) cadence.note_progress(t);
  cadence.note_progress(t - microseconds(800));  // again at the last event's instant
  EXPECT_EQ(cadence.gap(), microseconds(600));
}

TEST(ProgressCadence, APauseLongerThanTheLimitForgetsTheStream) {
  ProgressCadence cadence;
  auto t = Clock::time_point{} + microseconds(1000);
  for (int i = 0; i < 5; ++i, t += microseconds(500)) cadence.note_progress(t);
  ASSERT_EQ(cadence.gap(), microseconds(500));
  t += ProgressCadence::kMaxGap + microseconds(1);
  cadence.note_progress(t);
  EXPECT_EQ(cadence.gap(), Clock::duration::zero());
  // The next stream starts afresh from its own first gap.
  cadence.note_progress(t + microseconds(300));
  EXPECT_EQ(cadence.gap(), microseconds(300));
}

}  // namespace
}  // namespace fsdp_ext::comm
