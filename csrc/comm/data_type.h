// Element types and reduction kinds the communication core understands.
// They mirror the torch dtypes / c10d reduce ops the backend accepts, without
// depending on torch headers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fsdp_ext::comm {

enum class DataType : uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt8,
  kUInt8,
  kInt32,
  kInt64,
  kBool,
};

enum class ReduceKind : uint8_t {
  kSum,
  kProduct,
  kMin,
  kMax,
  kBitAnd,
  kBitOr,
  kBitXor,
};

size_t element_size(DataType type);
const char* data_type_name(DataType type);
const char* reduce_kind_name(ReduceKind kind);
bool is_floating_point(DataType type);

// Bitwise reductions are defined on integer and bool types only.
bool is_reduction_supported(DataType type, ReduceKind kind);

}  // namespace fsdp_ext::comm
