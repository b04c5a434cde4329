// The pool of communication buffers (comm/shared_buffer_pool.h) on its own:
// size classes, reuse through the free lists, locate(), registration with
// UCX, misuse, and allocation from several threads at once.
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "comm/error.h"
#include "comm/shared_buffer_pool.h"
#include "comm/shared_memory_segment.h"

namespace fsdp_ext::comm {
namespace {

constexpr size_t KiB = 1024, MiB = 1024 * KiB;

TEST(SharedSizeClass, SmallestClassIsOnePage) {
  EXPECT_EQ(shared_size_class(0), 4 * KiB);
  EXPECT_EQ(shared_size_class(1), 4 * KiB);
  EXPECT_EQ(shared_size_class(4 * KiB), 4 * KiB);
}

TEST(SharedSizeClass, WholePagesThenFourStepsPerPowerOfTwo) {
  // Below 16 KiB whole pages; (16 KiB, 32 KiB] in steps of 4 KiB, (1 MiB,
  // 2 MiB] in steps of 256 KiB.
  EXPECT_EQ(shared_size_class(4 * KiB + 1), 8 * KiB);
  EXPECT_EQ(shared_size_class(8 * KiB + 1), 12 * KiB);
  EXPECT_EQ(shared_size_class(16 * KiB), 16 * KiB);
  EXPECT_EQ(shared_size_class(16 * KiB + 1), 20 * KiB);
  EXPECT_EQ(shared_size_class(31 * KiB), 32 * KiB);
  EXPECT_EQ(shared_size_class(1 * MiB + 1), 1 * MiB + 256 * KiB);
  EXPECT_EQ(shared_size_class(2 * MiB), 2 * MiB);
}

TEST(SharedSizeClass, FitsMonotonicAndAtMostAQuarterSlack) {
  size_t previous = 0;
  for (size_t bytes = 1; bytes < 64 * MiB; bytes = bytes * 3 / 2 + 7) {
    const size_t size_class = shared_size_class(bytes);
    EXPECT_GE(size_class, bytes);
    EXPECT_GE(size_class, previous) << bytes;
    EXPECT_EQ(size_class % (4 * KiB), 0u) << bytes;  // whole pages
    if (bytes > 16 * KiB) {
      EXPECT_LE(size_class - bytes, bytes / 4) << bytes;
    }
    // Quantized: a class maps to itself.
    EXPECT_EQ(shared_size_class(size_class), size_class) << bytes;
    previous = size_class;
  }
}

TEST(SharedBufferPool, ReleasedBuffersAreReusedWithinTheirClass) {
  SharedBufferPool pool(nullptr);
  void* first = pool.allocate(5000);
  std::memset(first, 0x5a, 5000);  // the whole request is usable memory
  pool.release(first);
  // 5000 and 7000 share the 8 KiB class: the same buffer comes back.
  void* second = pool.allocate(7000);
  EXPECT_EQ(second, first);
  // 9000 is another class: new memory.
  void* third = pool.allocate(9000);
  EXPECT_NE(third, first);
  const SharedPoolStats stats = pool.stats();
  EXPECT_EQ(stats.allocations, 3u);
  EXPECT_EQ(stats.reuses, 1u);
  EXPECT_EQ(stats.segments, 2u);
  EXPECT_EQ(stats.in_use, 2u);
  EXPECT_EQ(stats.reserved_bytes, shared_size_class(5000) + shared_size_class(9000));
  EXPECT_EQ(stats.registrations, 0u);  // no UCX context given
  pool.release(second);
  pool.release(third);
  EXPECT_EQ(pool.stats().in_use, 0u);
  EXPECT_EQ(pool.stats().segments, 2u);  // kept for reuse
}

TEST(SharedBufferPool, BuffersInUseAreNeverHandedOutTwice) {
  SharedBufferPool pool(nullptr);
  std::set<void*> live;
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(live.insert(pool.allocate(4096)).second);
  EXPECT_EQ(pool.stats().reuses, 0u);
  for (void* data : live) pool.release(data);
  std::set<void*> again;
  for (int i = 0; i < 8; ++i) again.insert(pool.allocate(4096));
  EXPECT_EQ(again, live);
  EXPECT_EQ(pool.stats().reuses, 8u);
  for (void* data : again) pool.release(data);
}

TEST(SharedBufferPool, LocateFindsRangesInsideOneBufferOnly) {
  SharedBufferPool pool(nullptr);
  char* data = static_cast<char*>(pool.allocate(10000));
  const size_t capacity = shared_size_class(10000);
  const auto whole = pool.locate(data, 10000);
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->offset, 0u);
  EXPECT_EQ(whole->segment_bytes, capacity);
  EXPECT_GE(whole->fd, 0);
  const auto inner = pool.locate(data + 100, 50);
  ASSERT_TRUE(inner.has_value());
  EXPECT_EQ(inner->offset, 100u);
  EXPECT_EQ(inner->segment_id, whole->segment_id);
  EXPECT_TRUE(pool.locate(data + capacity - 1, 1).has_value());
  EXPECT_FALSE(pool.locate(data + capacity - 1, 2).has_value());  // runs past the end
  EXPECT_FALSE(pool.locate(data - 1, 1).has_value());
  int stack_value = 0;
  EXPECT_FALSE(pool.locate(&stack_value, sizeof(stack_value)).has_value());
  pool.release(data);
}

TEST(SharedBufferPool, SegmentIdsAreUniqueAcrossBuffersAndStaging) {
  SharedBufferPool pool(nullptr);
  void* a = pool.allocate(1);
  void* b = pool.allocate(1);
  const uint64_t staging = pool.next_segment_id();
  std::set<uint64_t> ids = {pool.locate(a, 1)->segment_id, pool.locate(b, 1)->segment_id,
                            staging};
  EXPECT_EQ(ids.size(), 3u);
  pool.release(a);
  pool.release(b);
}

TEST(SharedBufferPool, ReleasingForeignOrFreedMemoryIsAnError) {
  SharedBufferPool pool(nullptr);
  int stack_value = 0;
  EXPECT_THROW(pool.release(&stack_value), CommError);
  void* data = pool.allocate(100);
  pool.release(data);
  EXPECT_THROW(pool.release(data), CommError);  // twice
  EXPECT_EQ(pool.stats().in_use, 0u);
}

TEST(SharedBufferPool, RegistersEveryBufferWithUcxWhenGivenAContext) {
  auto ucx = std::make_shared<UcxContext>(1);
  SharedBufferPool pool(ucx);
  void* a = pool.allocate(4096);
  void* b = pool.allocate(3 * MiB);
  EXPECT_EQ(pool.stats().registrations, 2u);
  pool.release(a);
  pool.release(b);
  EXPECT_EQ(pool.stats().registrations, 2u);  // kept with the free buffers
}

TEST(SharedBufferPool, SegmentsCanBeMappedByAPeer) {
  // What a peer on the same host does with a location: map the owner's fd.
  SharedBufferPool pool(nullptr);
  char* data = static_cast<char*>(pool.allocate(6000));
  std::memset(data, 0x11, 6000);
  data[5999] = 0x22;
  const auto where = pool.locate(data, 6000);
  ASSERT_TRUE(where.has_value());
  SharedMemorySegment peer_view =
      SharedMemorySegment::open_peer(getpid(), where->fd, where->segment_bytes);
  const char* seen = static_cast<const char*>(peer_view.data()) + where->offset;
  EXPECT_EQ(seen[0], 0x11);
  EXPECT_EQ(seen[5999], 0x22);
  pool.release(data);
}

TEST(SharedBufferPool, ThreadsAllocateAndReleaseConcurrently) {
  // Python threads allocate while the progress thread frees: the pool is
  // shared (run under ThreadSanitizer in make test).
  SharedBufferPool pool(nullptr);
  constexpr int kThreads = 4, kRounds = 200;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&pool, t] {
      for (int round = 0; round < kRounds; ++round) {
        const size_t bytes = 1000 + 3000 * ((t + round) % 4);
        char* data = static_cast<char*>(pool.allocate(bytes));
        data[0] = static_cast<char>(t);
        data[bytes - 1] = static_cast<char>(round);
        EXPECT_TRUE(pool.locate(data, bytes).has_value());
        EXPECT_EQ(data[0], static_cast<char>(t));  // nobody else was handed it
        pool.release(data);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  const SharedPoolStats stats = pool.stats();
  EXPECT_EQ(stats.in_use, 0u);
  EXPECT_EQ(stats.allocations, static_cast<size_t>(kThreads * kRounds));
  // At most one buffer per thread per class was ever needed at once.
  EXPECT_LE(stats.segments, static_cast<size_t>(kThreads * 4));
  EXPECT_EQ(stats.allocations - stats.reuses, stats.segments);
}

}  // namespace
}  // namespace fsdp_ext::comm
