#include "fsdp/group_collectives.hpp"

#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <string>

#include "fsdp/copy_kernels.hpp"

namespace fsdp_ext::fsdp {

// _allgather_base / _reduce_scatter_base are deprecated aliases in newer
// torch but the only names every torch 2.x has; they dispatch the same op.
namespace {

// Issues `issue()` with the GIL released when the caller holds it, as
// torch's Python collectives do: gloo's worker thread can hold its queue lock
// while it destroys a finished Work whose saved thread-local state owns a
// Python object (so it needs the GIL), and enqueueing takes that lock.
template <typename Issue>
c10::intrusive_ptr<c10d::Work> without_gil(Issue&& issue) {
  if (PyGILState_Check()) {
    pybind11::gil_scoped_release no_gil;
    return issue();
  }
  return issue();
}

}  // namespace

c10::intrusive_ptr<c10d::Work> all_gather_flat(c10d::ProcessGroup& group, at::Tensor& output,
                                               at::Tensor& input) {
  return without_gil([&] {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return group._allgather_base(output, input);
#pragma GCC diagnostic pop
  });
}

c10::intrusive_ptr<c10d::Work> reduce_scatter_flat(c10d::ProcessGroup& group, at::Tensor& output,
                                                   at::Tensor& input) {
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return without_gil([&] {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return group._reduce_scatter_base(output, input, options);
#pragma GCC diagnostic pop
  });
}

void wait_releasing_gil(const c10::intrusive_ptr<c10d::Work>& work) {
  if (PyGILState_Check()) {
    pybind11::gil_scoped_release no_gil;
    work->wait();
  } else {
    work->wait();
  }
}

namespace {

at::ScalarType common_dtype(const char* what, const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK_VALUE(!tensors.empty(), "fsdp_ext ", what, ": the group has no tensors");
  return tensors.front().scalar_type();
}

}  // namespace

void all_gather_group(const std::vector<at::Tensor>& shards,
                      const std::vector<at::Tensor>& padded_unsharded,
                      const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  const at::ScalarType dtype = common_dtype("all_gather_group", shards);
  TORCH_CHECK_VALUE(shards.size() == padded_unsharded.size(), "fsdp_ext all_gather_group: ",
                    shards.size(), " shards but ", padded_unsharded.size(), " outputs");
  const int64_t world = group->getSize();
  std::vector<int64_t> splits;
  int64_t input_numel = 0;
  for (const at::Tensor& shard : shards) {
    splits.push_back(shard.numel());
    input_numel += shard.numel();
  }
  at::Tensor output = at::empty({input_numel * world}, at::TensorOptions().dtype(dtype));
  at::Tensor input = all_gather_copy_in(shards, output, group->getRank(), world);
  all_gather_flat(*group, output, input)->wait();
  all_gather_copy_out(output, splits, world, padded_unsharded);
}

void reduce_scatter_group(const std::vector<at::Tensor>& gradients,
                          const std::vector<at::Tensor>& sharded,
                          const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                          double divide_factor) {
  const at::ScalarType dtype = common_dtype("reduce_scatter_group", gradients);
  TORCH_CHECK_VALUE(gradients.size() == sharded.size(), "fsdp_ext reduce_scatter_group: ",
                    gradients.size(), " gradients but ", sharded.size(), " sharded outputs");
  TORCH_CHECK_VALUE(divide_factor > 0, "fsdp_ext reduce_scatter_group: divide_factor must be "
                    "> 0, got ", divide_factor);
  const int64_t world = group->getSize();
  int64_t row_numel = 0;
  std::vector<int64_t> chunks;
  for (size_t i = 0; i < gradients.size(); ++i) {
    const int64_t chunk = padded_chunk_numel(gradients[i].sizes(), world);
    chunks.push_back(chunk);
    TORCH_CHECK_VALUE(sharded[i].numel() == chunk && sharded[i].is_contiguous() &&
                          sharded[i].scalar_type() == dtype,
                      "fsdp_ext reduce_scatter_group: sharded output ", i,
                      " must be a contiguous ", dtype, " tensor of ", chunk, " elements");
    row_numel += chunk;
  }
  const auto options = at::TensorOptions().dtype(dtype);
  at::Tensor input = at::empty({row_numel * world}, options);
  reduce_scatter_copy_in(gradients, world, input);
  at::Tensor output = at::empty({row_numel}, options);
  reduce_scatter_flat(*group, output, input)->wait();
  if (divide_factor != 1.0) output.div_(divide_factor);
  // This rank's row holds the gradients' chunks back to back: the all-gather
  // copy-out with one rank splits it into the sharded outputs.
  all_gather_copy_out(output, chunks, 1, sharded);
}

}  // namespace fsdp_ext::fsdp
