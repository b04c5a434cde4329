// The algorithms' span helpers (comm/algorithms/span_helpers.h): how a
// buffer is cut into per-rank blocks, and how a bucket too large for the
// tag's step field is cut into windows with a sequence number each.
#include <gtest/gtest.h>

#include <vector>

#include "comm/algorithms/span_helpers.h"
#include "loopback_group.h"

namespace fsdp_ext::comm {
namespace {

using testing::LoopbackGroup;

std::vector<size_t> block_bytes(size_t bytes, size_t element, int parts) {
  std::vector<char> memory(bytes + 1);
  const auto blocks = detail::split_blocks(MutableSpan{memory.data(), bytes}, element, parts);
  std::vector<size_t> sizes;
  char* expected_start = memory.data();
  for (const MutableSpan& block : blocks) {
    EXPECT_EQ(block.data, expected_start) << "blocks must be contiguous";
    expected_start += block.bytes;
    sizes.push_back(block.bytes);
  }
  return sizes;
}

TEST(SplitBlocks, CountsDifferByAtMostOneAndTheFirstBlocksTakeTheRest) {
  EXPECT_EQ(block_bytes(10 * 4, 4, 3), (std::vector<size_t>{16, 12, 12}));
  EXPECT_EQ(block_bytes(2 * 8, 8, 5), (std::vector<size_t>{8, 8, 0, 0, 0}));
  EXPECT_EQ(block_bytes(0, 4, 4), (std::vector<size_t>{0, 0, 0, 0}));
  EXPECT_EQ(block_bytes(8191 * 2, 2, 1), (std::vector<size_t>{8191 * 2}));
  // 8191 float32 over 5 ranks: 1639 x 1, 1638 x 4.
  EXPECT_EQ(block_bytes(8191 * 4, 4, 5),
            (std::vector<size_t>{1639 * 4, 1638 * 4, 1638 * 4, 1638 * 4, 1638 * 4}));
}

TEST(SplitBlocks, BlocksNeverCutAnElement) {
  for (int parts = 1; parts <= 7; ++parts) {
    for (size_t count : {1, 3, 17, 8191}) {
      size_t total = 0;
      for (size_t bytes : block_bytes(count * 8, 8, parts)) {
        EXPECT_EQ(bytes % 8, 0u);
        total += bytes;
      }
      EXPECT_EQ(total, count * 8);
    }
  }
}

// AVG's divide is made block by block inside reduce_sources: the result must
// be the same bits as summing first and dividing the whole output after
// (what post_divide, and torch's div_, compute), across block boundaries
// (32 KiB) and at awkward sizes, with the output aliasing `own`.
TEST(ReduceSources, DividesEachBlockAsAWholeOutputDivideWould) {
  ReduceSpec avg;
  avg.post_divisor = 3.0;  // not a power of two: a reciprocal would round differently
  for (size_t count : {1, 3, 8191, 20000}) {
    std::vector<float> own(count), a(count), b(count);
    for (size_t i = 0; i < count; ++i) {
      own[i] = 0.1f * static_cast<float>(i % 97) + 1e-3f;
      a[i] = 1.0f / static_cast<float>(i + 3);
      b[i] = -0.37f * static_cast<float>(i % 13);
    }
    std::vector<float> expected = own;
    for (size_t i = 0; i < count; ++i) expected[i] = ((own[i] + a[i]) + b[i]) / 3.0f;
    std::vector<float> output = own;  // aliases own, as the in-place callers do
    detail::reduce_sources(MutableSpan{output.data(), count * sizeof(float)}, output.data(),
                           {a.data(), b.data()}, avg);
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(output[i], expected[i]) << "element " << i << " of " << count;
    }
  }
}

TEST(RingNeighbours, WrapAroundTheGroup) {
  EXPECT_EQ(detail::ring_next(4, 5), 0);
  EXPECT_EQ(detail::ring_prev(0, 5), 4);
  EXPECT_EQ(detail::ring_next(0, 1), 0);
  EXPECT_EQ(detail::wrap(-7, 5), 3);
  EXPECT_EQ(detail::wrap(12, 5), 2);
}

// What in_step_windows did inside one op: the members of each window and the
// sequence number it ran under.
struct Windows {
  std::vector<std::vector<int>> members;
  std::vector<uint64_t> seqs;
};

Windows windows_of(LoopbackGroup& group, int bucket_size, uint32_t steps_per_member) {
  Windows seen;
  std::vector<int> bucket(bucket_size);
  for (int i = 0; i < bucket_size; ++i) bucket[i] = i;
  group.run_ok("windows", [&](int, OpContext& context) {
    detail::in_step_windows(context, bucket, steps_per_member,
                            [&](const std::vector<int>& window) {
                              seen.members.push_back(window);
                              seen.seqs.push_back(context.seq());
                            });
  });
  return seen;
}

TEST(StepWindows, ABucketThatFitsRunsAsOneWindowUnderTheOpsSequenceNumber) {
  LoopbackGroup group(1);
  const Windows seen = windows_of(group, 5, 3);
  ASSERT_EQ(seen.members.size(), 1u);
  EXPECT_EQ(seen.members[0], (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(group.engine(0).sequences_used(), 1u);
}

TEST(StepWindows, LargeBucketsAreCutInOrderWithAFreshSequenceNumberPerWindow) {
  LoopbackGroup group(1);
  // Each member needs half the step field: two per window.
  const Windows seen = windows_of(group, 7, tag::kMaxSteps / 2);
  ASSERT_EQ(seen.members.size(), 4u);
  EXPECT_EQ(seen.members[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(seen.members[1], (std::vector<int>{2, 3}));
  EXPECT_EQ(seen.members[2], (std::vector<int>{4, 5}));
  EXPECT_EQ(seen.members[3], (std::vector<int>{6}));
  for (size_t w = 1; w < seen.seqs.size(); ++w) EXPECT_EQ(seen.seqs[w], seen.seqs[w - 1] + 1);
  EXPECT_EQ(group.engine(0).sequences_used(), 4u);
}

TEST(StepWindows, MembersNeedingMoreThanTheStepFieldGoOneAtATime) {
  LoopbackGroup group(1);
  const Windows seen = windows_of(group, 3, tag::kMaxSteps * 2);
  ASSERT_EQ(seen.members.size(), 3u);
  EXPECT_EQ(seen.members[2], (std::vector<int>{2}));
}

TEST(StepWindows, EveryRankCutsTheSameWindowsAndMessagesStayApart) {
  // A bucket of 5 one-byte all-reduces cut into windows of two across 3
  // ranks: each window's messages use its own sequence number, so a rank
  // running ahead cannot match another window's messages.
  LoopbackGroup group(3);
  std::vector<std::vector<int32_t>> data(3, std::vector<int32_t>(5));
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 5; ++i) data[r][i] = (r + 1) * (i + 1);
  }
  group.run_ok("windowed allreduce", [&](int r, OpContext& context) {
    std::vector<int> members = {0, 1, 2, 3, 4};
    detail::in_step_windows(context, members, tag::kMaxSteps / 2,
                            [&](const std::vector<int>& window) {
                              for (int i : window) {
                                // Two steps per member, as the window promised.
                                std::vector<Request> requests;
                                const int next = detail::ring_next(context.rank(), 3);
                                const int prev = detail::ring_prev(context.rank(), 3);
                                int32_t from_prev = 0, from_next = 0;
                                const uint32_t step = static_cast<uint32_t>(i % 2) * 2;
                                requests.push_back(context.send(next, step, &data[r][i], 4));
                                requests.push_back(context.send(prev, step + 1, &data[r][i], 4));
                                requests.push_back(context.recv(prev, step, &from_prev, 4));
                                requests.push_back(context.recv(next, step + 1, &from_next, 4));
                                context.wait_all(requests);
                                data[r][i] += from_prev + from_next;
                              }
                            });
  });
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 5; ++i) EXPECT_EQ(data[r][i], 6 * (i + 1)) << "rank " << r << " member " << i;
  }
  EXPECT_EQ(group.engine(0).sequences_used(), 3u);
}

}  // namespace
}  // namespace fsdp_ext::comm
