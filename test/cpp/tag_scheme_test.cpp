// The 64-bit UCX tag layout (comm/tag_scheme.h): fields do not overlap,
// collective and user messages can never match each other, and the sender
// comes back out of a tag matched from any source.
#include <gtest/gtest.h>

#include <set>

#include "comm/tag_scheme.h"

namespace fsdp_ext::comm {
namespace {

TEST(TagScheme, CollectiveFieldsRoundTrip) {
  const uint64_t t = tag::collective(/*seq=*/12345, /*step=*/678, /*sender=*/9);
  EXPECT_EQ((t >> tag::kSeqShift) & tag::kSeqMask, 12345u);
  EXPECT_EQ((t >> tag::kStepShift) & tag::kStepMask, 678u);
  EXPECT_EQ(tag::sender_of(t), 9);
  EXPECT_EQ(t & tag::kP2PBit, 0u);
}

TEST(TagScheme, ExtremeFieldValuesStayInTheirBits) {
  const int last_rank = tag::kMaxRanks - 1;
  const uint32_t last_step = tag::kMaxSteps - 1;
  const uint64_t t = tag::collective(tag::kSeqMask, last_step, last_rank);
  EXPECT_EQ(tag::sender_of(t), last_rank);
  EXPECT_EQ((t >> tag::kStepShift) & tag::kStepMask, last_step);
  EXPECT_EQ((t >> tag::kSeqShift) & tag::kSeqMask, tag::kSeqMask);
  // Still a collective tag: the sequence number never reaches bit 63.
  EXPECT_EQ(t & tag::kP2PBit, 0u);
  // Changing one field at its maximum leaves the others alone.
  EXPECT_EQ(tag::collective(tag::kSeqMask, 0, 0) & (tag::kStepMask << tag::kStepShift), 0u);
  EXPECT_EQ(tag::collective(0, last_step, 0) & tag::kRankMask, 0u);
}

TEST(TagScheme, SequenceNumbersWrapWithoutTouchingOtherFields) {
  // Ops complete in order, so a sequence number that wrapped is harmless; it
  // must not spill into the p2p bit.
  const uint64_t wrapped = tag::collective(tag::kSeqMask + 1 + 5, 1, 2);
  EXPECT_EQ(wrapped, tag::collective(5, 1, 2));
  EXPECT_EQ(wrapped & tag::kP2PBit, 0u);
}

TEST(TagScheme, DistinctTagsForDistinctOpsStepsAndSenders) {
  std::set<uint64_t> seen;
  for (uint64_t seq : {1u, 2u, 1000u}) {
    for (uint32_t step : {0u, 1u, 65535u}) {
      for (int sender : {0, 1, 4, 1000}) {
        EXPECT_TRUE(seen.insert(tag::collective(seq, step, sender)).second)
            << "seq " << seq << " step " << step << " sender " << sender;
      }
    }
  }
  for (int user_tag : {0, 1, -1, 2147483647}) {
    for (int sender : {0, 3}) {
      EXPECT_TRUE(seen.insert(tag::point_to_point(user_tag, sender)).second)
          << "user tag " << user_tag << " sender " << sender;
    }
  }
}

TEST(TagScheme, PointToPointCarriesTheUserTagAndSender) {
  const uint64_t t = tag::point_to_point(-7, 42);
  EXPECT_NE(t & tag::kP2PBit, 0u);
  EXPECT_EQ(tag::sender_of(t), 42);
  EXPECT_EQ(static_cast<int32_t>((t >> tag::kRankBits) & 0xffffffffu), -7);
}

TEST(TagScheme, AnySenderMaskMatchesEverySenderOfOneUserTag) {
  // A receive from any source posts tag(user_tag, 0) with kMatchAnySender:
  // UCX matches when (incoming & mask) == (posted & mask).
  const uint64_t posted = tag::point_to_point(5, 0);
  for (int sender : {0, 1, 17, tag::kMaxRanks - 1}) {
    const uint64_t incoming = tag::point_to_point(5, sender);
    EXPECT_EQ(incoming & tag::kMatchAnySender, posted & tag::kMatchAnySender);
    EXPECT_EQ(tag::sender_of(incoming), sender);
  }
  // ...but neither another user tag nor a collective message.
  EXPECT_NE(tag::point_to_point(6, 1) & tag::kMatchAnySender, posted & tag::kMatchAnySender);
  EXPECT_NE(tag::collective(5, 0, 1) & tag::kMatchAnySender, posted & tag::kMatchAnySender);
}

}  // namespace
}  // namespace fsdp_ext::comm
