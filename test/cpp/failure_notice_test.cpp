// A failing rank's notice to its peers (Note [a failure told to the peers],
// comm/failure_notice.h): its wire form and its tag. What a notice does to
// the ranks that receive one is tested with the failures that send it
// (collective_kind_test.cpp, progress_engine_test.cpp).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "comm/failure_notice.h"
#include "comm/tag_scheme.h"

namespace fsdp_ext::comm {
namespace {

TEST(FailureNotice, RoundTripsItsFields) {
  const std::vector<uint8_t> bytes =
      encode_failure_notice(tag::kSeqMask + 5, ErrorKind::kMismatch, "rank 0 is in a broadcast");
  FailureNotice notice;
  ASSERT_TRUE(decode_failure_notice(bytes.data(), bytes.size(), &notice));
  EXPECT_EQ(notice.seq, tag::kSeqMask + 5);
  EXPECT_EQ(notice.kind, ErrorKind::kMismatch);
  EXPECT_EQ(notice.message, "rank 0 is in a broadcast");
}

TEST(FailureNotice, AnEmptyMessageAndTheLastKindRoundTrip) {
  // A departure notice (Note [a peer that destroyed the group]) has no text.
  const std::vector<uint8_t> bytes = encode_failure_notice(0, ErrorKind::kPeerLeft, "");
  FailureNotice notice;
  ASSERT_TRUE(decode_failure_notice(bytes.data(), bytes.size(), &notice));
  EXPECT_EQ(notice.kind, ErrorKind::kPeerLeft);
  EXPECT_EQ(notice.message, "");
}

TEST(FailureNotice, ALongMessageIsCutToTheReceiveBuffer) {
  const std::string long_message(3 * FailureNoticeInbox::kMaxBytes, 'x');
  const std::vector<uint8_t> bytes = encode_failure_notice(9, ErrorKind::kTimeout, long_message);
  EXPECT_EQ(bytes.size(), FailureNoticeInbox::kMaxBytes);
  FailureNotice notice;
  ASSERT_TRUE(decode_failure_notice(bytes.data(), bytes.size(), &notice));
  EXPECT_EQ(notice.message, long_message.substr(0, notice.message.size()));
  EXPECT_GT(notice.message.size(), FailureNoticeInbox::kMaxBytes / 2);
}

TEST(FailureNotice, ShortOrForeignBytesAreNotANotice) {
  std::vector<uint8_t> bytes = encode_failure_notice(3, ErrorKind::kTimeout, "late");
  FailureNotice notice;
  EXPECT_FALSE(decode_failure_notice(bytes.data(), 15, &notice));  // header cut
  bytes[0] ^= 0xff;  // another magic word
  EXPECT_FALSE(decode_failure_notice(bytes.data(), bytes.size(), &notice));
  bytes[0] ^= 0xff;
  bytes[4] = 0x7f;  // a kind this build does not have
  EXPECT_FALSE(decode_failure_notice(bytes.data(), bytes.size(), &notice));
}

TEST(FailureNotice, ItsTagIsTakenByTheInboxOnlyAndByNoOtherReceive) {
  // The inbox posts failure_notice(0) with kMatchAnySender.
  const uint64_t inbox = tag::failure_notice(0);
  for (int sender : {0, 1, 3, 8191, tag::kMaxRanks - 1}) {
    const uint64_t notice = tag::failure_notice(sender);
    EXPECT_EQ(notice & tag::kMatchAnySender, inbox & tag::kMatchAnySender);
    EXPECT_EQ(tag::sender_of(notice), sender);
    // A user's receive from any sender, for any user tag, and one from
    // this very sender, never match a notice...
    for (int user_tag : {0, 1, -1, 0x7fffffff, static_cast<int>(0x80000000u)}) {
      const uint64_t user = tag::point_to_point(user_tag, 0);
      EXPECT_NE(notice & tag::kMatchAnySender, user & tag::kMatchAnySender) << user_tag;
      EXPECT_NE(notice, tag::point_to_point(user_tag, sender)) << user_tag;
      // ...and the inbox takes no user message.
      EXPECT_NE(tag::point_to_point(user_tag, sender) & tag::kMatchAnySender,
                inbox & tag::kMatchAnySender)
          << user_tag;
    }
    // Nor does a collective receive, or the probe for another collective's
    // messages (Note [ranks that run different collectives]).
    const uint64_t collective = tag::collective(7, 2, sender, CollectiveKind::kAllReduce);
    EXPECT_NE(notice, collective);
    EXPECT_NE(notice & tag::kMatchCollectiveSender, collective & tag::kMatchCollectiveSender);
    EXPECT_NE(collective & tag::kMatchAnySender, inbox & tag::kMatchAnySender);
  }
}

}  // namespace
}  // namespace fsdp_ext::comm
