// The shared-memory protocol's building block (algorithms/
// shared_source_exchange.h) between ranks as threads: pieces in ordinary
// memory are staged, pieces in pool buffers are read in place, large pieces
// of exchanges whose readers take process memory are read with
// process_vm_readv (copied out, or reduced a chunk at a time), and sizes that
// differ between ranks fail as a mismatch instead of a wrong read.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "comm/algorithms/shared_source_exchange.h"
#include "comm/error.h"
#include "comm/reduce_spec.h"
#include "loopback_group.h"

namespace fsdp_ext::comm {
namespace {

using testing::LoopbackGroup;
using testing::LoopbackOptions;

uint8_t byte_of(int owner, int reader, size_t index) {
  return static_cast<uint8_t>(owner * 59 + reader * 13 + index * 7 + 1);
}

// Every rank offers each peer three pieces: ordinary memory (3 + reader
// bytes), a pool buffer (5000 bytes) and an empty piece; every rank reads
// them back through source() and checks each byte.
TEST(SharedSourceExchange, StagedInPlaceAndEmptyPiecesReadBack) {
  constexpr int n = 3;
  LoopbackGroup group(n);
  std::vector<std::vector<std::vector<uint8_t>>> ordinary(n, std::vector<std::vector<uint8_t>>(n));
  std::vector<std::vector<uint8_t*>> pooled(n, std::vector<uint8_t*>(n, nullptr));
  for (int owner = 0; owner < n; ++owner) {
    for (int reader = 0; reader < n; ++reader) {
      ordinary[owner][reader].resize(3 + reader);
      for (size_t i = 0; i < ordinary[owner][reader].size(); ++i) {
        ordinary[owner][reader][i] = byte_of(owner, reader, i);
      }
      pooled[owner][reader] = static_cast<uint8_t*>(group.pool(owner).allocate(5000));
      for (size_t i = 0; i < 5000; ++i) pooled[owner][reader][i] = byte_of(owner, reader, i + 100);
    }
  }
  // mismatches[reader][owner]: bytes that differed (checked on the progress
  // thread, before finish() lets the owner go on).
  std::vector<std::vector<int>> mismatches(n, std::vector<int>(n, -1));
  group.run_ok("exchange", [&](int r, OpContext& context) {
    SharedSourceExchange exchange(context, *context.shared_memory(), /*first_step=*/0);
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      exchange.offer(p, {ConstSpan{ordinary[r][p].data(), ordinary[r][p].size()},
                         ConstSpan{pooled[r][p], 5000}, ConstSpan{nullptr, 0}});
      exchange.expect(p, {static_cast<size_t>(3 + r), 5000, 0});
    }
    exchange.exchange();
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      int wrong = 0;
      const uint8_t* first = reinterpret_cast<const uint8_t*>(exchange.source(p, 0));
      for (int i = 0; i < 3 + r; ++i) wrong += first[i] != byte_of(p, r, i);
      const uint8_t* second = reinterpret_cast<const uint8_t*>(exchange.source(p, 1));
      for (size_t i = 0; i < 5000; ++i) wrong += second[i] != byte_of(p, r, i + 100);
      wrong += exchange.source(p, 2) != nullptr;  // empty pieces have no source
      mismatches[r][p] = wrong;
    }
    exchange.finish();
  });
  for (int r = 0; r < n; ++r) {
    for (int p = 0; p < n; ++p) {
      if (p != r) {
        EXPECT_EQ(mismatches[r][p], 0) << "rank " << r << " reading rank " << p;
      }
    }
    // Two ordinary pieces staged (one per peer), two pool buffers in place.
    EXPECT_EQ(group.domain(r).pieces_staged(), 2u);
    EXPECT_EQ(group.domain(r).pieces_offered_in_place(), 2u);
    for (int p = 0; p < n; ++p) {
      if (p != r) group.pool(r).release(pooled[r][p]);
    }
  }
}

// Exchanges whose readers take process memory (every shared-memory
// algorithm's) offer pieces of kProcessReadMinBytes and more as process
// memory when process reads are on, and stage them otherwise (and smaller
// pieces always); copy_out gives the same bytes either way.
void process_memory_round_trip(bool process_reads, size_t bytes) {
  LoopbackOptions options;
  options.process_reads = process_reads;
  LoopbackGroup group(2, options);
  std::vector<std::vector<uint8_t>> sources(2, std::vector<uint8_t>(bytes));
  std::vector<std::vector<uint8_t>> copies(2, std::vector<uint8_t>(bytes, 0));
  for (int r = 0; r < 2; ++r) {
    for (size_t i = 0; i < bytes; ++i) sources[r][i] = byte_of(r, 1 - r, i);
  }
  group.run_ok("process-memory exchange", [&](int r, OpContext& context) {
    SharedSourceExchange exchange(context, *context.shared_memory(), 0, 0, kProcessReadMinBytes);
    exchange.offer(1 - r, {ConstSpan{sources[r].data(), bytes}});
    exchange.expect(1 - r, {bytes});
    exchange.exchange();
    exchange.copy_out(1 - r, 0, copies[r].data());
    exchange.finish();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(std::memcmp(copies[r].data(), sources[1 - r].data(), bytes), 0) << "rank " << r;
    const bool direct = process_reads && bytes >= kProcessReadMinBytes;
    EXPECT_EQ(group.domain(r).pieces_offered_for_process_reads(), direct ? 1u : 0u) << bytes;
    EXPECT_EQ(group.domain(r).pieces_staged(), direct ? 0u : 1u) << bytes;
  }
}

TEST(SharedSourceExchange, LargePiecesAreReadAsProcessMemory) {
  process_memory_round_trip(true, kProcessReadMinBytes);
  process_memory_round_trip(true, (1 << 20) + 3);
}

TEST(SharedSourceExchange, PiecesUnderTheThresholdAreStaged) {
  process_memory_round_trip(true, kProcessReadMinBytes - 1);
}

TEST(SharedSourceExchange, WithoutProcessReadsLargePiecesAreStaged) {
  process_memory_round_trip(false, (1 << 20) + 3);
}

// reduce_pieces over 3 ranks whose pieces are of every kind at once: a small
// staged one (rank 0's block: 5 floats), and blocks over 1 MiB read as
// process memory a chunk at a time, their sizes awkward against the 256 KiB
// chunk (2^18 + 3 + owner floats). Contributions are small integers, so the
// sum is exact and compared element by element.
void reduce_pieces_of_every_kind(bool process_reads) {
  constexpr int n = 3;
  LoopbackOptions options;
  options.process_reads = process_reads;
  LoopbackGroup group(n, options);
  auto block_floats = [](int owner) -> size_t { return owner == 0 ? 5 : (1u << 18) + 3 + owner; };
  auto contribution = [](int from, int owner, size_t i) {
    return static_cast<float>((from * 7 + owner * 3 + i) % 11);
  };
  // inputs[from][owner]: what rank `from` contributes to `owner`'s block.
  std::vector<std::vector<std::vector<float>>> inputs(n, std::vector<std::vector<float>>(n));
  std::vector<std::vector<float>> outputs(n);
  for (int from = 0; from < n; ++from) {
    for (int owner = 0; owner < n; ++owner) {
      for (size_t i = 0; i < block_floats(owner); ++i) {
        inputs[from][owner].push_back(contribution(from, owner, i));
      }
    }
    outputs[from].assign(block_floats(from), -1.0f);
  }
  group.run_ok("reduce_pieces", [&](int r, OpContext& context) {
    SharedSourceExchange exchange(context, *context.shared_memory(), 0, 0, kProcessReadMinBytes);
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      exchange.offer(p, {ConstSpan{inputs[r][p].data(), inputs[r][p].size() * sizeof(float)}});
      exchange.expect(p, {block_floats(r) * sizeof(float)});
    }
    exchange.exchange();
    exchange.reduce_pieces(0, MutableSpan{outputs[r].data(), outputs[r].size() * sizeof(float)},
                           inputs[r][r].data(), ReduceSpec{DataType::kFloat32, ReduceKind::kSum});
    exchange.finish();
  });
  for (int owner = 0; owner < n; ++owner) {
    for (size_t i = 0; i < block_floats(owner); ++i) {
      float sum = 0;
      for (int from = 0; from < n; ++from) sum += contribution(from, owner, i);
      ASSERT_EQ(outputs[owner][i], sum) << "owner " << owner << ", element " << i;
    }
    // Pieces of rank 0's small block are staged; the others are offered as
    // process memory when allowed: rank 0 offers two (to ranks 1 and 2),
    // ranks 1 and 2 one each (their piece for rank 0 is small).
    const uint64_t large_offered = owner == 0 ? 2 : 1;
    EXPECT_EQ(group.domain(owner).pieces_offered_for_process_reads(),
              process_reads ? large_offered : 0u)
        << "rank " << owner;
  }
}

TEST(SharedSourceExchange, ReducePiecesStagedAndReadAsProcessMemory) {
  reduce_pieces_of_every_kind(true);
}

TEST(SharedSourceExchange, ReducePiecesAllStagedWithoutProcessReads) {
  reduce_pieces_of_every_kind(false);
}

// Two ranks, one exchange each: `configure(r, exchange)` offers, expects and
// sets what the case compares; then the exchange and its finish run.
template <typename Configure>
std::vector<OpOutcome> exchange_outcomes(const std::string& name, Configure configure) {
  LoopbackGroup group(2);
  return group.run(
      name,
      [&](int r, OpContext& context) {
        SharedSourceExchange exchange(context, *context.shared_memory(), 0);
        configure(r, exchange);
        exchange.exchange();
        exchange.finish();
      },
      std::chrono::milliseconds(2000));
}

TEST(SharedSourceExchange, SizesThatDifferBetweenRanksAreAMismatch) {
  std::vector<uint8_t> memory(64, 1);
  const auto outcomes =
      exchange_outcomes("exchange mismatch", [&](int r, SharedSourceExchange& exchange) {
        exchange.offer(1 - r, {ConstSpan{memory.data(), r == 0 ? size_t{64} : size_t{63}}});
        exchange.expect(1 - r, {64});
      });
  // Rank 0 expected 64 bytes from rank 1, which offered 63.
  ASSERT_FALSE(outcomes[0].ok);
  EXPECT_EQ(outcomes[0].kind, ErrorKind::kMismatch);
  EXPECT_NE(outcomes[0].message.find("rank 1 has 63 bytes for tensor 0 but this rank expects 64"),
            std::string::npos)
      << outcomes[0].message;
  EXPECT_NE(outcomes[0].message.find("exchange mismatch"), std::string::npos);
}

TEST(SharedSourceExchange, WholeTensorsThatDifferAreAMismatchOnEveryRank) {
  // The all-reduce's case: each rank offers the peer a block of its own
  // tensor, and the blocks agree (64 bytes each way) although rank 0's
  // tensor is 4 bytes longer. Only the tensors' sizes can tell, and both
  // ranks see it before reading.
  std::vector<uint8_t> memory(64, 1);
  const auto outcomes =
      exchange_outcomes("whole mismatch", [&](int r, SharedSourceExchange& exchange) {
        exchange.offer(1 - r, {ConstSpan{memory.data(), 64}});
        exchange.expect(1 - r, {64});
        exchange.set_whole_bytes({r == 0 ? size_t{132} : size_t{128}});
      });
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(outcomes[r].ok) << "rank " << r;
    EXPECT_EQ(outcomes[r].kind, ErrorKind::kMismatch) << outcomes[r].message;
  }
  EXPECT_NE(outcomes[0].message.find("rank 1's tensor 0 has 128 bytes where this rank's has 132"),
            std::string::npos)
      << outcomes[0].message;
  EXPECT_NE(outcomes[1].message.find("rank 0's tensor 0 has 132 bytes where this rank's has 128"),
            std::string::npos)
      << outcomes[1].message;
}

TEST(SharedSourceExchange, ReductionsThatDifferAreAMismatchOnEveryRank) {
  // Every size agrees: rank 0 sums float32, rank 1 int32 (tensor 0), and
  // rank 0 averages where rank 1 sums (tensor 1). The first difference is
  // reported, on both ranks.
  std::vector<uint8_t> memory(64, 1);
  const auto outcomes =
      exchange_outcomes("reduction mismatch", [&](int r, SharedSourceExchange& exchange) {
        exchange.offer(1 - r, {ConstSpan{memory.data(), 32}, ConstSpan{memory.data() + 32, 32}});
        exchange.expect(1 - r, {32, 32});
        ReduceSpec first, second;
        first.type = r == 0 ? DataType::kFloat32 : DataType::kInt32;
        second.post_divisor = r == 0 ? 2.0 : 1.0;
        exchange.set_reductions({first, second});
      });
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(outcomes[r].ok) << "rank " << r;
    EXPECT_EQ(outcomes[r].kind, ErrorKind::kMismatch) << outcomes[r].message;
  }
  EXPECT_NE(outcomes[0].message.find("rank 1 reduces tensor 0 as int32 SUM where this rank "
                                     "reduces it as float32 SUM (the ranks' dtypes or reduce ops "
                                     "differ)"),
            std::string::npos)
      << outcomes[0].message;
  EXPECT_NE(outcomes[1].message.find("rank 0 reduces tensor 0 as float32 SUM where this rank "
                                     "reduces it as int32 SUM"),
            std::string::npos)
      << outcomes[1].message;
}

TEST(SharedSourceExchange, AveragingAgainstSummingIsAMismatch) {
  std::vector<uint8_t> memory(64, 1);
  const auto outcomes =
      exchange_outcomes("average mismatch", [&](int r, SharedSourceExchange& exchange) {
        exchange.offer(1 - r, {ConstSpan{memory.data(), 64}});
        exchange.expect(1 - r, {64});
        ReduceSpec spec;
        spec.post_divisor = r == 0 ? 2.0 : 1.0;
        exchange.set_reductions({spec});
      });
  ASSERT_FALSE(outcomes[1].ok);
  EXPECT_NE(outcomes[1].message.find("rank 0 reduces tensor 0 as float32 AVG where this rank "
                                     "reduces it as float32 SUM"),
            std::string::npos)
      << outcomes[1].message;
}

TEST(SharedSourceExchange, ExchangesOfDifferentCollectivesAreNamed) {
  LoopbackGroup group(2);
  std::vector<uint8_t> memory(64, 1);
  const auto outcomes = group.run(
      "exchange kinds",
      [&](int r, OpContext& context) {
        // Same sizes on both ranks: only the collectives differ.
        SharedSourceExchange exchange(
            context, *context.shared_memory(), 0, 0, kNoProcessReads,
            r == 0 ? SharedExchangeKind::kAllReduceInputs : SharedExchangeKind::kAllGather);
        exchange.offer(1 - r, {ConstSpan{memory.data(), 64}});
        exchange.expect(1 - r, {64});
        exchange.exchange();
        exchange.finish();
      },
      std::chrono::milliseconds(2000));
  ASSERT_FALSE(outcomes[0].ok);
  EXPECT_EQ(outcomes[0].kind, ErrorKind::kMismatch);
  EXPECT_NE(outcomes[0].message.find("rank 1 is in an all-gather where this rank is in an "
                                     "all-reduce (its first phase) (the ranks called different "
                                     "collectives"),
            std::string::npos)
      << outcomes[0].message;
  ASSERT_FALSE(outcomes[1].ok);
  EXPECT_NE(outcomes[1].message.find("rank 0 is in an all-reduce (its first phase) where this "
                                     "rank is in an all-gather"),
            std::string::npos)
      << outcomes[1].message;
}

TEST(SharedSourceExchange, ADifferentNumberOfPiecesIsAMismatchToo) {
  std::vector<uint8_t> memory(64, 1);
  const auto outcomes =
      exchange_outcomes("exchange piece count", [&](int r, SharedSourceExchange& exchange) {
        std::vector<ConstSpan> pieces(r == 0 ? 1 : 2, ConstSpan{memory.data(), 8});
        exchange.offer(1 - r, pieces);
        exchange.expect(1 - r, std::vector<size_t>(r == 0 ? 1 : 2, 8));
      });
  for (int r = 0; r < 2; ++r) EXPECT_FALSE(outcomes[r].ok) << "rank " << r;
  EXPECT_TRUE(outcomes[0].kind == ErrorKind::kMismatch || outcomes[1].kind == ErrorKind::kMismatch)
      << outcomes[0].message << " / " << outcomes[1].message;
}

}  // namespace
}  // namespace fsdp_ext::comm
