#include "comm/reduce_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "comm/half_precision.h"

namespace fsdp_ext::comm {
namespace {

// Integer sums and products wrap like torch's do; doing them in the unsigned
// type keeps that well defined in C++.
template <typename T>
T wrapping_add(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
}
template <typename T>
T wrapping_mul(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
}

// NaN propagates through MIN/MAX as in torch.minimum / torch.maximum.
template <typename T>
T nan_min(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(a) || std::isnan(b)) return a + b;
  }
  return b < a ? b : a;
}
template <typename T>
T nan_max(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(a) || std::isnan(b)) return a + b;
  }
  return a < b ? b : a;
}

template <typename T, typename Combine>
void combine_native(T* __restrict acc, const T* __restrict in, size_t n,
                    Combine combine) {
  for (size_t i = 0; i < n; ++i) acc[i] = combine(acc[i], in[i]);
}

template <typename T>
void reduce_float(T* acc, const T* in, size_t n, ReduceKind kind) {
  switch (kind) {
    case ReduceKind::kSum:
      return combine_native(acc, in, n, [](T a, T b) { return a + b; });
    case ReduceKind::kProduct:
      return combine_native(acc, in, n, [](T a, T b) { return a * b; });
    case ReduceKind::kMin:
      return combine_native(acc, in, n, nan_min<T>);
    case ReduceKind::kMax:
      return combine_native(acc, in, n, nan_max<T>);
    default:
      return;  // bitwise ops on floats are rejected before dispatch
  }
}

template <typename T>
void reduce_integer(T* acc, const T* in, size_t n, ReduceKind kind) {
  switch (kind) {
    case ReduceKind::kSum:
      return combine_native(acc, in, n, wrapping_add<T>);
    case ReduceKind::kProduct:
      return combine_native(acc, in, n, wrapping_mul<T>);
    case ReduceKind::kMin:
      return combine_native(acc, in, n, nan_min<T>);
    case ReduceKind::kMax:
      return combine_native(acc, in, n, nan_max<T>);
    case ReduceKind::kBitAnd:
      return combine_native(acc, in, n, [](T a, T b) { return T(a & b); });
    case ReduceKind::kBitOr:
      return combine_native(acc, in, n, [](T a, T b) { return T(a | b); });
    case ReduceKind::kBitXor:
      return combine_native(acc, in, n, [](T a, T b) { return T(a ^ b); });
  }
}

// Bool follows torch's semantics on bool tensors: SUM/MAX are logical or,
// PRODUCT/MIN logical and. Inputs are 0/1 bytes, so bitwise ops stay 0/1.
void reduce_bool(uint8_t* acc, const uint8_t* in, size_t n, ReduceKind kind) {
  switch (kind) {
    case ReduceKind::kSum:
    case ReduceKind::kMax:
    case ReduceKind::kBitOr:
      return combine_native(acc, in, n,
                            [](uint8_t a, uint8_t b) { return uint8_t(a | b); });
    case ReduceKind::kProduct:
    case ReduceKind::kMin:
    case ReduceKind::kBitAnd:
      return combine_native(acc, in, n,
                            [](uint8_t a, uint8_t b) { return uint8_t(a & b); });
    case ReduceKind::kBitXor:
      return combine_native(acc, in, n,
                            [](uint8_t a, uint8_t b) { return uint8_t(a ^ b); });
  }
}

// Half types: widen a block to float, reduce there, round back once.
template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void reduce_half(uint16_t* acc, const uint16_t* in, size_t n, ReduceKind kind) {
  constexpr size_t kBlock = 256;
  float a[kBlock];
  float b[kBlock];
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t len = std::min(kBlock, n - start);
    for (size_t i = 0; i < len; ++i) {
      a[i] = ToFloat(acc[start + i]);
      b[i] = ToFloat(in[start + i]);
    }
    reduce_float<float>(a, b, len, kind);
    for (size_t i = 0; i < len; ++i) acc[start + i] = FromFloat(a[i]);
  }
}

template <typename T>
void scale_native(T* out, const T* in, size_t n, double factor) {
  const T f = static_cast<T>(factor);
  for (size_t i = 0; i < n; ++i) out[i] = in[i] * f;
}

template <typename T>
void divide_native(T* data, size_t n, double divisor) {
  const T d = static_cast<T>(divisor);
  for (size_t i = 0; i < n; ++i) data[i] = data[i] / d;
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void divide_half(uint16_t* data, size_t n, double divisor) {
  const float d = static_cast<float>(divisor);
  for (size_t i = 0; i < n; ++i) data[i] = FromFloat(ToFloat(data[i]) / d);
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void scale_half(uint16_t* out, const uint16_t* in, size_t n, double factor) {
  const float f = static_cast<float>(factor);
  for (size_t i = 0; i < n; ++i) out[i] = FromFloat(ToFloat(in[i]) * f);
}

}  // namespace

void reduce_into(void* accumulator, const void* contribution, size_t count,
                 DataType type, ReduceKind kind) {
  switch (type) {
    case DataType::kFloat32:
      return reduce_float(static_cast<float*>(accumulator),
                          static_cast<const float*>(contribution), count, kind);
    case DataType::kFloat64:
      return reduce_float(static_cast<double*>(accumulator),
                          static_cast<const double*>(contribution), count, kind);
    case DataType::kFloat16:
      return reduce_half<half_to_float, float_to_half>(
          static_cast<uint16_t*>(accumulator),
          static_cast<const uint16_t*>(contribution), count, kind);
    case DataType::kBFloat16:
      return reduce_half<bfloat16_to_float, float_to_bfloat16>(
          static_cast<uint16_t*>(accumulator),
          static_cast<const uint16_t*>(contribution), count, kind);
    case DataType::kInt8:
      return reduce_integer(static_cast<int8_t*>(accumulator),
                            static_cast<const int8_t*>(contribution), count, kind);
    case DataType::kUInt8:
      return reduce_integer(static_cast<uint8_t*>(accumulator),
                            static_cast<const uint8_t*>(contribution), count, kind);
    case DataType::kInt32:
      return reduce_integer(static_cast<int32_t*>(accumulator),
                            static_cast<const int32_t*>(contribution), count, kind);
    case DataType::kInt64:
      return reduce_integer(static_cast<int64_t*>(accumulator),
                            static_cast<const int64_t*>(contribution), count, kind);
    case DataType::kBool:
      return reduce_bool(static_cast<uint8_t*>(accumulator),
                         static_cast<const uint8_t*>(contribution), count, kind);
  }
}

void scale_copy(void* out, const void* in, size_t count, DataType type,
                double factor) {
  switch (type) {
    case DataType::kFloat32:
      return scale_native(static_cast<float*>(out), static_cast<const float*>(in),
                          count, factor);
    case DataType::kFloat64:
      return scale_native(static_cast<double*>(out),
                          static_cast<const double*>(in), count, factor);
    case DataType::kFloat16:
      return scale_half<half_to_float, float_to_half>(
          static_cast<uint16_t*>(out), static_cast<const uint16_t*>(in), count,
          factor);
    case DataType::kBFloat16:
      return scale_half<bfloat16_to_float, float_to_bfloat16>(
          static_cast<uint16_t*>(out), static_cast<const uint16_t*>(in), count,
          factor);
    default:
      return;  // integer scaling is rejected by the caller
  }
}

void divide_in_place(void* data, size_t count, DataType type, double divisor) {
  switch (type) {
    case DataType::kFloat32:
      return divide_native(static_cast<float*>(data), count, divisor);
    case DataType::kFloat64:
      return divide_native(static_cast<double*>(data), count, divisor);
    case DataType::kFloat16:
      return divide_half<half_to_float, float_to_half>(static_cast<uint16_t*>(data), count,
                                                       divisor);
    case DataType::kBFloat16:
      return divide_half<bfloat16_to_float, float_to_bfloat16>(static_cast<uint16_t*>(data),
                                                               count, divisor);
    default:
      return;  // integer averages are rejected by the caller
  }
}

void scale_in_place(void* data, size_t count, DataType type, double factor) {
  scale_copy(data, data, count, type, factor);
}

}  // namespace fsdp_ext::comm
