// The reuse rule of the group's device buffers (device/stream_ordered_reuse.h,
// Note [a freed buffer is reused in stream order]) with fences the test
// passes by hand, the device size classes and the lookup of the buffer that
// holds a range (device/buffer_ranges.h). CUDA-free: the pool's CUDA
// side runs in test/test_cuda.py on a GPU machine.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <vector>

#include "device/buffer_ranges.h"
#include "device/stream_ordered_reuse.h"

namespace fsdp_ext::device {
namespace {

// A fence the test opens: passed() once `open` is set; wait() opens it (as
// cudaEventSynchronize returns once the event has passed) and counts.
struct TestFence {
  std::shared_ptr<bool> open;
  std::shared_ptr<int> waits;
  bool passed() { return *open; }
  void wait() {
    ++*waits;
    *open = true;
  }
};

struct Fences {
  std::vector<std::shared_ptr<bool>> gates;
  std::shared_ptr<int> waits = std::make_shared<int>(0);
  // A fence on `stream`, closed until the test opens gates[i].
  StreamOrderedReuse<TestFence>::Fenced on(StreamId stream) {
    gates.push_back(std::make_shared<bool>(false));
    return {stream, TestFence{gates.back(), waits}};
  }
};

constexpr StreamId kAllGather = 1, kGroup = 2, kCompute = 3;
char a, b, c;  // buffers, by address

TEST(StreamOrderedReuse, TheAllocatingStreamReusesAtOnceOthersWaitForItsFence) {
  StreamOrderedReuse<TestFence> reuse;
  Fences fences;
  std::vector<StreamOrderedReuse<TestFence>::Fenced> released;
  released.push_back(fences.on(kAllGather));
  reuse.put(&a, 4096, std::move(released));
  EXPECT_EQ(reuse.take(4096, kCompute), nullptr);  // the all-gather stream may still use it
  EXPECT_EQ(reuse.pending(), 1u);
  EXPECT_EQ(reuse.take(4096, kAllGather), &a);     // its own stream: in order
  EXPECT_EQ(reuse.free_buffers(), 0u);
}

TEST(StreamOrderedReuse, ARecordedStreamHoldsTheBufferForEveryStreamButItself) {
  StreamOrderedReuse<TestFence> reuse;
  Fences fences;
  std::vector<StreamOrderedReuse<TestFence>::Fenced> released;
  released.push_back(fences.on(kAllGather));
  released.push_back(fences.on(kGroup));  // the collective on the group's stream
  reuse.put(&a, 4096, std::move(released));
  EXPECT_EQ(reuse.take(4096, kAllGather), nullptr);  // the group's stream still reads it
  EXPECT_EQ(reuse.take(4096, kCompute), nullptr);
  *fences.gates[1] = true;  // the collective is done
  EXPECT_EQ(reuse.take(4096, kCompute), nullptr);   // the all-gather stream's fence is not
  EXPECT_EQ(reuse.take(4096, kAllGather), &a);
}

TEST(StreamOrderedReuse, OnlyTheSizeClassAskedForAndTheFirstFreedFirst) {
  StreamOrderedReuse<TestFence> reuse;
  reuse.put(&a, 8192, {});
  reuse.put(&b, 4096, {});
  reuse.put(&c, 4096, {});
  EXPECT_EQ(reuse.take(12288, kCompute), nullptr);
  EXPECT_EQ(reuse.take(4096, kCompute), &b);
  EXPECT_EQ(reuse.take(4096, kCompute), &c);
  EXPECT_EQ(reuse.take(4096, kCompute), nullptr);
  EXPECT_EQ(reuse.take(8192, kGroup), &a);
}

TEST(StreamOrderedReuse, ALaterBufferWhoseFencesPassedIsTakenPastAnEarlierOneStillFenced) {
  StreamOrderedReuse<TestFence> reuse;
  Fences fences;
  std::vector<StreamOrderedReuse<TestFence>::Fenced> first, second;
  first.push_back(fences.on(kGroup));
  second.push_back(fences.on(kGroup));
  reuse.put(&a, 4096, std::move(first));
  reuse.put(&b, 4096, std::move(second));
  *fences.gates[1] = true;
  EXPECT_EQ(reuse.take(4096, kCompute), &b);
  EXPECT_EQ(reuse.take(4096, kCompute), nullptr);
}

TEST(StreamOrderedReuse, WaitAllBlocksOnEveryPendingFenceOnce) {
  StreamOrderedReuse<TestFence> reuse;
  Fences fences;
  std::vector<StreamOrderedReuse<TestFence>::Fenced> first, second;
  first.push_back(fences.on(kGroup));
  first.push_back(fences.on(kAllGather));
  second.push_back(fences.on(kGroup));
  reuse.put(&a, 4096, std::move(first));
  reuse.put(&b, 8192, std::move(second));
  EXPECT_EQ(reuse.pending(), 2u);
  reuse.wait_all();
  EXPECT_EQ(*fences.waits, 3);
  EXPECT_EQ(reuse.pending(), 0u);
  reuse.wait_all();  // nothing left to wait for
  EXPECT_EQ(*fences.waits, 3);
  EXPECT_EQ(reuse.take(4096, kCompute), &a);
  EXPECT_EQ(reuse.take(8192, kCompute), &b);
}

TEST(StreamOrderedReuse, TakeAllEmptiesEveryClassOnceTheFencesPassed) {
  StreamOrderedReuse<TestFence> reuse;
  Fences fences;
  std::vector<StreamOrderedReuse<TestFence>::Fenced> first, second;
  first.push_back(fences.on(kGroup));
  second.push_back(fences.on(kAllGather));
  reuse.put(&a, 512, std::move(first));
  reuse.put(&b, 512, {});
  reuse.put(&c, 8192, std::move(second));
  std::vector<void*> taken = reuse.take_all();
  EXPECT_EQ(*fences.waits, 2);  // both pending fences waited for
  EXPECT_EQ(taken, (std::vector<void*>{&a, &b, &c}));
  EXPECT_EQ(reuse.free_buffers(), 0u);
  EXPECT_EQ(reuse.take(512, kAllGather), nullptr);  // none handed out again
  EXPECT_TRUE(reuse.take_all().empty());
}

TEST(DeviceSizeClass, WholeUnitsThenFourStepsPerPowerOfTwo) {
  EXPECT_EQ(device_size_class(1), 512u);
  EXPECT_EQ(device_size_class(512), 512u);
  EXPECT_EQ(device_size_class(513), 1024u);
  EXPECT_EQ(device_size_class(3), 512u);
  EXPECT_EQ(device_size_class(4096), 4096u);
  EXPECT_EQ(device_size_class(4097), 5120u);          // (4 KiB, 8 KiB] in steps of 1 KiB
  EXPECT_EQ(device_size_class(8191 * 4), 32768u);     // 8191 fp32
  EXPECT_EQ(device_size_class((1u << 20) + 1), (1u << 20) + (1u << 18));
  EXPECT_EQ(device_size_class(3u << 20), 3u << 20);   // FSDP's sizes repeat exactly
}

TEST(DeviceSizeClass, FitsMonotonicAndAtMostAQuarterSlackAbove4KiB) {
  size_t previous = 0;
  for (size_t bytes = 1; bytes < (size_t{1} << 34); bytes = bytes * 5 / 4 + 3) {
    const size_t size_class = device_size_class(bytes);
    ASSERT_GE(size_class, bytes) << bytes;
    ASSERT_GE(size_class, previous) << bytes;
    if (bytes > 4096) {
      ASSERT_LE(size_class - bytes, bytes / 4) << bytes << " -> " << size_class;
    }
    ASSERT_EQ(device_size_class(size_class), size_class) << bytes;  // a class is its own class
    previous = size_class;
  }
}


// Two buffers back to back (as two cudaMallocs of one 2 MiB chunk may be)
// and a third after a gap.
std::map<uintptr_t, size_t> back_to_back_buffers() {
  return {{0x1000, 0x200}, {0x1200, 0x400}, {0x2000, 0x200}};
}

uintptr_t holder(uintptr_t address, size_t bytes) {
  return base_holding(back_to_back_buffers(), address, bytes, [](size_t size) { return size; });
}

TEST(BaseHolding, EveryByteOfABufferIsItsOwnAndNoneOutside) {
  EXPECT_EQ(holder(0x1000, 0x200), 0x1000u);  // the whole buffer
  EXPECT_EQ(holder(0x1000, 1), 0x1000u);
  EXPECT_EQ(holder(0x11ff, 1), 0x1000u);  // its last byte
  EXPECT_EQ(holder(0x1200, 1), 0x1200u);  // the next buffer's first
  EXPECT_EQ(holder(0x0fff, 1), 0u);       // before the first buffer
  EXPECT_EQ(holder(0x1600, 1), 0u);       // in the gap
  EXPECT_EQ(holder(0x2200, 1), 0u);       // past the last
}

TEST(BaseHolding, AnEmptyRangeAtTheEndOfABufferIsNotInIt) {
  // A tensor whose storage starts right after a buffer (torch's memory, or a
  // neighbouring allocation) must not be taken for one of the pool's.
  EXPECT_EQ(holder(0x1600, 0), 0u);
  EXPECT_EQ(holder(0x2200, 0), 0u);
  EXPECT_EQ(holder(0x1200, 0), 0x1200u);  // the start of the next one
  EXPECT_EQ(holder(0x11ff, 0), 0x1000u);
}

TEST(BaseHolding, ARangeCrossingIntoTheNextBufferIsInNeither) {
  EXPECT_EQ(holder(0x1100, 0x100), 0x1000u);
  EXPECT_EQ(holder(0x1100, 0x101), 0u);  // one byte into the next buffer
  EXPECT_EQ(holder(0x1000, 0x600), 0u);  // both buffers
  EXPECT_EQ(holder(0x1fff, 2), 0u);
}

}  // namespace
}  // namespace fsdp_ext::device
