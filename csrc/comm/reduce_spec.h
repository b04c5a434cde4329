// What a reduction computes: the element type, the combining op, and the
// scalings PREMUL_SUM and AVG add. Shared by comm's CPU algorithms and the
// device room's kernels (csrc/device), so it depends on nothing else.
#pragma once

#include "comm/data_type.h"

namespace fsdp_ext::comm {

struct ReduceSpec {
  DataType type = DataType::kFloat32;
  ReduceKind kind = ReduceKind::kSum;
  double pre_scale = 1.0;   // PREMUL_SUM: every contribution times this
  // AVG: the result divided by the group size. A true division, as torch's
  // div_, not a multiply by the reciprocal (not the same rounding for a group
  // of 3): AVG is then bit for bit SUM followed by div_, which is what gloo's
  // AVG and an FSDP runtime that divides after a SUM compute.
  double post_divisor = 1.0;
};

}  // namespace fsdp_ext::comm
