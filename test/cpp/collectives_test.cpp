// Every collective algorithm of the comm core, forced in turn, over groups of
// 1 to 5 ranks (threads over UCX loopback, shared memory on or off) and over
// pretend hosts (the hierarchical phases), at awkward sizes: 0, 1, 3 and 8191
// elements, byte counts that are not a multiple of the element size, counts
// that do not divide by the group size, and one large enough for the ring
// and the shared-memory paths' multi-block loops. Results are checked element
// by element against what every rank contributed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "comm/algorithms/algorithms.h"
#include "comm/error.h"
#include "loopback_group.h"

namespace fsdp_ext::comm {
namespace {

using testing::LoopbackGroup;
using testing::LoopbackOptions;
using testing::ScopedVariable;

// 0, 1, 3 and 8191 elements, and 300001 (1.2 MB of float32: above the ring
// threshold, many reduction blocks, not divisible by 2..5).
const std::vector<size_t> kCounts = {0, 1, 3, 8191, 300001};

// Small integers, so float sums over five ranks are exact.
float value(int rank, size_t index) {
  return static_cast<float>((static_cast<size_t>(rank) * 131 + index * 7) % 1009);
}
uint8_t byte_value(int rank, size_t index) { return static_cast<uint8_t>(rank * 37 + index * 11); }

// What a float sum over `ranks` ranks of value(rank, index) gives, in the
// order the algorithms add (exact here: small integers).
float sum_of_values(int ranks, size_t index) {
  float sum = 0;
  for (int rank = 0; rank < ranks; ++rank) sum += value(rank, index);
  return sum;
}

std::vector<float> filled(size_t count, int rank, size_t offset = 0) {
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = value(rank, offset + i);
  return out;
}

// The first index where `actual` differs from `expected(i)`, or -1: one
// failure message per buffer instead of one per element.
template <typename T, typename Expected>
long first_mismatch(const T* actual, size_t count, Expected expected) {
  for (size_t i = 0; i < count; ++i) {
    if (!(actual[i] == expected(i))) return static_cast<long>(i);
  }
  return -1;
}

struct Case {
  const char* algorithm;  // FSDP_EXT_*_ALGO value for all four collectives
  int ranks;
  int hosts;
  bool shared_memory;
};

// How ctest and failure messages show a case.
void PrintTo(const Case& c, std::ostream* out) {
  *out << c.algorithm << ", " << c.ranks << " ranks, " << c.hosts << " host(s), shared memory "
       << (c.shared_memory ? "on" : "off");
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.algorithm) + "_" + std::to_string(c.ranks) + "ranks" +
         (c.hosts > 1 ? "_" + std::to_string(c.hosts) + "hosts" : "") +
         (c.shared_memory ? "" : "_no_shm");
}

class ForcedAlgorithm : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const char* forced = GetParam().algorithm;
    for (const char* variable : {"FSDP_EXT_ALLGATHER_ALGO", "FSDP_EXT_REDUCE_SCATTER_ALGO",
                                 "FSDP_EXT_ALLREDUCE_ALGO", "FSDP_EXT_BROADCAST_ALGO"}) {
      variables_.push_back(std::make_unique<ScopedVariable>(variable, forced));
    }
    LoopbackOptions options;
    options.hosts = GetParam().hosts;
    options.shared_memory = GetParam().shared_memory;
    group_ = std::make_unique<LoopbackGroup>(GetParam().ranks, options);
  }
  void TearDown() override {
    group_.reset();
    variables_.clear();
  }

  std::vector<std::unique_ptr<ScopedVariable>> variables_;
  std::unique_ptr<LoopbackGroup> group_;
};

// One broadcast of `bytes` from `root`, every rank starting from its own
// values, checked on every rank.
void expect_broadcast(LoopbackGroup& group, size_t bytes, int root) {
  const int n = group.size();
  std::vector<std::vector<uint8_t>> data(n);
  for (int r = 0; r < n; ++r) {
    data[r].resize(bytes);
    for (size_t i = 0; i < bytes; ++i) data[r][i] = byte_value(r, i);
  }
  group.run_ok("broadcast", [&](int r, OpContext& context) {
    broadcast(context, MutableSpan{data[r].data(), bytes}, root);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(first_mismatch(data[r].data(), bytes, [&](size_t i) { return byte_value(root, i); }),
              -1)
        << "rank " << r << ", root " << root << ", " << bytes << " bytes";
  }
}

// One all-gather of `count` floats per rank, checked block by block.
void expect_allgather(LoopbackGroup& group, size_t count) {
  const int n = group.size();
  std::vector<std::vector<float>> inputs(n), outputs(n);
  for (int r = 0; r < n; ++r) {
    inputs[r] = filled(count, r);
    outputs[r].assign(count * n, -1.0f);
  }
  group.run_ok("allgather", [&](int r, OpContext& context) {
    std::vector<MutableSpan> blocks;
    for (int p = 0; p < n; ++p) {
      blocks.push_back(MutableSpan{outputs[r].data() + p * count, count * sizeof(float)});
    }
    allgather(context, ConstSpan{inputs[r].data(), count * sizeof(float)}, blocks);
  });
  for (int r = 0; r < n; ++r) {
    for (int p = 0; p < n; ++p) {
      EXPECT_EQ(first_mismatch(outputs[r].data() + p * count, count,
                               [&](size_t i) { return value(p, i); }),
                -1)
          << "rank " << r << ", block of rank " << p << ", " << count << " floats";
    }
  }
}

TEST_P(ForcedAlgorithm, Allgather) {
  for (size_t count : kCounts) expect_allgather(*group_, count);
  // Over pretend hosts each op ran as phases, each reserving a block of
  // sequence numbers; on one host each op took one.
  const uint64_t ops = kCounts.size();
  if (GetParam().hosts > 1) {
    EXPECT_GE(group_->engine(0).sequences_used(), ops * kSeqsPerPhase);
  } else {
    EXPECT_EQ(group_->engine(0).sequences_used(), ops);
  }
}

TEST_P(ForcedAlgorithm, AllgatherUnevenOddBytes) {
  // Rank r contributes 8191 + r bytes (odd, not a multiple of any element
  // size, different per rank), and the own block is gathered in place.
  LoopbackGroup& group = *group_;
  const int n = group.size();
  std::vector<size_t> bytes(n), offsets(n + 1, 0);
  for (int r = 0; r < n; ++r) {
    bytes[r] = 8191 + r;
    offsets[r + 1] = offsets[r] + bytes[r];
  }
  std::vector<std::vector<uint8_t>> outputs(n, std::vector<uint8_t>(offsets[n], 0));
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < bytes[r]; ++i) outputs[r][offsets[r] + i] = byte_value(r, i);
  }
  group.run_ok("allgather uneven", [&](int r, OpContext& context) {
    std::vector<MutableSpan> blocks;
    for (int p = 0; p < n; ++p) blocks.push_back({outputs[r].data() + offsets[p], bytes[p]});
    allgather(context, ConstSpan{outputs[r].data() + offsets[r], bytes[r]}, blocks);
  });
  for (int r = 0; r < n; ++r) {
    for (int p = 0; p < n; ++p) {
      EXPECT_EQ(first_mismatch(outputs[r].data() + offsets[p], bytes[p],
                               [&](size_t i) { return byte_value(p, i); }),
                -1)
          << "rank " << r << ", block of rank " << p;
    }
  }
}

TEST_P(ForcedAlgorithm, ReduceScatterSum) {
  LoopbackGroup& group = *group_;
  const int n = group.size();
  for (size_t count : kCounts) {
    // Rank r's input for rank d is value(r, d * count + i).
    std::vector<std::vector<float>> inputs(n), outputs(n);
    for (int r = 0; r < n; ++r) {
      inputs[r] = filled(count * n, r);
      outputs[r].assign(count, -1.0f);
    }
    group.run_ok("reduce_scatter", [&](int r, OpContext& context) {
      std::vector<ConstSpan> blocks;
      for (int d = 0; d < n; ++d) {
        blocks.push_back(ConstSpan{inputs[r].data() + d * count, count * sizeof(float)});
      }
      reduce_scatter(context, blocks, MutableSpan{outputs[r].data(), count * sizeof(float)},
                     ReduceSpec{DataType::kFloat32, ReduceKind::kSum});
    });
    for (int d = 0; d < n; ++d) {
      EXPECT_EQ(first_mismatch(outputs[d].data(), count,
                               [&](size_t i) { return sum_of_values(n, d * count + i); }),
                -1)
          << "rank " << d << ", " << count << " floats";
    }
  }
}

TEST_P(ForcedAlgorithm, ReduceScatterAverageInt64Uneven) {
  // Rank d's block holds 3 + d elements; AVG is a sum divided by n after.
  LoopbackGroup& group = *group_;
  const int n = group.size();
  std::vector<std::vector<std::vector<double>>> inputs(n, std::vector<std::vector<double>>(n));
  std::vector<std::vector<double>> outputs(n);
  for (int r = 0; r < n; ++r) {
    for (int d = 0; d < n; ++d) {
      for (int i = 0; i < 3 + d; ++i) inputs[r][d].push_back(value(r, d * 10 + i));
    }
    outputs[r].assign(3 + r, -1.0);
  }
  group.run_ok("reduce_scatter avg", [&](int r, OpContext& context) {
    std::vector<ConstSpan> blocks;
    for (int d = 0; d < n; ++d) {
      blocks.push_back(ConstSpan{inputs[r][d].data(), inputs[r][d].size() * sizeof(double)});
    }
    ReduceSpec spec{DataType::kFloat64, ReduceKind::kSum};
    spec.post_divisor = n;
    reduce_scatter(context, blocks,
                   MutableSpan{outputs[r].data(), outputs[r].size() * sizeof(double)}, spec);
  });
  for (int d = 0; d < n; ++d) {
    for (int i = 0; i < 3 + d; ++i) {
      double sum = 0;
      for (int r = 0; r < n; ++r) sum += value(r, d * 10 + i);
      EXPECT_EQ(outputs[d][i], sum / n) << "rank " << d << ", element " << i;
    }
  }
}

// A float32 sum all-reduce of `count` elements on every rank, checked.
void expect_allreduce_sum(LoopbackGroup& group, size_t count) {
  const int n = group.size();
  std::vector<std::vector<float>> data(n);
  for (int r = 0; r < n; ++r) data[r] = filled(count, r);
  group.run_ok("allreduce", [&](int r, OpContext& context) {
    allreduce(context, MutableSpan{data[r].data(), count * sizeof(float)},
              ReduceSpec{DataType::kFloat32, ReduceKind::kSum});
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(first_mismatch(data[r].data(), count,
                             [&](size_t i) { return sum_of_values(n, i); }),
              -1)
        << "rank " << r << ", " << count << " floats";
  }
}

TEST_P(ForcedAlgorithm, AllreduceSum) {
  for (size_t count : kCounts) expect_allreduce_sum(*group_, count);
}

TEST_P(ForcedAlgorithm, AllreduceOfLargeOrdinaryBuffers) {
  // Blocks of 1 MiB and more in ordinary memory: on the shared-memory path
  // peers read them as process memory, a chunk at a time, into the
  // reduction (the count is not a multiple of the chunk or of the group).
  LoopbackGroup& group = *group_;
  const int n = group.size();
  expect_allreduce_sum(group, (size_t{5} << 20) / sizeof(float) * n + 3);
  const Case& c = GetParam();
  if (c.hosts == 1 && c.shared_memory && n > 1 &&
      (std::string(c.algorithm) == "shm" || std::string(c.algorithm) == "auto")) {
    EXPECT_GT(group.domain(0).pieces_offered_for_process_reads(), 0u);
  }
}

TEST_P(ForcedAlgorithm, AllreduceMaxInt32AndPremulSum) {
  LoopbackGroup& group = *group_;
  const int n = group.size();
  const size_t count = 8191;
  std::vector<std::vector<int32_t>> ints(n, std::vector<int32_t>(count));
  std::vector<std::vector<double>> doubles(n, std::vector<double>(count));
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) {
      ints[r][i] = static_cast<int32_t>(value(r, i)) - 500;
      doubles[r][i] = value(r, i);
    }
  }
  group.run_ok("allreduce max", [&](int r, OpContext& context) {
    allreduce(context, MutableSpan{ints[r].data(), count * sizeof(int32_t)},
              ReduceSpec{DataType::kInt32, ReduceKind::kMax});
  });
  group.run_ok("allreduce premul_sum", [&](int r, OpContext& context) {
    ReduceSpec spec{DataType::kFloat64, ReduceKind::kSum};
    spec.pre_scale = 0.5;
    allreduce(context, MutableSpan{doubles[r].data(), count * sizeof(double)}, spec);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(first_mismatch(ints[r].data(), count,
                             [&](size_t i) {
                               int32_t best = INT32_MIN;
                               for (int p = 0; p < n; ++p) {
                                 best = std::max(best, static_cast<int32_t>(value(p, i)) - 500);
                               }
                               return best;
                             }),
              -1)
        << "max on rank " << r;
    EXPECT_EQ(first_mismatch(doubles[r].data(), count,
                             [&](size_t i) {
                               double sum = 0;
                               for (int p = 0; p < n; ++p) sum += 0.5 * value(p, i);
                               return sum;
                             }),
              -1)
        << "premul_sum on rank " << r;
  }
}

TEST_P(ForcedAlgorithm, BroadcastFromEveryRoot) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{3}, size_t{8191}, size_t{1200003}}) {
    for (int root = 0; root < group_->size(); ++root) expect_broadcast(*group_, bytes, root);
  }
}

TEST_P(ForcedAlgorithm, BucketsOfMixedSizesAndTypes) {
  // One op per collective carrying several members of different sizes and
  // dtypes, some empty, as coalesced (foreach) collectives do.
  LoopbackGroup& group = *group_;
  const int n = group.size();
  const std::vector<size_t> floats = {3, 0, 8191, 1};

  // All-gather: float members, then one odd-sized byte member.
  std::vector<std::vector<std::vector<float>>> gathered(n);
  std::vector<std::vector<uint8_t>> gathered_bytes(n, std::vector<uint8_t>(n * 5, 0));
  std::vector<std::vector<std::vector<float>>> gather_inputs(n);
  std::vector<std::vector<uint8_t>> byte_inputs(n);
  for (int r = 0; r < n; ++r) {
    for (size_t m = 0; m < floats.size(); ++m) {
      gather_inputs[r].push_back(filled(floats[m], r, m * 100));
      gathered[r].push_back(std::vector<float>(floats[m] * n, -1.0f));
    }
    for (size_t i = 0; i < 5; ++i) byte_inputs[r].push_back(byte_value(r, i));
  }
  group.run_ok("allgather bucket", [&](int r, OpContext& context) {
    std::vector<AllgatherMember> bucket;
    for (size_t m = 0; m < floats.size(); ++m) {
      AllgatherMember member;
      member.input = {gather_inputs[r][m].data(), floats[m] * sizeof(float)};
      for (int p = 0; p < n; ++p) {
        member.outputs.push_back({gathered[r][m].data() + p * floats[m], floats[m] * sizeof(float)});
      }
      bucket.push_back(member);
    }
    AllgatherMember bytes_member;
    bytes_member.input = {byte_inputs[r].data(), 5};
    for (int p = 0; p < n; ++p) bytes_member.outputs.push_back({gathered_bytes[r].data() + p * 5, 5});
    bucket.push_back(bytes_member);
    allgather(context, bucket);
  });

  // Reduce-scatter: a float32 sum member and an int64 min member.
  std::vector<std::vector<float>> rs_float_in(n), rs_float_out(n, std::vector<float>(7, -1));
  std::vector<std::vector<int64_t>> rs_int_in(n), rs_int_out(n, std::vector<int64_t>(2, -1));
  for (int r = 0; r < n; ++r) {
    rs_float_in[r] = filled(7 * n, r);
    for (int i = 0; i < 2 * n; ++i) rs_int_in[r].push_back(static_cast<int64_t>(value(r, i)));
  }
  group.run_ok("reduce_scatter bucket", [&](int r, OpContext& context) {
    ReduceScatterMember sum_member, min_member;
    for (int d = 0; d < n; ++d) {
      sum_member.inputs.push_back({rs_float_in[r].data() + d * 7, 7 * sizeof(float)});
      min_member.inputs.push_back({rs_int_in[r].data() + d * 2, 2 * sizeof(int64_t)});
    }
    sum_member.output = {rs_float_out[r].data(), 7 * sizeof(float)};
    sum_member.spec = {DataType::kFloat32, ReduceKind::kSum};
    min_member.output = {rs_int_out[r].data(), 2 * sizeof(int64_t)};
    min_member.spec = {DataType::kInt64, ReduceKind::kMin};
    reduce_scatter(context, {sum_member, min_member});
  });

  // All-reduce: float32 sum (8191), int32 bitwise or (1), float64 (0).
  std::vector<std::vector<float>> ar_float(n);
  std::vector<std::vector<int32_t>> ar_bits(n);
  std::vector<std::vector<double>> ar_empty(n);
  for (int r = 0; r < n; ++r) {
    ar_float[r] = filled(8191, r);
    ar_bits[r] = {1 << r};
  }
  group.run_ok("allreduce bucket", [&](int r, OpContext& context) {
    allreduce(context,
              {AllreduceMember{{ar_float[r].data(), 8191 * sizeof(float)},
                               {DataType::kFloat32, ReduceKind::kSum}},
               AllreduceMember{{ar_bits[r].data(), sizeof(int32_t)},
                               {DataType::kInt32, ReduceKind::kBitOr}},
               AllreduceMember{{ar_empty[r].data(), 0}, {DataType::kFloat64, ReduceKind::kSum}}});
  });

  for (int r = 0; r < n; ++r) {
    for (size_t m = 0; m < floats.size(); ++m) {
      for (int p = 0; p < n; ++p) {
        EXPECT_EQ(first_mismatch(gathered[r][m].data() + p * floats[m], floats[m],
                                 [&](size_t i) { return value(p, m * 100 + i); }),
                  -1)
            << "allgather member " << m << " on rank " << r << " from " << p;
      }
    }
    for (int p = 0; p < n; ++p) {
      EXPECT_EQ(first_mismatch(gathered_bytes[r].data() + p * 5, 5,
                               [&](size_t i) { return byte_value(p, i); }),
                -1)
          << "allgather byte member on rank " << r << " from " << p;
    }
    EXPECT_EQ(first_mismatch(rs_float_out[r].data(), 7,
                             [&](size_t i) { return sum_of_values(n, r * 7 + i); }),
              -1)
        << "reduce_scatter sum member on rank " << r;
    EXPECT_EQ(first_mismatch(rs_int_out[r].data(), 2,
                             [&](size_t i) {
                               int64_t least = INT64_MAX;
                               for (int p = 0; p < n; ++p) {
                                 least = std::min(least, static_cast<int64_t>(value(p, r * 2 + i)));
                               }
                               return least;
                             }),
              -1)
        << "reduce_scatter min member on rank " << r;
    EXPECT_EQ(first_mismatch(ar_float[r].data(), 8191,
                             [&](size_t i) { return sum_of_values(n, i); }),
              -1)
        << "allreduce sum member on rank " << r;
    EXPECT_EQ(ar_bits[r][0], (1 << n) - 1) << "allreduce bitor member on rank " << r;
  }
}

TEST_P(ForcedAlgorithm, BuffersFromThePool) {
  // Buffers from the group's pool are offered to peers in place on the
  // shared-memory path; results must not depend on where the memory is.
  LoopbackGroup& group = *group_;
  const int n = group.size();
  const size_t count = 70001;  // above the shared-memory threshold
  std::vector<float*> inputs(n), outputs(n), reduced(n);
  for (int r = 0; r < n; ++r) {
    inputs[r] = static_cast<float*>(group.pool(r).allocate(count * sizeof(float)));
    outputs[r] = static_cast<float*>(group.pool(r).allocate(count * n * sizeof(float)));
    reduced[r] = static_cast<float*>(group.pool(r).allocate(count * sizeof(float)));
    for (size_t i = 0; i < count; ++i) inputs[r][i] = reduced[r][i] = value(r, i);
  }
  group.run_ok("allgather from pool", [&](int r, OpContext& context) {
    std::vector<MutableSpan> blocks;
    for (int p = 0; p < n; ++p) blocks.push_back({outputs[r] + p * count, count * sizeof(float)});
    allgather(context, ConstSpan{inputs[r], count * sizeof(float)}, blocks);
  });
  group.run_ok("allreduce in pool", [&](int r, OpContext& context) {
    allreduce(context, MutableSpan{reduced[r], count * sizeof(float)},
              ReduceSpec{DataType::kFloat32, ReduceKind::kSum});
  });
  for (int r = 0; r < n; ++r) {
    for (int p = 0; p < n; ++p) {
      EXPECT_EQ(first_mismatch(outputs[r] + p * count, count,
                               [&](size_t i) { return value(p, i); }),
                -1)
          << "rank " << r << " block " << p;
    }
    EXPECT_EQ(first_mismatch(reduced[r], count,
                             [&](size_t i) { return sum_of_values(n, i); }),
              -1)
        << "rank " << r;
  }
  const Case& c = GetParam();
  const bool shm_path = c.shared_memory && n > 1 &&
                        (std::string(c.algorithm) == "shm" || std::string(c.algorithm) == "auto");
  if (shm_path) {
    // The shared-memory path offered these buffers in place, not staged.
    EXPECT_GT(group.domain(0).pieces_offered_in_place(), 0u);
  }
  for (int r = 0; r < n; ++r) {
    group.pool(r).release(inputs[r]);
    group.pool(r).release(outputs[r]);
    group.pool(r).release(reduced[r]);
  }
}

// Groups of two ranks or more: a single rank has no peer to disagree with.
class MismatchedSizes : public ForcedAlgorithm {};

TEST_P(MismatchedSizes, FailEveryRankWithoutHanging) {
  // Rank 0 contributes one element more than the others: no rank may hang
  // or read past a buffer; at least one reports the mismatch, the others
  // fail by the (short) timeout at the latest.
  LoopbackGroup& group = *group_;
  const int n = group.size();
  std::vector<std::vector<float>> data(n, std::vector<float>(40000, 1.0f));
  const auto outcomes = group.run(
      "allreduce mismatched",
      [&](int r, OpContext& context) {
        const size_t count = r == 0 ? 40000 : 39999;
        allreduce(context, MutableSpan{data[r].data(), count * sizeof(float)},
                  ReduceSpec{DataType::kFloat32, ReduceKind::kSum});
      },
      std::chrono::milliseconds(1000));
  int mismatches = 0;
  for (const OpOutcome& outcome : outcomes) {
    if (!outcome.ok && outcome.kind == ErrorKind::kMismatch) ++mismatches;
    if (!outcome.ok) {
      EXPECT_NE(outcome.message.find("allreduce mismatched"), std::string::npos)
          << outcome.message;
    }
  }
  EXPECT_GE(mismatches, 1);
}

// Note [pipelined hierarchical phases]: buckets cut into 1 MiB pieces whose
// phases overlap, over 2 and 3 pretend hosts. Blocks just past two pieces
// (a last piece of one element), three pieces and three elements, and a
// bucket of a float member and a double member, each cut at its own piece
// boundaries. Each op must have gone pipelined: one sequence-number block for the
// column and one per piece, instead of two blocks in all.
class PipelinedPhases : public ::testing::TestWithParam<std::pair<int, int>> {
 protected:
  void SetUp() override {
    LoopbackOptions options;
    options.hosts = GetParam().second;
    group_ = std::make_unique<LoopbackGroup>(GetParam().first, options);
  }
  // Expects the op `name` that ran between `before` and now to have used
  // at least `pieces` + 1 phases' sequence numbers.
  void expect_pipelined(const char* name, uint64_t before, size_t pieces) {
    EXPECT_GE(group_->engine(0).sequences_used() - before, (pieces + 1) * kSeqsPerPhase)
        << name << " did not run pipelined";
  }
  std::unique_ptr<LoopbackGroup> group_;
};

constexpr size_t kFloatsPerPiece = (size_t{1} << 20) / sizeof(float);
const std::vector<size_t> kPipelinedCounts = {2 * kFloatsPerPiece + 1, 3 * kFloatsPerPiece + 3};

TEST_P(PipelinedPhases, AllgatherReduceScatterAndAverage) {
  LoopbackGroup& group = *group_;
  const int n = group.size();
  for (size_t count : kPipelinedCounts) {
    const size_t pieces = (count + kFloatsPerPiece - 1) / kFloatsPerPiece;
    std::vector<std::vector<float>> full(n), summed(n), averaged(n);
    for (int r = 0; r < n; ++r) {
      full[r] = filled(count * n, r);
      summed[r].assign(count, -1.0f);
      averaged[r].assign(count, -1.0f);
    }
    uint64_t before = group.engine(0).sequences_used();
    expect_allgather(group, count);
    expect_pipelined("allgather", before, pieces);
    for (const bool average : {false, true}) {
      before = group.engine(0).sequences_used();
      group.run_ok("reduce_scatter", [&](int r, OpContext& context) {
        std::vector<ConstSpan> blocks;
        for (int p = 0; p < n; ++p) {
          blocks.push_back(ConstSpan{full[r].data() + p * count, count * sizeof(float)});
        }
        ReduceSpec spec{DataType::kFloat32, ReduceKind::kSum};
        if (average) spec.post_divisor = n;
        reduce_scatter(context, blocks,
                       MutableSpan{(average ? averaged : summed)[r].data(), count * sizeof(float)},
                       spec);
      });
      expect_pipelined("reduce_scatter", before, pieces);
    }
    for (int r = 0; r < n; ++r) {
      const size_t offset = static_cast<size_t>(r) * count;
      EXPECT_EQ(first_mismatch(summed[r].data(), count,
                               [&](size_t i) { return sum_of_values(n, offset + i); }),
                -1)
          << "reduce_scatter sum: rank " << r << ", " << count << " floats";
      // The sums are exact, so the true division gives the same bits
      // whatever the order of the additions.
      EXPECT_EQ(first_mismatch(averaged[r].data(), count,
                               [&](size_t i) {
                                 return sum_of_values(n, offset + i) / static_cast<float>(n);
                               }),
                -1)
          << "reduce_scatter average: rank " << r << ", " << count << " floats";
    }
  }
}

TEST_P(PipelinedPhases, AllreduceSumAndAverage) {
  LoopbackGroup& group = *group_;
  const int n = group.size();
  for (size_t count : kPipelinedCounts) {
    for (const bool average : {false, true}) {
      std::vector<std::vector<float>> data(n);
      for (int r = 0; r < n; ++r) data[r] = filled(count, r);
      const uint64_t before = group.engine(0).sequences_used();
      group.run_ok("allreduce", [&](int r, OpContext& context) {
        ReduceSpec spec{DataType::kFloat32, ReduceKind::kSum};
        if (average) spec.post_divisor = n;
        allreduce(context, MutableSpan{data[r].data(), count * sizeof(float)}, spec);
      });
      // Pipelined over two hosts only (more hosts keep the column ring).
      if (GetParam().second == 2) {
        expect_pipelined("allreduce", before, (count + kFloatsPerPiece - 1) / kFloatsPerPiece);
      }
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(first_mismatch(data[r].data(), count,
                                 [&](size_t i) {
                                   const float sum = sum_of_values(n, i);
                                   return average ? sum / static_cast<float>(n) : sum;
                                 }),
                  -1)
            << "allreduce " << (average ? "average" : "sum") << ": rank " << r << ", " << count
            << " floats";
      }
    }
  }
}

TEST_P(PipelinedPhases, BucketOfMixedMembers) {
  LoopbackGroup& group = *group_;
  const int n = group.size();
  const size_t floats = 300001, doubles = 300003;  // 1.2 MB and 2.4 MB per block
  std::vector<std::vector<float>> small(n), small_out(n);
  std::vector<std::vector<double>> large(n), large_out(n);
  for (int r = 0; r < n; ++r) {
    small[r] = filled(floats * n, r);
    large[r].resize(doubles * n);
    for (size_t i = 0; i < large[r].size(); ++i) large[r][i] = value(r, i);
    small_out[r].assign(floats, -1.0f);
    large_out[r].assign(doubles, -1.0);
  }
  const uint64_t before = group.engine(0).sequences_used();
  group.run_ok("reduce_scatter bucket", [&](int r, OpContext& context) {
    std::vector<ReduceScatterMember> bucket(2);
    for (int p = 0; p < n; ++p) {
      bucket[0].inputs.push_back(ConstSpan{small[r].data() + p * floats, floats * sizeof(float)});
      bucket[1].inputs.push_back(
          ConstSpan{large[r].data() + p * doubles, doubles * sizeof(double)});
    }
    bucket[0].output = MutableSpan{small_out[r].data(), floats * sizeof(float)};
    bucket[1].output = MutableSpan{large_out[r].data(), doubles * sizeof(double)};
    bucket[0].spec = ReduceSpec{DataType::kFloat32, ReduceKind::kSum};
    bucket[1].spec = ReduceSpec{DataType::kFloat64, ReduceKind::kSum};
    reduce_scatter(context, bucket);
  });
  expect_pipelined("reduce_scatter bucket", before, 5);  // 2 + 3 pieces
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(first_mismatch(small_out[r].data(), floats,
                             [&](size_t i) { return sum_of_values(n, r * floats + i); }),
              -1)
        << "float member, rank " << r;
    EXPECT_EQ(first_mismatch(large_out[r].data(), doubles,
                             [&](size_t i) {
                               return static_cast<double>(sum_of_values(n, r * doubles + i));
                             }),
              -1)
        << "double member, rank " << r;
  }
}

TEST_P(PipelinedPhases, BroadcastFromRootsOnEachHost) {
  LoopbackGroup& group = *group_;
  const int n = group.size();
  const size_t bytes = (size_t{2} << 20) + 5;  // three pieces, the last of 5 bytes
  for (int root : {n - 1, 1}) {
    const uint64_t before = group.engine(0).sequences_used();
    expect_broadcast(group, bytes, root);
    expect_pipelined("broadcast", before, 3);
  }
}

INSTANTIATE_TEST_SUITE_P(PretendHosts, PipelinedPhases,
                         ::testing::Values(std::make_pair(4, 2), std::make_pair(6, 3)),
                         [](const auto& info) {
                           return "pipelined_" + std::to_string(info.param.first) + "ranks_" +
                                  std::to_string(info.param.second) + "hosts";
                         });

// Hosts with different numbers of ranks (3 + 1 and 1 + 3). A broadcast whose
// other hosts hold several ranks goes through one
// leader per host (two phases, each reserving a block of sequence numbers);
// one whose other hosts hold a rank each stays flat (one sequence number),
// which sends the same bytes across hosts. The other collectives stay flat.
TEST(UnequalHosts, BroadcastGoesThroughALeaderPerHost) {
  for (const std::vector<int>& sizes : {std::vector<int>{3, 1}, std::vector<int>{1, 3}}) {
    LoopbackOptions options;
    options.host_sizes = sizes;
    options.name = "unequal hosts";
    LoopbackGroup group(4, options);
    const int n = group.size();
    std::vector<int> host_of;
    for (int h = 0; h < static_cast<int>(sizes.size()); ++h) {
      host_of.insert(host_of.end(), sizes[h], h);
    }
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{3}, size_t{8191}, (size_t{2} << 20) + 5}) {
      for (int root = 0; root < n; ++root) {
        bool through_leaders = false;
        for (int h = 0; h < static_cast<int>(sizes.size()); ++h) {
          if (h != host_of[root] && sizes[h] > 1) through_leaders = true;
        }
        SCOPED_TRACE("hosts " + std::to_string(sizes[0]) + "+" + std::to_string(sizes[1]));
        const uint64_t before = group.engine(0).sequences_used();
        expect_broadcast(group, bytes, root);
        const uint64_t used = group.engine(0).sequences_used() - before;
        if (through_leaders) {
          EXPECT_GE(used, 2 * kSeqsPerPhase) << "root " << root << ": two phases expected";
        } else {
          EXPECT_EQ(used, 1u) << "root " << root << ": flat expected";
        }
      }
    }
    expect_allgather(group, 8191);
  }
}

// Note [an endpoint on first use]: a rank holds endpoints only to the ranks
// its algorithms sent to. Over two pretend hosts of four ranks, every
// collective crosses hosts only between ranks of the same position (the
// column phase); within a host the shared-memory protocol's small header
// and done messages go to every peer of the host. So of the four ranks on
// the other host, only one gets an endpoint. A ring without shared memory
// sends to the next rank only.
TEST(Endpoints, OnlyToTheRanksAnAlgorithmSendsTo) {
  LoopbackOptions options;
  options.hosts = 2;
  LoopbackGroup two_hosts(8, options);
  expect_allgather(two_hosts, 8191);
  expect_allreduce_sum(two_hosts, (size_t{1} << 20) + 3);
  expect_broadcast(two_hosts, 3, 6);
  two_hosts.run_ok("endpoints", [&](int r, OpContext& context) {
    std::vector<int> expected;
    for (int peer = r / 4 * 4; peer < r / 4 * 4 + 4; ++peer) {
      if (peer != r) expected.push_back(peer);
    }
    expected.push_back((r + 4) % 8);  // the column peer on the other host
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(context.connected_peers(), expected) << "rank " << r;
  });

  ScopedVariable ring("FSDP_EXT_ALLGATHER_ALGO", "ring");
  LoopbackOptions flat;
  flat.shared_memory = false;
  LoopbackGroup one_host(5, flat);
  expect_allgather(one_host, 8191);
  one_host.run_ok("endpoints", [&](int r, OpContext& context) {
    EXPECT_EQ(context.connected_peers(), std::vector<int>{(r + 1) % 5}) << "rank " << r;
  });
}

// Whether a context's ranks span hosts: the whole group over two pretend
// hosts, a column of it, not a host's phase, not a group on one host.
TEST(HostLayout, SpansHostsForGroupsAndTheirPhases) {
  LoopbackOptions options;
  options.hosts = 2;
  LoopbackGroup two_hosts(4, options);
  two_hosts.run_ok("layout", [&](int r, OpContext& context) {
    EXPECT_TRUE(context.spans_hosts()) << "rank " << r;
    OpContext host = context.sub_group(r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3},
                                       nullptr);
    EXPECT_FALSE(host.spans_hosts()) << "rank " << r;
    OpContext column = context.sub_group({r % 2, r % 2 + 2}, nullptr);
    EXPECT_TRUE(column.spans_hosts()) << "rank " << r;
  });
  LoopbackGroup one_host(2);
  one_host.run_ok("layout", [&](int r, OpContext& context) {
    EXPECT_FALSE(context.spans_hosts()) << "rank " << r;
  });
}

std::vector<Case> flat_cases() {
  std::vector<Case> cases;
  for (const char* algorithm : {"auto", "direct", "ring", "shm"}) {
    for (int ranks = 1; ranks <= 5; ++ranks) cases.push_back({algorithm, ranks, 1, true});
  }
  for (int ranks = 1; ranks <= 5; ++ranks) cases.push_back({"auto", ranks, 1, false});
  return cases;
}

std::vector<Case> hierarchical_cases() {
  std::vector<Case> cases;
  for (const char* algorithm : {"auto", "direct", "ring", "shm"}) {
    cases.push_back({algorithm, 4, 2, true});
    cases.push_back({algorithm, 6, 2, true});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(OneHost, ForcedAlgorithm, ::testing::ValuesIn(flat_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(PretendHosts, ForcedAlgorithm, ::testing::ValuesIn(hierarchical_cases()),
                         case_name);

std::vector<Case> with_peers(std::vector<Case> cases) {
  std::erase_if(cases, [](const Case& c) { return c.ranks < 2; });
  return cases;
}
INSTANTIATE_TEST_SUITE_P(OneHost, MismatchedSizes, ::testing::ValuesIn(with_peers(flat_cases())),
                         case_name);
INSTANTIATE_TEST_SUITE_P(PretendHosts, MismatchedSizes,
                         ::testing::ValuesIn(hierarchical_cases()), case_name);

}  // namespace
}  // namespace fsdp_ext::comm
