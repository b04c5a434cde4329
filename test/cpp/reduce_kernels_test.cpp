// Every reduce kernel for every dtype and op it supports, at awkward element
// counts, against a reference computed here element by element; fp16/bf16
// combine in float and round once per step (comm/half_precision.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "comm/data_type.h"
#include "comm/half_precision.h"
#include "comm/reduce_kernels.h"

namespace fsdp_ext::comm {
namespace {

constexpr size_t kCounts[] = {0, 1, 3, 8191};
constexpr DataType kTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                               DataType::kBFloat16, DataType::kInt8,    DataType::kUInt8,
                               DataType::kInt32,   DataType::kInt64,   DataType::kBool};
constexpr ReduceKind kKinds[] = {ReduceKind::kSum,    ReduceKind::kProduct, ReduceKind::kMin,
                                 ReduceKind::kMax,    ReduceKind::kBitAnd,  ReduceKind::kBitOr,
                                 ReduceKind::kBitXor};

// Element i of input `which` (0: the accumulator, 1: the contribution) as a
// double: small values of both signs, so products neither overflow nor
// underflow in any type.
double value_of(DataType type, size_t i, int which) {
  const int v = static_cast<int>((i * 7 + which * 3) % 5);
  switch (type) {
    case DataType::kBool:
      return (i + which) % 3 == 0 ? 1 : 0;
    case DataType::kUInt8:
      return v + which;
    case DataType::kFloat32:
    case DataType::kFloat64:
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return (v - 2) * 0.375 + which * 0.125;
    default:
      return v - 2;
  }
}

// Stores `value` as element i of a buffer of `type`.
void store(std::vector<uint8_t>& buffer, DataType type, size_t i, double value) {
  uint8_t* at = buffer.data() + i * element_size(type);
  switch (type) {
    case DataType::kFloat32: { float x = static_cast<float>(value); std::memcpy(at, &x, 4); break; }
    case DataType::kFloat64: std::memcpy(at, &value, 8); break;
    case DataType::kFloat16: {
      uint16_t x = float_to_half(static_cast<float>(value));
      std::memcpy(at, &x, 2);
      break;
    }
    case DataType::kBFloat16: {
      uint16_t x = float_to_bfloat16(static_cast<float>(value));
      std::memcpy(at, &x, 2);
      break;
    }
    case DataType::kInt8: { int8_t x = static_cast<int8_t>(value); std::memcpy(at, &x, 1); break; }
    case DataType::kUInt8: { uint8_t x = static_cast<uint8_t>(value); std::memcpy(at, &x, 1); break; }
    case DataType::kInt32: { int32_t x = static_cast<int32_t>(value); std::memcpy(at, &x, 4); break; }
    case DataType::kInt64: { int64_t x = static_cast<int64_t>(value); std::memcpy(at, &x, 8); break; }
    case DataType::kBool: { uint8_t x = value != 0; std::memcpy(at, &x, 1); break; }
  }
}

double load(const std::vector<uint8_t>& buffer, DataType type, size_t i) {
  const uint8_t* at = buffer.data() + i * element_size(type);
  switch (type) {
    case DataType::kFloat32: { float x; std::memcpy(&x, at, 4); return x; }
    case DataType::kFloat64: { double x; std::memcpy(&x, at, 8); return x; }
    case DataType::kFloat16: { uint16_t x; std::memcpy(&x, at, 2); return half_to_float(x); }
    case DataType::kBFloat16: { uint16_t x; std::memcpy(&x, at, 2); return bfloat16_to_float(x); }
    case DataType::kInt8: { int8_t x; std::memcpy(&x, at, 1); return x; }
    case DataType::kUInt8: { uint8_t x; std::memcpy(&x, at, 1); return x; }
    case DataType::kInt32: { int32_t x; std::memcpy(&x, at, 4); return x; }
    case DataType::kInt64: { int64_t x; std::memcpy(&x, at, 8); return static_cast<double>(x); }
    case DataType::kBool: { uint8_t x; std::memcpy(&x, at, 1); return x != 0; }
  }
  return 0;
}

// The result the kernel must give for one element, in the element's type:
// combined in the widest natural type, then stored (rounded) once.
double reference(DataType type, ReduceKind kind, double a, double b) {
  const bool floating = is_floating_point(type);
  switch (kind) {
    case ReduceKind::kSum:
      return type == DataType::kBool ? (a != 0 || b != 0) : a + b;
    case ReduceKind::kProduct:
      return type == DataType::kBool ? (a != 0 && b != 0) : a * b;
    case ReduceKind::kMin:
      return std::min(a, b);
    case ReduceKind::kMax:
      return std::max(a, b);
    default:
      break;
  }
  EXPECT_FALSE(floating);
  const int64_t x = static_cast<int64_t>(a), y = static_cast<int64_t>(b);
  if (kind == ReduceKind::kBitAnd) return static_cast<double>(x & y);
  if (kind == ReduceKind::kBitOr) return static_cast<double>(x | y);
  return static_cast<double>(x ^ y);
}

TEST(ReduceKernels, EveryTypeKindAndAwkwardCount) {
  int checked = 0;
  for (DataType type : kTypes) {
    for (ReduceKind kind : kKinds) {
      if (!is_reduction_supported(type, kind)) continue;
      for (size_t count : kCounts) {
        const std::string what = std::string(data_type_name(type)) + " " +
                                 reduce_kind_name(kind) + " n=" + std::to_string(count);
        std::vector<uint8_t> acc(count * element_size(type) + 1, 0xAB);
        std::vector<uint8_t> in(count * element_size(type) + 1, 0xCD);
        for (size_t i = 0; i < count; ++i) {
          store(acc, type, i, value_of(type, i, 0));
          store(in, type, i, value_of(type, i, 1));
        }
        std::vector<uint8_t> expected = acc;
        for (size_t i = 0; i < count; ++i) {
          store(expected, type, i, reference(type, kind, load(acc, type, i), load(in, type, i)));
        }
        reduce_into(acc.data(), in.data(), count, type, kind);
        ASSERT_EQ(acc, expected) << what;  // the byte past the end is untouched too
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(ReduceKernels, BitwiseOpsRejectedOnFloats) {
  for (DataType type : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                        DataType::kBFloat16}) {
    for (ReduceKind kind : {ReduceKind::kBitAnd, ReduceKind::kBitOr, ReduceKind::kBitXor}) {
      EXPECT_FALSE(is_reduction_supported(type, kind)) << data_type_name(type);
    }
    EXPECT_TRUE(is_reduction_supported(type, ReduceKind::kSum));
  }
}

TEST(ReduceKernels, HalfPrecisionRoundsOncePerStep) {
  // 1 + 2^-11 is not representable in fp16 (10 mantissa bits): each combine
  // rounds (to nearest even, back to 1), so adding it twice still gives 1,
  // where a float accumulator kept across steps would reach 1 + 2^-10.
  const uint16_t one = float_to_half(1.0f);
  const uint16_t tiny = float_to_half(std::ldexp(1.0f, -11));
  uint16_t acc = one;
  reduce_into(&acc, &tiny, 1, DataType::kFloat16, ReduceKind::kSum);
  reduce_into(&acc, &tiny, 1, DataType::kFloat16, ReduceKind::kSum);
  EXPECT_EQ(half_to_float(acc), 1.0f);
  // bf16 (7 mantissa bits): 1 + 2^-8 rounds to 1, 1 + 2^-7 is exact.
  uint16_t bacc = float_to_bfloat16(1.0f);
  const uint16_t bstep = float_to_bfloat16(std::ldexp(1.0f, -7));
  reduce_into(&bacc, &bstep, 1, DataType::kBFloat16, ReduceKind::kSum);
  EXPECT_EQ(bfloat16_to_float(bacc), 1.0f + std::ldexp(1.0f, -7));
}

TEST(ReduceKernels, ScaleInPlaceAndCopy) {
  for (DataType type : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                        DataType::kBFloat16}) {
    for (size_t count : kCounts) {
      std::vector<uint8_t> data(count * element_size(type) + 1, 0x11);
      for (size_t i = 0; i < count; ++i) store(data, type, i, value_of(type, i, 0));
      std::vector<uint8_t> expected = data;
      for (size_t i = 0; i < count; ++i) store(expected, type, i, load(data, type, i) * 0.25);
      std::vector<uint8_t> copy(data.size(), 0x11);
      scale_copy(copy.data(), data.data(), count, type, 0.25);
      scale_in_place(data.data(), count, type, 0.25);
      EXPECT_EQ(data, expected) << data_type_name(type) << " n=" << count;
      EXPECT_EQ(copy, expected) << data_type_name(type) << " n=" << count;
    }
  }
}

// AVG divides by the group size as torch's div_ does, not by multiplying
// with the reciprocal: for a group of 3 the two round differently, and a
// multiply would make AVG differ in the last bit from SUM followed by div_.
TEST(ReduceKernels, DivideInPlaceIsATrueDivision) {
  constexpr size_t kCount = 8191;
  std::vector<float> f32(kCount);
  std::vector<double> f64(kCount);
  std::vector<uint16_t> f16(kCount), bf16(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    f32[i] = 0.1f * static_cast<float>(i) - 7.3f;
    f64[i] = 0.1 * static_cast<double>(i) - 7.3;
    f16[i] = float_to_half(f32[i]);
    bf16[i] = float_to_bfloat16(f32[i]);
  }
  const std::vector<float> f32_in = f32;
  const std::vector<double> f64_in = f64;
  const std::vector<uint16_t> f16_in = f16, bf16_in = bf16;
  divide_in_place(f32.data(), kCount, DataType::kFloat32, 3.0);
  divide_in_place(f64.data(), kCount, DataType::kFloat64, 3.0);
  divide_in_place(f16.data(), kCount, DataType::kFloat16, 3.0);
  divide_in_place(bf16.data(), kCount, DataType::kBFloat16, 3.0);
  size_t reciprocal_differs = 0;
  for (size_t i = 0; i < kCount; ++i) {
    ASSERT_EQ(f32[i], f32_in[i] / 3.0f) << "float32 element " << i;
    ASSERT_EQ(f64[i], f64_in[i] / 3.0) << "float64 element " << i;
    ASSERT_EQ(f16[i], float_to_half(half_to_float(f16_in[i]) / 3.0f)) << "float16 element " << i;
    ASSERT_EQ(bf16[i], float_to_bfloat16(bfloat16_to_float(bf16_in[i]) / 3.0f))
        << "bfloat16 element " << i;
    if (f32_in[i] * (1.0f / 3.0f) != f32[i]) ++reciprocal_differs;
  }
  // The inputs include values where a multiply by 1/3 rounds differently,
  // so this test tells the two apart.
  EXPECT_GT(reciprocal_differs, 0u);
}

}  // namespace
}  // namespace fsdp_ext::comm
