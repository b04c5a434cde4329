// Which algorithm each collective picks by size, group size and shared
// memory, and what the FSDP_EXT_*_ALGO variables force.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "comm/algorithm_selection.h"
#include "scoped_variable.h"

namespace fsdp_ext::comm {
namespace {

using testing::ScopedVariable;

constexpr size_t KiB = 1024, MiB = 1024 * KiB;

TEST(AlgorithmSelection, SharedMemoryAboveItsThreshold) {
  EXPECT_EQ(select_allgather(32 * KiB, 2, true), Algorithm::kSharedMemory);
  EXPECT_EQ(select_allgather(32 * KiB - 1, 2, true), Algorithm::kDirect);
  EXPECT_EQ(select_reduce_scatter(64 * MiB, 3, true), Algorithm::kSharedMemory);
  EXPECT_EQ(select_allreduce(1 * MiB, 5, true), Algorithm::kSharedMemory);
  EXPECT_EQ(select_broadcast(1 * MiB, 2, true), Algorithm::kSharedMemory);
}

TEST(AlgorithmSelection, MessagesWithoutSharedMemory) {
  // Rings for large ops on many ranks; one direct round otherwise.
  EXPECT_EQ(select_allgather(1 * MiB, 4, false), Algorithm::kRing);
  EXPECT_EQ(select_allgather(1 * MiB - 1, 4, false), Algorithm::kDirect);
  EXPECT_EQ(select_allgather(64 * MiB, 3, false), Algorithm::kDirect);
  EXPECT_EQ(select_reduce_scatter(1 * MiB, 4, false), Algorithm::kRing);
  EXPECT_EQ(select_allreduce(64 * KiB, 8, false), Algorithm::kDirect);
  EXPECT_EQ(select_allreduce(64 * KiB + 1, 2, false), Algorithm::kRing);
  EXPECT_EQ(select_broadcast(1 * MiB, 8, false), Algorithm::kDirect);
  EXPECT_EQ(select_broadcast(1 * MiB, 9, false), Algorithm::kRing);
}

TEST(AlgorithmSelection, TwoRanksOnTwoHostsReduceScatterInOneMessageEachWay) {
  EXPECT_EQ(select_reduce_scatter(1 * MiB, 2, false, /*spans_hosts=*/true), Algorithm::kRing);
  EXPECT_EQ(select_reduce_scatter(1 * MiB - 1, 2, false, true), Algorithm::kDirect);
  // Within one host, and with more ranks, the direct algorithm's pieces.
  EXPECT_EQ(select_reduce_scatter(64 * MiB, 2, false, /*spans_hosts=*/false), Algorithm::kDirect);
  EXPECT_EQ(select_reduce_scatter(64 * MiB, 3, false, true), Algorithm::kDirect);
  ScopedVariable forced("FSDP_EXT_REDUCE_SCATTER_ALGO", "direct");
  EXPECT_EQ(select_reduce_scatter(64 * MiB, 2, false, true), Algorithm::kDirect);
}

TEST(AlgorithmSelection, ForcedByVariable) {
  {
    ScopedVariable forced("FSDP_EXT_ALLGATHER_ALGO", "ring");
    EXPECT_EQ(select_allgather(8, 2, true), Algorithm::kRing);
  }
  {
    ScopedVariable forced("FSDP_EXT_REDUCE_SCATTER_ALGO", "direct");
    EXPECT_EQ(select_reduce_scatter(64 * MiB, 4, true), Algorithm::kDirect);
  }
  {
    // "shm" where the group has no shared memory: the automatic choice.
    ScopedVariable forced("FSDP_EXT_ALLREDUCE_ALGO", "shm");
    EXPECT_EQ(select_allreduce(8, 2, true), Algorithm::kSharedMemory);
    EXPECT_EQ(select_allreduce(8, 2, false), Algorithm::kDirect);
  }
  {
    ScopedVariable forced("FSDP_EXT_BROADCAST_ALGO", "auto");
    EXPECT_EQ(select_broadcast(8, 2, false), Algorithm::kDirect);
  }
  // Each variable governs its own collective only.
  ScopedVariable forced("FSDP_EXT_ALLGATHER_ALGO", "ring");
  EXPECT_EQ(select_reduce_scatter(8, 2, false), Algorithm::kDirect);
}

TEST(AlgorithmSelection, ForcedNamesAreExact) {
  for (const char* name : {"auto", "direct", "ring", "shm"}) {
    EXPECT_TRUE(is_forced_algorithm_name(name)) << name;
  }
  // What the backend refuses at group creation, naming the variable.
  for (const char* name : {"", "Ring", "ring ", "tree", "shared_memory", "0"}) {
    EXPECT_FALSE(is_forced_algorithm_name(name)) << "'" << name << "'";
  }
  // Should a bad name ever reach selection, it means the automatic choice.
  ScopedVariable forced("FSDP_EXT_ALLGATHER_ALGO", "tree");
  EXPECT_EQ(select_allgather(64 * MiB, 4, false), Algorithm::kRing);
}

TEST(AlgorithmSelection, Names) {
  EXPECT_STREQ(algorithm_name(Algorithm::kDirect), "direct");
  EXPECT_STREQ(algorithm_name(Algorithm::kRing), "ring");
  EXPECT_STREQ(algorithm_name(Algorithm::kSharedMemory), "shm");
}

}  // namespace
}  // namespace fsdp_ext::comm
