// A parameter group's two collectives, issued from C++ through the
// c10d::ProcessGroup API (so they dispatch through the c10d:: operators like
// upstream FSDP2's: CommDebugMode counts them, and any backend works: gloo,
// fsdp_ext, ...). Each is copy kernels + one flat collective + copy kernels.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <vector>

namespace fsdp_ext::fsdp {

// One flat all_gather_into_tensor / reduce_scatter_tensor (SUM) through the
// c10d ProcessGroup API, returned un-waited. Both release the GIL while they
// enqueue (see group_collectives.cpp).
c10::intrusive_ptr<c10d::Work> all_gather_flat(c10d::ProcessGroup& group, at::Tensor& output,
                                               at::Tensor& input);
c10::intrusive_ptr<c10d::Work> reduce_scatter_flat(c10d::ProcessGroup& group, at::Tensor& output,
                                                   at::Tensor& input);

// Work::wait() with the GIL released when the caller holds it: a backend
// thread that finishes an op may need the GIL (e.g. to free a tensor whose
// Python object it holds the last reference to), and must not wait for us.
void wait_releasing_gil(const c10::intrusive_ptr<c10d::Work>& work);

// Unshard: all-gathers every rank's padded local shards (shards[i], shapes
// equal on all ranks) into padded_unsharded[i], which holds world_size
// shards of shards[i] along dim 0 (world_size * shards[i].numel() elements).
// One flat all_gather_into_tensor for the whole group.
void all_gather_group(const std::vector<at::Tensor>& shards,
                      const std::vector<at::Tensor>& padded_unsharded,
                      const c10::intrusive_ptr<c10d::ProcessGroup>& group);

// Reduce: sums every rank's unsharded gradients (dim 0 split world_size ways,
// zero-padded) with one flat reduce_scatter_tensor and writes this rank's
// chunk of gradients[i], divided by `divide_factor`, into sharded[i]
// (padded_chunk_numel(gradients[i]) elements).
void reduce_scatter_group(const std::vector<at::Tensor>& gradients,
                          const std::vector<at::Tensor>& sharded,
                          const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                          double divide_factor);

}  // namespace fsdp_ext::fsdp
