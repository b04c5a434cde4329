#include "backend/type_mapping.hpp"

#include <c10/util/Exception.h>

#include <cstring>

#include "torch_compat.hpp"

namespace fsdp_ext::backend {

comm::CollectiveKind collective_kind_of(const char* op) {
  using comm::CollectiveKind;
  struct Entry {
    const char* op;
    CollectiveKind kind;
  };
  static constexpr Entry kKinds[] = {
      {"all_reduce", CollectiveKind::kAllReduce},
      {"all_reduce_coalesced", CollectiveKind::kAllReduceCoalesced},
      {"all_gather", CollectiveKind::kAllGather},
      {"all_gather_into_tensor", CollectiveKind::kAllGather},
      {"all_gather_coalesced", CollectiveKind::kAllGatherCoalesced},
      {"all_gather_into_tensor_coalesced", CollectiveKind::kAllGatherCoalesced},
      {"reduce_scatter", CollectiveKind::kReduceScatter},
      {"reduce_scatter_tensor", CollectiveKind::kReduceScatter},
      {"reduce_scatter_tensor_coalesced", CollectiveKind::kReduceScatterCoalesced},
      {"broadcast", CollectiveKind::kBroadcast},
      {"reduce", CollectiveKind::kReduce},
      {"gather", CollectiveKind::kGather},
      {"scatter", CollectiveKind::kScatter},
      {"all_to_all", CollectiveKind::kAllToAll},
      {"all_to_all_single", CollectiveKind::kAllToAll},
      {"barrier", CollectiveKind::kBarrier},
      {"coalesced", CollectiveKind::kCoalescedBatch},
  };
  for (const Entry& entry : kKinds) {
    if (std::strcmp(entry.op, op) == 0) return entry.kind;
  }
  return CollectiveKind::kUnnamed;
}

std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(type);
  }
}

comm::DataType reduction_dtype(const OpLabel& label, at::ScalarType type) {
  switch (type) {
    case at::kFloat: return comm::DataType::kFloat32;
    case at::kDouble: return comm::DataType::kFloat64;
    case at::kHalf: return comm::DataType::kFloat16;
    case at::kBFloat16: return comm::DataType::kBFloat16;
    case at::kChar: return comm::DataType::kInt8;
    case at::kByte: return comm::DataType::kUInt8;
    case at::kInt: return comm::DataType::kInt32;
    case at::kLong: return comm::DataType::kInt64;
    case at::kBool: return comm::DataType::kBool;
    default:
      TORCH_CHECK_TYPE(false, label.prefix(), "reductions on dtype ", dtype_name(type),
                       " are not supported (supported: float32, float64, float16, "
                       "bfloat16, int8, uint8, int32, int64, bool)");
  }
}

std::string reduce_op_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return "ReduceOp.SUM";
    case c10d::ReduceOp::AVG: return "ReduceOp.AVG";
    case c10d::ReduceOp::PRODUCT: return "ReduceOp.PRODUCT";
    case c10d::ReduceOp::MIN: return "ReduceOp.MIN";
    case c10d::ReduceOp::MAX: return "ReduceOp.MAX";
    case c10d::ReduceOp::BAND: return "ReduceOp.BAND";
    case c10d::ReduceOp::BOR: return "ReduceOp.BOR";
    case c10d::ReduceOp::BXOR: return "ReduceOp.BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "ReduceOp value " + std::to_string(static_cast<int>(op.op_));
  }
}

comm::ReduceSpec reduce_spec(const OpLabel& label, const c10d::ReduceOp& op,
                             at::ScalarType type, int group_size) {
  comm::ReduceSpec spec;
  spec.type = reduction_dtype(label, type);
  const bool floating = comm::is_floating_point(spec.type);
  switch (op.op_) {
    case c10d::ReduceOp::SUM: spec.kind = comm::ReduceKind::kSum; break;
    case c10d::ReduceOp::PRODUCT: spec.kind = comm::ReduceKind::kProduct; break;
    case c10d::ReduceOp::MIN: spec.kind = comm::ReduceKind::kMin; break;
    case c10d::ReduceOp::MAX: spec.kind = comm::ReduceKind::kMax; break;
    case c10d::ReduceOp::BAND: spec.kind = comm::ReduceKind::kBitAnd; break;
    case c10d::ReduceOp::BOR: spec.kind = comm::ReduceKind::kBitOr; break;
    case c10d::ReduceOp::BXOR: spec.kind = comm::ReduceKind::kBitXor; break;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK_TYPE(floating, label.prefix(), "ReduceOp.AVG needs a floating-point "
                       "dtype, got ", dtype_name(type), " (integer averages would truncate)");
      spec.kind = comm::ReduceKind::kSum;
      spec.post_divisor = group_size;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      TORCH_CHECK_TYPE(floating, label.prefix(), "PREMUL_SUM needs a floating-point "
                       "dtype, got ", dtype_name(type));
      TORCH_CHECK_VALUE(op.supplement_.defined(), label.prefix(),
                        "PREMUL_SUM without a factor");
      const auto* factor = static_cast<const torch_compat::PreMulSumSupplement*>(op.supplement_.get());
      spec.kind = comm::ReduceKind::kSum;
      if (factor->tensor_factor.defined()) {
        TORCH_CHECK_VALUE(factor->tensor_factor.numel() == 1, label.prefix(),
                          "PREMUL_SUM tensor factor must have one element");
        spec.pre_scale = factor->tensor_factor.to(at::kCPU).item<double>();
      } else {
        spec.pre_scale = factor->double_factor;
      }
      break;
    }
    default:
      TORCH_CHECK_VALUE(false, label.prefix(), "unsupported reduce op ", reduce_op_name(op));
  }
  TORCH_CHECK_TYPE(comm::is_reduction_supported(spec.type, spec.kind), label.prefix(),
                   "ReduceOp.", comm::reduce_kind_name(spec.kind), " is not defined for dtype ",
                   dtype_name(type), " (bitwise ops need an integer or bool dtype)");
  return spec;
}

}  // namespace fsdp_ext::backend
