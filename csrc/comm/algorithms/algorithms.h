// Collective algorithms over tagged point-to-point messages. Each runs on the
// group's progress thread inside one OpContext; every rank of the group calls
// the same algorithm with consistent sizes (a rank whose sizes differ gets a
// kMismatch error rather than corrupted data).
//
// One file per collective, as in gloo. Where a collective has more than one
// algorithm, algorithm_selection.h picks by size, and an environment
// variable can force one (see there).
#pragma once

#include <cstddef>
#include <vector>

#include "comm/data_type.h"
#include "comm/op_context.h"
#include "comm/reduce_spec.h"

namespace fsdp_ext::comm {

struct MutableSpan {
  void* data = nullptr;
  size_t bytes = 0;
};

struct ConstSpan {
  const void* data = nullptr;
  size_t bytes = 0;
};

// A bucket is several collectives of one kind run as one operation: one
// algorithm pass, with every member's messages in flight together (UCX), or
// one header and one done message per peer pair for the whole bucket
// (shared memory). Members may differ in size and dtype.

// outputs[r] receives rank r's input. outputs[rank()] may alias `input`.
// Per-rank sizes may differ (uneven all_gather).
struct AllgatherMember {
  ConstSpan input;
  std::vector<MutableSpan> outputs;
};
void allgather(OpContext& context, const std::vector<AllgatherMember>& bucket);
void allgather(OpContext& context, ConstSpan input, const std::vector<MutableSpan>& outputs);

// inputs[r] is this rank's contribution to rank r's output; output receives
// the reduction of every rank's inputs[rank()]. Sizes may differ per r.
// output may alias inputs[rank()].
struct ReduceScatterMember {
  std::vector<ConstSpan> inputs;
  MutableSpan output;
  ReduceSpec spec;
};
void reduce_scatter(OpContext& context, const std::vector<ReduceScatterMember>& bucket);
void reduce_scatter(OpContext& context, const std::vector<ConstSpan>& inputs,
                    MutableSpan output, const ReduceSpec& spec);

// In place: every rank ends with the same reduction of all ranks' data.
struct AllreduceMember {
  MutableSpan data;
  ReduceSpec spec;
};
void allreduce(OpContext& context, const std::vector<AllreduceMember>& bucket);
void allreduce(OpContext& context, MutableSpan data, const ReduceSpec& spec);

void broadcast(OpContext& context, MutableSpan data, int root);

// In place on `root`; other ranks' data is left unchanged.
void reduce(OpContext& context, MutableSpan data, int root, const ReduceSpec& spec);

// On root, outputs[r] receives rank r's input; elsewhere outputs is empty.
void gather(OpContext& context, ConstSpan input,
            const std::vector<MutableSpan>& outputs, int root);

// On root, inputs[r] goes to rank r's output; elsewhere inputs is empty.
void scatter(OpContext& context, const std::vector<ConstSpan>& inputs,
             MutableSpan output, int root);

// inputs[r] goes to rank r, outputs[r] comes from rank r.
void alltoall(OpContext& context, const std::vector<ConstSpan>& inputs,
              const std::vector<MutableSpan>& outputs);

void barrier(OpContext& context);

}  // namespace fsdp_ext::comm
