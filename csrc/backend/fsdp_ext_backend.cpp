// The c10d entry points: every collective and point-to-point op checks its
// tensors and hands a body to the engine (enqueue). Creation and shutdown
// are in group_setup.cpp, coalescing in coalescing.cpp, allocation in
// allocation.cpp.
#include "backend/fsdp_ext_backend.hpp"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <unordered_set>

#include "backend/environment.hpp"
#include "backend/flight_recorder.hpp"
#include "backend/peer_identity.hpp"
#include "backend/store_address_exchange.hpp"
#include "backend/tensor_validation.hpp"
#include "backend/type_mapping.hpp"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/small_ops.h"
#include "comm/tag_scheme.h"


namespace fsdp_ext::backend {
namespace {

comm::MutableSpan span_of(const at::Tensor& tensor) {
  return comm::MutableSpan{tensor.data_ptr(), tensor.nbytes()};
}
comm::ConstSpan const_span_of(const at::Tensor& tensor) {
  return comm::ConstSpan{tensor.data_ptr(), tensor.nbytes()};
}

std::vector<comm::ConstSpan> const_spans_of(const std::vector<at::Tensor>& tensors) {
  std::vector<comm::ConstSpan> spans;
  spans.reserve(tensors.size());
  for (const at::Tensor& tensor : tensors) spans.push_back(const_span_of(tensor));
  return spans;
}

// Equal slices of a flat tensor, one per rank (all_gather_into_tensor /
// reduce_scatter_tensor layouts).
std::vector<comm::MutableSpan> split_evenly(const at::Tensor& flat, int parts) {
  std::vector<comm::MutableSpan> spans(parts);
  const size_t part_bytes = flat.nbytes() / parts;
  char* base = static_cast<char*>(flat.data_ptr());
  for (int p = 0; p < parts; ++p) spans[p] = {base + p * part_bytes, part_bytes};
  return spans;
}

std::vector<comm::ConstSpan> to_const_spans(const std::vector<comm::MutableSpan>& spans) {
  std::vector<comm::ConstSpan> out(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) out[i] = {spans[i].data, spans[i].bytes};
  return out;
}

// Spans along dim 0 with the given row counts (alltoall_base splits).
std::vector<comm::MutableSpan> split_rows(const at::Tensor& tensor,
                                          const std::vector<int64_t>& rows) {
  size_t row_bytes = tensor.element_size();
  for (int64_t d = 1; d < tensor.dim(); ++d) row_bytes *= tensor.size(d);
  std::vector<comm::MutableSpan> spans(rows.size());
  char* cursor = static_cast<char*>(tensor.data_ptr());
  for (size_t i = 0; i < rows.size(); ++i) {
    const size_t bytes = static_cast<size_t>(rows[i]) * row_bytes;
    spans[i] = {cursor, bytes};
    if (cursor) cursor += bytes;
  }
  return spans;
}

std::vector<int64_t> resolve_splits(const OpLabel& label, const at::Tensor& tensor,
                                    const std::vector<int64_t>& splits, const char* role) {
  TORCH_CHECK_VALUE(tensor.dim() >= 1, label.prefix(), role, " must have at least one dimension");
  const int64_t rows = tensor.size(0);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(rows % label.size == 0, label.prefix(), role, " has ", rows,
                      " rows along dim 0, which the group size ", label.size,
                      " does not divide; pass split sizes");
    return std::vector<int64_t>(label.size, rows / label.size);
  }
  check_count(label, splits.size(), static_cast<size_t>(label.size), role);
  for (int64_t split : splits) {
    TORCH_CHECK_VALUE(split >= 0, label.prefix(), role, " split sizes must be >= 0, got ", split);
  }
  const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  TORCH_CHECK_VALUE(total == rows, label.prefix(), role, " split sizes sum to ", total,
                    " but the tensor has ", rows, " rows along dim 0");
  return splits;
}

}  // namespace

OpLabel FsdpExtBackend::label(const char* op) const {
  std::string group = "'" + group_name_ + "'";
  if (!pg_desc_.empty()) group += " (" + pg_desc_ + ")";
  return OpLabel{op, std::move(group), rank_, size_};
}

std::chrono::milliseconds FsdpExtBackend::resolve_timeout(
    std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? default_timeout_ : requested;
}

std::chrono::microseconds FsdpExtBackend::wait_spin_for_tensors(
    const std::vector<at::Tensor>& tensors) const {
  // Within one host the size does not matter: no set to build on every op.
  if (engine_->config().topology.hosts.size() < 2) return wait_spin_for(0, false);
  // Distinct buffers only: an in-place op lists its tensor as input and output.
  std::unordered_set<const void*> seen;
  size_t bytes = 0;
  for (const at::Tensor& tensor : tensors) {
    if (tensor.defined() && seen.insert(tensor.data_ptr()).second) bytes += tensor.nbytes();
  }
  return wait_spin_for(bytes, /*crosses_hosts=*/true);
}

c10::intrusive_ptr<FsdpExtWork> FsdpExtBackend::make_work(
    c10d::OpType type, const char* profiling_title, bool collective,
    const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs,
    std::chrono::microseconds wait_spin, std::chrono::milliseconds timeout, int peer) {
  WorkRecord record;
  record.timed = timing_enabled_.load(std::memory_order_relaxed);
  const bool users = profiling_title != nullptr;
  if (users && collective) record.seq = collective_seq_.fetch_add(1) + 1;
  FlightRecorder& recorder = FlightRecorder::instance();
  if (users && recorder.enabled()) {
    FlightRecorder::Op op;
    op.group_name = group_name_;
    op.group_desc = pg_desc_;
    op.group_ranks = &global_ranks_;
    op.collective_seq = collective ? record.seq : collective_seq_.load();
    op.is_p2p = peer >= 0;
    op.p2p_seq = op.is_p2p ? p2p_seq_.fetch_add(1) + 1 : p2p_seq_.load();
    op.op_id = ops_issued_.fetch_add(1) + 1;
    op.profiling_name = flight_recorder_name(profiling_title, rank_, peer);
    op.timeout = timeout;
    record.trace_id = recorder.record(op, inputs, outputs);
    record.global_rank = static_cast<int>(global_ranks_[rank_]);
  }
  return c10::make_intrusive<FsdpExtWork>(rank_, type, profiling_title, inputs,
                                          std::move(outputs), wait_spin, record);
}

std::vector<at::Tensor> FsdpExtBackend::tensors_of_op(const std::vector<at::Tensor>& inputs,
                                                      const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> all = inputs;
  for (const at::Tensor& output : outputs) {
    const bool listed = std::any_of(inputs.begin(), inputs.end(), [&](const at::Tensor& input) {
      return input.unsafeGetTensorImpl() == output.unsafeGetTensorImpl();
    });
    if (!listed) all.push_back(output);
  }
  return all;
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::enqueue(
    const OpLabel& label, c10d::OpType type, const char* profiling_title, bool collective,
    std::chrono::milliseconds timeout, std::vector<at::Tensor> outputs,
    std::vector<at::Tensor> inputs, Body body, std::shared_ptr<const BucketMembers> bucket,
    int peer) {
  std::vector<at::Tensor> keep_alive = tensors_of_op(inputs, outputs);
  auto work = make_work(type, profiling_title, collective, inputs, std::move(outputs),
                        wait_spin_for_tensors(keep_alive), timeout, peer);
  const bool receive_only = type == c10d::OpType::RECV || type == c10d::OpType::RECVANYSOURCE;
  {
    std::lock_guard<std::mutex> lock(coalescing_mutex_);
    if (coalescing_on_this_thread()) {
      coalesced_ops_.push_back(
          CoalescedOp{collective, receive_only, std::move(body), work, std::move(bucket)});
      coalesced_tensors_.insert(coalesced_tensors_.end(), keep_alive.begin(),
                                keep_alive.end());
      coalesced_timeout_ = std::max(coalesced_timeout_, timeout);
      return work;
    }
  }
  comm::EngineOp op;
  op.name = label.op;
  op.kind = collective_kind_of(label.op);
  op.collective = collective;
  op.receive_only = receive_only;
  op.timeout = timeout;
  op.body = std::move(body);
  op.keepalive = std::make_shared<std::vector<at::Tensor>>(std::move(keep_alive));
  op.on_start = [work] { work->mark_started(); };
  op.on_done = FsdpExtWork::completion_on_engine({work});
  engine_->submit(std::move(op));
  return work;
}

// ---------------------------------------------------------------- collectives

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                         const c10d::BroadcastOptions& opts) {
  const OpLabel l = label("broadcast");
  check_count(l, tensors.size(), 1, "tensor");
  check_tensor(l, tensors[0], "tensor");
  check_rank(l, opts.rootRank, "root");
  at::Tensor tensor = tensors[0];
  const int root = static_cast<int>(opts.rootRank);
  if (CudaCollectives* cuda = cuda_route(l, tensors)) {
    CudaOp op;
    op.kind = CudaOp::Kind::kBroadcast;
    op.inputs = op.outputs = {tensor};
    op.root = root;
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>&) {
      return broadcast(in, opts);
    };
    op.on_nccl = [tensor, opts](c10d::Backend& nccl) {
      std::vector<at::Tensor> t{tensor};
      return nccl.broadcast(t, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  if (use_small_ops(tensor.nbytes(), "FSDP_EXT_BROADCAST_ALGO")) {
    return run_small(
        l, c10d::OpType::BROADCAST, "fsdp_ext:broadcast", resolve_timeout(opts.timeout),
        {tensor}, {tensor},
        [tensor, root](comm::SmallOpChannel& channel, uint64_t seq) {
          comm::start_small_broadcast(channel, seq, const_span_of(tensor), root);
        },
        [tensor, root](const comm::SmallOpChannel& channel) {
          comm::finish_small_broadcast(channel, span_of(tensor), root);
        });
  }
  return enqueue(l, c10d::OpType::BROADCAST, "fsdp_ext:broadcast", true,
                 resolve_timeout(opts.timeout), {tensor}, {tensor},
                 [tensor, root](comm::OpContext& context) {
                   comm::broadcast(context, span_of(tensor), root);
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse) {
    return allreduce_sparse(tensors, opts);
  }
  const OpLabel l = label("all_reduce");
  check_count(l, tensors.size(), 1, "tensor");
  check_tensor(l, tensors[0], "tensor");
  at::Tensor tensor = tensors[0];
  const comm::ReduceSpec spec = reduce_spec(l, opts.reduceOp, tensor.scalar_type(), size_);
  if (CudaCollectives* cuda = cuda_route(l, tensors)) {
    CudaOp op;
    op.kind = CudaOp::Kind::kAllreduce;
    op.inputs = op.outputs = {tensor};
    op.spec = spec;
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>&) {
      return allreduce(in, opts);
    };
    op.on_nccl = [tensor, opts](c10d::Backend& nccl) {
      std::vector<at::Tensor> t{tensor};
      return nccl.allreduce(t, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  if (use_small_ops(tensor.nbytes(), "FSDP_EXT_ALLREDUCE_ALGO")) {
    return run_small(
        l, c10d::OpType::ALLREDUCE, "fsdp_ext:all_reduce", resolve_timeout(opts.timeout),
        {tensor}, {tensor},
        [tensor, spec](comm::SmallOpChannel& channel, uint64_t seq) {
          comm::start_small_allreduce(channel, seq, const_span_of(tensor), spec);
        },
        [tensor, spec](const comm::SmallOpChannel& channel) {
          comm::finish_small_allreduce(channel, span_of(tensor), spec);
        });
  }
  BucketMembers bucket;
  bucket.allreduce.push_back({span_of(tensor), spec});
  return enqueue_bucket(l, c10d::OpType::ALLREDUCE, "fsdp_ext:all_reduce",
                        resolve_timeout(opts.timeout), {tensor}, {tensor}, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const OpLabel l = label("all_reduce_coalesced");
  TORCH_CHECK_VALUE(!tensors.empty(), l.prefix(), "needs at least one tensor");
  check_tensors(l, tensors, "tensor");
  BucketMembers bucket;
  for (const at::Tensor& tensor : tensors) {
    bucket.allreduce.push_back(
        {span_of(tensor), reduce_spec(l, opts.reduceOp, tensor.scalar_type(), size_)});
  }
  if (CudaCollectives* cuda = cuda_route(l, tensors)) {
    // The fast routes reduce a bucket of one dtype; others are staged.
    const bool one_dtype = std::all_of(tensors.begin(), tensors.end(), [&](const at::Tensor& t) {
      return t.scalar_type() == tensors[0].scalar_type();
    });
    CudaOp op;
    op.kind = one_dtype ? CudaOp::Kind::kAllreduce : CudaOp::Kind::kOther;
    op.inputs = op.outputs = tensors;
    op.spec = bucket.allreduce.front().spec;
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>&) {
      return allreduce_coalesced(in, opts);
    };
    std::vector<at::Tensor> all = tensors;
    op.on_nccl = [all, opts](c10d::Backend& nccl) mutable {
      return nccl.allreduce_coalesced(all, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  return enqueue_bucket(l, c10d::OpType::ALLREDUCE_COALESCED, "fsdp_ext:all_reduce_coalesced",
                        resolve_timeout(opts.timeout), tensors, tensors, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::reduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::ReduceOptions& opts) {
  const OpLabel l = label("reduce");
  check_count(l, tensors.size(), 1, "tensor");
  check_tensor(l, tensors[0], "tensor");
  check_rank(l, opts.rootRank, "root");
  at::Tensor tensor = tensors[0];
  const comm::ReduceSpec spec = reduce_spec(l, opts.reduceOp, tensor.scalar_type(), size_);
  const int root = static_cast<int>(opts.rootRank);
  if (CudaCollectives* cuda = cuda_route(l, tensors)) {
    CudaOp op;
    op.inputs = op.outputs = {tensor};
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>&) {
      return reduce(in, opts);
    };
    op.on_nccl = [tensor, opts](c10d::Backend& nccl) {
      std::vector<at::Tensor> t{tensor};
      return nccl.reduce(t, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  return enqueue(l, c10d::OpType::REDUCE, "fsdp_ext:reduce", true,
                 resolve_timeout(opts.timeout), {tensor}, {tensor},
                 [tensor, spec, root](comm::OpContext& context) {
                   comm::reduce(context, span_of(tensor), root, spec);
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const OpLabel l = label("all_gather");
  check_count(l, inputs.size(), 1, "input tensor");
  check_count(l, outputs.size(), 1, "output tensor list");
  check_count(l, outputs[0].size(), static_cast<size_t>(size_), "output tensors (one per rank)");
  check_tensor(l, inputs[0], "input");
  check_tensors(l, outputs[0], "output");
  for (const at::Tensor& output : outputs[0]) check_same_dtype(l, output, "an output", inputs[0], "the input");
  check_numel(l, outputs[0][rank_].numel(), inputs[0].numel(),
              "the output for this rank must match the input");
  at::Tensor input = inputs[0];
  std::vector<at::Tensor> list = outputs[0];
  std::vector<at::Tensor> all = list;
  all.push_back(input);
  if (CudaCollectives* cuda = cuda_route(l, all)) {
    CudaOp op;
    op.inputs = {input};
    op.outputs = list;
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
      std::vector<std::vector<at::Tensor>> lists{out};
      return allgather(lists, in, opts);
    };
    op.on_nccl = [input, list, opts](c10d::Backend& nccl) {
      std::vector<std::vector<at::Tensor>> lists{list};
      std::vector<at::Tensor> in{input};
      return nccl.allgather(lists, in, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  const bool even = std::all_of(list.begin(), list.end(), [&](const at::Tensor& output) {
    return output.nbytes() == input.nbytes();
  });
  if (even && use_small_ops(input.nbytes(), "FSDP_EXT_ALLGATHER_ALGO")) {
    return run_small(
        l, c10d::OpType::ALLGATHER, "fsdp_ext:all_gather", resolve_timeout(opts.timeout), list,
        {input},
        [input](comm::SmallOpChannel& channel, uint64_t seq) {
          comm::start_small_allgather(channel, seq, const_span_of(input));
        },
        [list](const comm::SmallOpChannel& channel) {
          std::vector<comm::MutableSpan> spans;
          for (const at::Tensor& output : list) spans.push_back(span_of(output));
          comm::finish_small_allgather(channel, spans);
        });
  }
  BucketMembers bucket;
  bucket.allgather.push_back({const_span_of(input), {}});
  for (const at::Tensor& output : list) bucket.allgather[0].outputs.push_back(span_of(output));
  return enqueue_bucket(l, c10d::OpType::ALLGATHER, "fsdp_ext:all_gather",
                        resolve_timeout(opts.timeout), list, {input}, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const OpLabel l = label("all_gather_into_tensor");
  check_gather_into_tensor(l, output, input, "");
  if (CudaCollectives* cuda = cuda_route(l, {output, input})) {
    CudaOp op;
    op.kind = CudaOp::Kind::kAllgather;
    op.inputs = {input};
    op.outputs = {output};
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
      return _allgather_base(out[0], in[0], opts);
    };
    op.on_nccl = [output, input, opts](c10d::Backend& nccl) mutable {
      return nccl._allgather_base(output, input, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  return allgather_into_tensor(l, output, input, resolve_timeout(opts.timeout));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::allgather_into_tensor(
    const OpLabel& l, at::Tensor& output, at::Tensor& input, std::chrono::milliseconds timeout) {
  if (use_small_ops(input.nbytes(), "FSDP_EXT_ALLGATHER_ALGO")) {
    at::Tensor in = input;
    at::Tensor out = output;
    const int parts = size_;
    return run_small(
        l, c10d::OpType::_ALLGATHER_BASE, "fsdp_ext:all_gather_into_tensor", timeout, {out},
        {in},
        [in](comm::SmallOpChannel& channel, uint64_t seq) {
          comm::start_small_allgather(channel, seq, const_span_of(in));
        },
        [out, parts](const comm::SmallOpChannel& channel) {
          comm::finish_small_allgather(channel, split_evenly(out, parts));
        });
  }
  BucketMembers bucket;
  bucket.allgather.push_back({const_span_of(input), split_evenly(output, size_)});
  return enqueue_bucket(l, c10d::OpType::_ALLGATHER_BASE, "fsdp_ext:all_gather_into_tensor",
                        timeout, {output}, {input}, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const OpLabel l = label("all_gather_into_tensor_coalesced");
  check_count(l, outputs.size(), inputs.size(), "output tensors (one per input)");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_gather_into_tensor(l, outputs[i], inputs[i], " " + std::to_string(i));
  }
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  if (CudaCollectives* cuda = cuda_route(l, all)) {
    CudaOp op;
    op.kind = CudaOp::Kind::kAllgather;
    op.inputs = inputs;
    op.outputs = outputs;
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
      return allgather_into_tensor_coalesced(out, in, opts);
    };
    op.on_nccl = [outputs, inputs, opts](c10d::Backend& nccl) mutable {
      return nccl.allgather_into_tensor_coalesced(outputs, inputs, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  size_t total = 0;
  for (const at::Tensor& input : inputs) total += input.nbytes();
  if (use_small_ops(total, "FSDP_EXT_ALLGATHER_ALGO")) {
    std::vector<at::Tensor> ins = inputs;
    std::vector<at::Tensor> outs = outputs;
    const int parts = size_;
    return run_small(
        l, c10d::OpType::COALESCED, "fsdp_ext:all_gather_into_tensor_coalesced",
        resolve_timeout(opts.timeout), outs, ins,
        [ins](comm::SmallOpChannel& channel, uint64_t seq) {
          comm::start_small_allgather_bucket(channel, seq, const_spans_of(ins));
        },
        [outs, parts](const comm::SmallOpChannel& channel) {
          std::vector<std::vector<comm::MutableSpan>> blocks;
          for (const at::Tensor& output : outs) blocks.push_back(split_evenly(output, parts));
          comm::finish_small_allgather_bucket(channel, blocks);
        });
  }
  BucketMembers bucket;
  for (size_t i = 0; i < inputs.size(); ++i) {
    bucket.allgather.push_back({const_span_of(inputs[i]), split_evenly(outputs[i], size_)});
  }
  return enqueue_bucket(l, c10d::OpType::COALESCED, "fsdp_ext:all_gather_into_tensor_coalesced",
                        resolve_timeout(opts.timeout), outputs, inputs, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const OpLabel l = label("all_gather_coalesced");
  TORCH_CHECK_VALUE(!inputs.empty(), l.prefix(), "needs at least one input tensor");
  check_count(l, outputs.size(), static_cast<size_t>(size_), "output tensor lists (one per rank)");
  check_tensors(l, inputs, "input");
  BucketMembers bucket;
  bucket.allgather.resize(inputs.size());
  std::vector<at::Tensor> flat_outputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK_NOT_IMPLEMENTED(inputs[i].device().is_cpu(), l.prefix(),
                                "CPU tensors only (as gloo's); input ", i, " is on ",
                                inputs[i].device());
    bucket.allgather[i].input = const_span_of(inputs[i]);
  }
  for (int r = 0; r < size_; ++r) {
    const std::string list = "output list " + std::to_string(r);
    check_count(l, outputs[r].size(), inputs.size(), (list + "'s tensors (one per input)").c_str());
    check_tensors(l, outputs[r], "output");
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& output = outputs[r][i];
      TORCH_CHECK_NOT_IMPLEMENTED(output.device().is_cpu(), l.prefix(),
                                  "CPU tensors only (as gloo's); an output is on ",
                                  output.device());
      check_same_dtype(l, output, "an output", inputs[i], "its input");
      check_numel(l, output.numel(), inputs[i].numel(),
                  list + ", tensor " + std::to_string(i) + " must match input " +
                      std::to_string(i));
      bucket.allgather[i].outputs.push_back(span_of(output));
      flat_outputs.push_back(output);
    }
  }
  return enqueue_bucket(l, c10d::OpType::ALLGATHER_COALESCED, "fsdp_ext:all_gather_coalesced",
                        resolve_timeout(opts.timeout), flat_outputs, inputs, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const OpLabel l = label("gather");
  check_rank(l, opts.rootRank, "root");
  const int root = static_cast<int>(opts.rootRank);
  check_count(l, inputs.size(), 1, "input tensor");
  check_tensor(l, inputs[0], "input");
  const std::vector<at::Tensor> list =
      root_tensor_list(l, outputs, root, inputs[0], "output", "input");
  at::Tensor input = inputs[0];
  std::vector<at::Tensor> all = list;
  all.push_back(input);
  if (CudaCollectives* cuda = cuda_route(l, all)) {
    CudaOp op;
    op.inputs = {input};
    op.outputs = list;
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
      std::vector<std::vector<at::Tensor>> lists;
      if (!out.empty()) lists.push_back(out);
      return gather(lists, in, opts);
    };
    op.on_nccl = [outputs, input, opts](c10d::Backend& nccl) mutable {
      std::vector<at::Tensor> in{input};
      return nccl.gather(outputs, in, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  return enqueue(l, c10d::OpType::GATHER, "fsdp_ext:gather", true,
                 resolve_timeout(opts.timeout), list, {input},
                 [input, list, root](comm::OpContext& context) {
                   std::vector<comm::MutableSpan> spans;
                   for (const at::Tensor& output : list) spans.push_back(span_of(output));
                   comm::gather(context, const_span_of(input), spans, root);
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const OpLabel l = label("scatter");
  check_rank(l, opts.rootRank, "root");
  const int root = static_cast<int>(opts.rootRank);
  check_count(l, outputs.size(), 1, "output tensor");
  check_tensor(l, outputs[0], "output");
  const std::vector<at::Tensor> list =
      root_tensor_list(l, inputs, root, outputs[0], "input", "output");
  at::Tensor output = outputs[0];
  std::vector<at::Tensor> all = list;
  all.push_back(output);
  if (CudaCollectives* cuda = cuda_route(l, all)) {
    CudaOp op;
    op.inputs = list;
    op.outputs = {output};
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
      std::vector<std::vector<at::Tensor>> lists;
      if (!in.empty()) lists.push_back(in);
      return scatter(out, lists, opts);
    };
    op.on_nccl = [output, inputs, opts](c10d::Backend& nccl) mutable {
      std::vector<at::Tensor> out{output};
      return nccl.scatter(out, inputs, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  return enqueue(l, c10d::OpType::SCATTER, "fsdp_ext:scatter", true,
                 resolve_timeout(opts.timeout), {output}, list,
                 [output, list, root](comm::OpContext& context) {
                   std::vector<comm::ConstSpan> spans;
                   for (const at::Tensor& input : list) spans.push_back(const_span_of(input));
                   comm::scatter(context, spans, span_of(output), root);
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const OpLabel l = label("reduce_scatter");
  check_count(l, outputs.size(), 1, "output tensor");
  check_count(l, inputs.size(), 1, "input tensor list");
  check_count(l, inputs[0].size(), static_cast<size_t>(size_), "input tensors (one per rank)");
  check_tensor(l, outputs[0], "output");
  check_tensors(l, inputs[0], "input");
  for (const at::Tensor& input : inputs[0]) check_same_dtype(l, input, "an input", outputs[0], "the output");
  check_numel(l, inputs[0][rank_].numel(), outputs[0].numel(),
              "the input for this rank must match the output");
  at::Tensor output = outputs[0];
  std::vector<at::Tensor> list = inputs[0];
  const comm::ReduceSpec spec = reduce_spec(l, opts.reduceOp, output.scalar_type(), size_);
  std::vector<at::Tensor> all = list;
  all.push_back(output);
  if (CudaCollectives* cuda = cuda_route(l, all)) {
    CudaOp op;
    op.inputs = list;
    op.outputs = {output};
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
      std::vector<std::vector<at::Tensor>> lists{in};
      return reduce_scatter(out, lists, opts);
    };
    op.on_nccl = [output, list, opts](c10d::Backend& nccl) {
      std::vector<at::Tensor> out{output};
      std::vector<std::vector<at::Tensor>> lists{list};
      return nccl.reduce_scatter(out, lists, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  BucketMembers bucket;
  bucket.reduce_scatter.push_back({{}, span_of(output), spec});
  for (const at::Tensor& input : list) {
    bucket.reduce_scatter[0].inputs.push_back(const_span_of(input));
  }
  return enqueue_bucket(l, c10d::OpType::REDUCE_SCATTER, "fsdp_ext:reduce_scatter",
                        resolve_timeout(opts.timeout), {output}, list, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const OpLabel l = label("reduce_scatter_tensor");
  check_scatter_from_tensor(l, output, input, "");
  const comm::ReduceSpec spec = reduce_spec(l, opts.reduceOp, output.scalar_type(), size_);
  if (CudaCollectives* cuda = cuda_route(l, {output, input})) {
    CudaOp op;
    op.kind = CudaOp::Kind::kReduceScatter;
    op.inputs = {input};
    op.outputs = {output};
    op.spec = spec;
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
      return _reduce_scatter_base(out[0], in[0], opts);
    };
    op.on_nccl = [output, input, opts](c10d::Backend& nccl) mutable {
      return nccl._reduce_scatter_base(output, input, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  if (use_small_ops(input.nbytes(), "FSDP_EXT_REDUCE_SCATTER_ALGO")) {
    at::Tensor in = input;
    at::Tensor out = output;
    return run_small(
        l, c10d::OpType::_REDUCE_SCATTER_BASE, "fsdp_ext:reduce_scatter_tensor",
        resolve_timeout(opts.timeout), {out}, {in},
        [in, spec](comm::SmallOpChannel& channel, uint64_t seq) {
          comm::start_small_reduce_scatter(channel, seq, const_span_of(in), spec);
        },
        [out, spec](const comm::SmallOpChannel& channel) {
          comm::finish_small_reduce_scatter(channel, span_of(out), spec);
        });
  }
  BucketMembers bucket;
  bucket.reduce_scatter.push_back(
      {to_const_spans(split_evenly(input, size_)), span_of(output), spec});
  return enqueue_bucket(l, c10d::OpType::_REDUCE_SCATTER_BASE, "fsdp_ext:reduce_scatter_tensor",
                        resolve_timeout(opts.timeout), {output}, {input}, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const OpLabel l = label("reduce_scatter_tensor_coalesced");
  check_count(l, outputs.size(), inputs.size(), "output tensors (one per input)");
  BucketMembers bucket;
  size_t total = 0;
  bool one_spec = true;  // the channel reduces a bucket with one dtype and op
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_scatter_from_tensor(l, outputs[i], inputs[i], " " + std::to_string(i));
    bucket.reduce_scatter.push_back({to_const_spans(split_evenly(inputs[i], size_)),
                                     span_of(outputs[i]),
                                     reduce_spec(l, opts.reduceOp, outputs[i].scalar_type(), size_)});
    total += inputs[i].nbytes();
    one_spec = one_spec && outputs[i].scalar_type() == outputs[0].scalar_type();
  }
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  if (CudaCollectives* cuda = cuda_route(l, all)) {
    CudaOp op;
    // The fast routes reduce a bucket of one dtype; others are staged.
    op.kind = one_spec ? CudaOp::Kind::kReduceScatter : CudaOp::Kind::kOther;
    op.inputs = inputs;
    op.outputs = outputs;
    op.spec = bucket.reduce_scatter.front().spec;
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
      return reduce_scatter_tensor_coalesced(out, in, opts);
    };
    op.on_nccl = [outputs, inputs, opts](c10d::Backend& nccl) mutable {
      return nccl.reduce_scatter_tensor_coalesced(outputs, inputs, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  if (!inputs.empty() && one_spec && use_small_ops(total, "FSDP_EXT_REDUCE_SCATTER_ALGO")) {
    std::vector<at::Tensor> ins = inputs;
    std::vector<at::Tensor> outs = outputs;
    const comm::ReduceSpec spec = bucket.reduce_scatter.front().spec;
    return run_small(
        l, c10d::OpType::COALESCED, "fsdp_ext:reduce_scatter_tensor_coalesced",
        resolve_timeout(opts.timeout), outs, ins,
        [ins, spec](comm::SmallOpChannel& channel, uint64_t seq) {
          comm::start_small_reduce_scatter_bucket(channel, seq, const_spans_of(ins), spec);
        },
        [outs, spec](const comm::SmallOpChannel& channel) {
          std::vector<comm::MutableSpan> spans;
          for (const at::Tensor& output : outs) spans.push_back(span_of(output));
          comm::finish_small_reduce_scatter_bucket(channel, spans, spec);
        });
  }
  return enqueue_bucket(l, c10d::OpType::COALESCED, "fsdp_ext:reduce_scatter_tensor_coalesced",
                        resolve_timeout(opts.timeout), outputs, inputs, std::move(bucket));
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  const OpLabel l = label("all_to_all_single");
  check_tensor(l, input, "input");
  check_tensor(l, output, "output");
  check_same_dtype(l, output, "output", input, "input");
  const auto out_rows = resolve_splits(l, output, output_split_sizes, "output");
  const auto in_rows = resolve_splits(l, input, input_split_sizes, "input");
  if (CudaCollectives* cuda = cuda_route(l, {output, input})) {
    CudaOp op;
    op.inputs = {input};
    op.outputs = {output};
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, output_split_sizes, input_split_sizes, opts](
                     std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) mutable {
      return alltoall_base(out[0], in[0], output_split_sizes, input_split_sizes, opts);
    };
    op.on_nccl = [output, input, output_split_sizes, input_split_sizes,
                  opts](c10d::Backend& nccl) mutable {
      return nccl.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  at::Tensor in = input;
  at::Tensor out = output;
  return enqueue(l, c10d::OpType::ALLTOALL_BASE, "fsdp_ext:all_to_all_single", true,
                 resolve_timeout(opts.timeout), {out}, {in},
                 [in, out, in_rows, out_rows](comm::OpContext& context) {
                   comm::alltoall(context, to_const_spans(split_rows(in, in_rows)),
                                  split_rows(out, out_rows));
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::AllToAllOptions& opts) {
  const OpLabel l = label("all_to_all");
  check_count(l, inputs.size(), static_cast<size_t>(size_), "input tensors (one per rank)");
  check_count(l, outputs.size(), static_cast<size_t>(size_), "output tensors (one per rank)");
  check_tensors(l, inputs, "input");
  check_tensors(l, outputs, "output");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_same_dtype(l, outputs[i], "an output", inputs[0], "the inputs");
    check_same_dtype(l, inputs[i], "an input", inputs[0], "the first input");
  }
  check_numel(l, outputs[rank_].numel(), inputs[rank_].numel(),
              "the output and input for this rank must match");
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  if (CudaCollectives* cuda = cuda_route(l, all)) {
    CudaOp op;
    op.inputs = inputs;
    op.outputs = outputs;
    op.timeout = resolve_timeout(opts.timeout);
    op.on_host = [this, opts](std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
      return alltoall(out, in, opts);
    };
    op.on_nccl = [outputs, inputs, opts](c10d::Backend& nccl) mutable {
      return nccl.alltoall(outputs, inputs, opts);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  return enqueue(l, c10d::OpType::ALLTOALL, "fsdp_ext:all_to_all", true,
                 resolve_timeout(opts.timeout), outs, ins,
                 [ins, outs](comm::OpContext& context) {
                   std::vector<comm::ConstSpan> in_spans;
                   std::vector<comm::MutableSpan> out_spans;
                   for (const at::Tensor& t : ins) in_spans.push_back(const_span_of(t));
                   for (const at::Tensor& t : outs) out_spans.push_back(span_of(t));
                   comm::alltoall(context, in_spans, out_spans);
                 });
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::barrier(const c10d::BarrierOptions& opts) {
  const OpLabel l = label("barrier");
  if (use_small_ops(0, nullptr)) {
    return run_small(
        l, c10d::OpType::BARRIER, "fsdp_ext:barrier", resolve_timeout(opts.timeout), {}, {},
        [](comm::SmallOpChannel& channel, uint64_t seq) { comm::start_small_barrier(channel, seq); },
        [](const comm::SmallOpChannel& channel) { comm::finish_small_barrier(channel); });
  }
  return enqueue(l, c10d::OpType::BARRIER, "fsdp_ext:barrier", true,
                 resolve_timeout(opts.timeout), {}, {},
                 [](comm::OpContext& context) { comm::barrier(context); });
}

// ------------------------------------------------------------ point to point

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::send(std::vector<at::Tensor>& tensors,
                                                    int dst_rank, int tag) {
  const OpLabel l = label("send");
  check_count(l, tensors.size(), 1, "tensor");
  check_tensor(l, tensors[0], "tensor");
  check_rank(l, dst_rank, "destination");
  at::Tensor tensor = tensors[0];
  if (CudaCollectives* cuda = cuda_route(l, tensors, /*point_to_point=*/true)) {
    CudaOp op;
    op.inputs = {tensor};
    op.timeout = default_timeout_;
    op.on_host = [this, dst_rank, tag](std::vector<at::Tensor>& in, std::vector<at::Tensor>&) {
      return send(in, dst_rank, tag);
    };
    op.on_nccl = [tensor, dst_rank, tag](c10d::Backend& nccl) {
      std::vector<at::Tensor> t{tensor};
      return nccl.send(t, dst_rank, tag);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  return enqueue(l, c10d::OpType::SEND, "fsdp_ext:send", false, default_timeout_, {tensor}, {tensor},
                 [tensor, dst_rank, tag](comm::OpContext& context) {
                   context.detach(context.send_user(dst_rank, tag, tensor.data_ptr(),
                                                    tensor.nbytes()));
                 },
                 /*bucket=*/nullptr, /*peer=*/dst_rank);
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::recv(std::vector<at::Tensor>& tensors,
                                                    int src_rank, int tag) {
  const OpLabel l = label("recv");
  check_count(l, tensors.size(), 1, "tensor");
  check_tensor(l, tensors[0], "tensor");
  check_rank(l, src_rank, "source");
  at::Tensor tensor = tensors[0];
  if (CudaCollectives* cuda = cuda_route(l, tensors, /*point_to_point=*/true)) {
    CudaOp op;
    op.outputs = {tensor};
    op.timeout = default_timeout_;
    op.on_host = [this, src_rank, tag](std::vector<at::Tensor>&, std::vector<at::Tensor>& out) {
      return recv(out, src_rank, tag);
    };
    op.on_nccl = [tensor, src_rank, tag](c10d::Backend& nccl) {
      std::vector<at::Tensor> t{tensor};
      return nccl.recv(t, src_rank, tag);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  return enqueue(l, c10d::OpType::RECV, "fsdp_ext:recv", false, default_timeout_, {tensor}, {tensor},
                 [tensor, src_rank, tag](comm::OpContext& context) {
                   context.detach(context.recv_user(src_rank, tag, tensor.data_ptr(),
                                                    tensor.nbytes()));
                 },
                 /*bucket=*/nullptr, /*peer=*/src_rank);
}

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                             int tag) {
  const OpLabel l = label("recv (any source)");
  check_count(l, tensors.size(), 1, "tensor");
  check_tensor(l, tensors[0], "tensor");
  at::Tensor tensor = tensors[0];
  if (CudaCollectives* cuda = cuda_route(l, tensors, /*point_to_point=*/true)) {
    CudaOp op;
    op.outputs = {tensor};
    op.timeout = default_timeout_;
    op.on_host = [this, tag](std::vector<at::Tensor>&, std::vector<at::Tensor>& out) {
      return recvAnysource(out, tag);
    };
    op.on_nccl = [tensor, tag](c10d::Backend& nccl) {
      std::vector<at::Tensor> t{tensor};
      return nccl.recvAnysource(t, tag);
    };
    return run_on_cuda(*cuda, l, std::move(op));
  }
  return enqueue(l, c10d::OpType::RECVANYSOURCE, "fsdp_ext:recvAnySource", false,
                 default_timeout_, {tensor}, {tensor}, [tensor, tag](comm::OpContext& context) {
                   context.detach(context.recv_user(-1, tag, tensor.data_ptr(), tensor.nbytes()));
                 },
                 // Any source: the Flight Recorder names it by the group size, no rank.
                 /*bucket=*/nullptr, /*peer=*/size_);
}

}  // namespace fsdp_ext::backend
