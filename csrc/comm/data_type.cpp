#include "comm/data_type.h"

#include "comm/error.h"

namespace fsdp_ext::comm {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kTimeout: return "timeout";
    case ErrorKind::kTransport: return "transport error";
    case ErrorKind::kMismatch: return "size mismatch between ranks";
    case ErrorKind::kAborted: return "aborted";
    case ErrorKind::kBroken: return "group broken";
    case ErrorKind::kPeerLost: return "peer lost";
    case ErrorKind::kDevice: return "device error";
    case ErrorKind::kPeerFailed: return "peer failed";
    case ErrorKind::kPeerLeft: return "peer left";
  }
  return "unknown";
}

size_t element_size(DataType type) {
  switch (type) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kInt8: return 1;
    case DataType::kUInt8: return 1;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
    case DataType::kBool: return 1;
  }
  return 0;
}

const char* data_type_name(DataType type) {
  switch (type) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kBool: return "bool";
  }
  return "unknown";
}

const char* reduce_kind_name(ReduceKind kind) {
  switch (kind) {
    case ReduceKind::kSum: return "SUM";
    case ReduceKind::kProduct: return "PRODUCT";
    case ReduceKind::kMin: return "MIN";
    case ReduceKind::kMax: return "MAX";
    case ReduceKind::kBitAnd: return "BAND";
    case ReduceKind::kBitOr: return "BOR";
    case ReduceKind::kBitXor: return "BXOR";
  }
  return "unknown";
}

bool is_floating_point(DataType type) {
  return type == DataType::kFloat32 || type == DataType::kFloat64 ||
         type == DataType::kFloat16 || type == DataType::kBFloat16;
}

bool is_reduction_supported(DataType type, ReduceKind kind) {
  const bool bitwise = kind == ReduceKind::kBitAnd ||
                       kind == ReduceKind::kBitOr || kind == ReduceKind::kBitXor;
  return !(bitwise && is_floating_point(type));
}

}  // namespace fsdp_ext::comm
