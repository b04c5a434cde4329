// torch dtypes and c10d reduce ops -> the communication core's types.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "backend/op_label.hpp"
#include "comm/algorithms/algorithms.h"
#include "comm/collective_kind.h"

namespace fsdp_ext::backend {

// What a collective's messages say it is (comm/collective_kind.h), from the
// name the op reports itself under ("all_gather_into_tensor", ...). Forms of
// one collective share a kind; names that are not collectives get kUnnamed.
comm::CollectiveKind collective_kind_of(const char* op);

// "torch.float32" rather than c10's "Float": the name users write.
std::string dtype_name(at::ScalarType type);

// "ReduceOp.SUM": the name users write (torch.distributed.ReduceOp's).
std::string reduce_op_name(const c10d::ReduceOp& op);

// The element type for a reduction; rejects dtypes the kernels do not cover.
comm::DataType reduction_dtype(const OpLabel& label, at::ScalarType type);

// Maps SUM/AVG/PRODUCT/MIN/MAX/BAND/BOR/BXOR/PREMUL_SUM, rejecting pairs that
// make no sense (bitwise on floats, AVG or PREMUL_SUM on integers).
comm::ReduceSpec reduce_spec(const OpLabel& label, const c10d::ReduceOp& op,
                             at::ScalarType type, int group_size);

}  // namespace fsdp_ext::backend
