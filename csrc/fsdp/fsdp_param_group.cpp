#include "fsdp/fsdp_param_group.hpp"

#include <torch/csrc/utils/pybind.h>  // at::Tensor -> Python (all-reduce hook)

#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <string>

#include "fsdp/copy_kernels.hpp"
#include "fsdp/event_trace.hpp"
#include "fsdp/profiler_range.hpp"
#include "fsdp/tensor_subclass.hpp"
#include "torch_compat.hpp"

namespace fsdp_ext::fsdp {
namespace {

// Raises Python's AssertionError, as upstream's checks of the same
// conditions do.
[[noreturn]] void raise_assertion(const std::string& message) {
  PyErr_SetString(PyExc_AssertionError, message.c_str());
  throw py::error_already_set();
}

std::string dtype_set(const std::vector<at::ScalarType>& dtypes) {
  std::string out;
  for (at::ScalarType dtype : dtypes) {
    if (!out.empty()) out += ", ";
    out += c10::toString(dtype);
  }
  return "{" + out + "}";
}

}  // namespace

FsdpParamGroup::FsdpParamGroup(std::vector<std::shared_ptr<FsdpParam>> params,
                               CollectiveGroup shard_group, CollectiveGroup replicate_group)
    : params_(std::move(params)),
      shard_group_(std::move(shard_group)),
      replicate_group_(std::move(replicate_group)),
      comm_(std::make_shared<FsdpCommContext>()) {
  // No shard group is one shard rank (DDP): then gradients must be reduced
  // across replicas.
  TORCH_CHECK_VALUE(shard_group_ || replicate_group_,
                    "fsdp_ext FsdpParamGroup: neither a shard nor a replicate process group");
  TORCH_CHECK_VALUE(!params_.empty(), "fsdp_ext FsdpParamGroup: no parameters");
  for (size_t i = 0; i < params_.size(); ++i) reduce_order_.push_back(i);
}

void FsdpParamGroup::init_mp_dtypes(std::optional<at::ScalarType> param_dtype,
                                    std::optional<at::ScalarType> reduce_dtype) {
  std::vector<at::ScalarType> orig_dtypes;
  std::vector<std::optional<at::ScalarType>> reduce_dtypes;
  for (const auto& param : params_) {
    param->init_dtype_attrs(param_dtype, reduce_dtype);
    if (!param->requires_grad()) continue;
    if (std::find(orig_dtypes.begin(), orig_dtypes.end(), param->orig_dtype()) == orig_dtypes.end()) {
      orig_dtypes.push_back(param->orig_dtype());
    }
    if (std::find(reduce_dtypes.begin(), reduce_dtypes.end(), param->reduce_dtype()) ==
        reduce_dtypes.end()) {
      reduce_dtypes.push_back(param->reduce_dtype());
    }
  }
  if (orig_dtypes.size() > 1) {
    raise_assertion("FSDP expects uniform original parameter dtype but got " +
                    dtype_set(orig_dtypes));
  }
  if (reduce_dtypes.size() > 1) {
    std::vector<at::ScalarType> named;
    for (const auto& dtype : reduce_dtypes) named.push_back(dtype.value_or(at::kFloat));
    raise_assertion("FSDP expects uniform reduce dtype but got " + dtype_set(named));
  }
  reduce_dtype_ = reduce_dtypes.empty() ? std::nullopt : reduce_dtypes.front();
  // The reduction order: parameters of one sharded grad dtype together, the
  // dtypes in the order they first appear.
  std::vector<std::optional<at::ScalarType>> grad_dtypes;
  for (const auto& param : params_) {
    if (std::find(grad_dtypes.begin(), grad_dtypes.end(), param->sharded_grad_dtype()) ==
        grad_dtypes.end()) {
      grad_dtypes.push_back(param->sharded_grad_dtype());
    }
  }
  reduce_order_.clear();
  for (const auto& dtype : grad_dtypes) {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i]->sharded_grad_dtype() == dtype) reduce_order_.push_back(i);
    }
  }
}

void FsdpParamGroup::set_reshard_after_forward(bool reshard, CollectiveGroup post_forward_group,
                                               std::vector<py::object> post_forward_specs) {
  TORCH_CHECK_VALUE(!post_forward_group || post_forward_specs.size() == params_.size(),
                    "fsdp_ext FsdpParamGroup(", module_fqn_, "): ", post_forward_specs.size(),
                    " post-forward specs for ", params_.size(), " parameters");
  // Parameters still on the old post-forward mesh go back to full sharding
  // first: the next unshard must not gather over a group that is gone.
  if (sharded_state_ == ShardedState::kShardedPostForward) to_sharded();
  reshard_after_forward_ = reshard;
  post_forward_group_ = reshard ? std::move(post_forward_group) : CollectiveGroup();
  if (post_forward_group_) post_forward_group_.set_custom_all_gather(custom_all_gather_);
  post_forward_specs_ = post_forward_group_ ? std::move(post_forward_specs)
                                            : std::vector<py::object>();
}

void FsdpParamGroup::set_custom_all_gather(py::object comm) {
  custom_all_gather_ = comm;
  shard_group_.set_custom_all_gather(comm);
  if (post_forward_group_) post_forward_group_.set_custom_all_gather(std::move(comm));
}

void FsdpParamGroup::set_custom_reduce_scatter(py::object comm) {
  custom_reduce_scatter_ = comm;
  shard_group_.set_custom_reduce_scatter(comm);
  if (reduce_scatter_group_) reduce_scatter_group_.set_custom_reduce_scatter(std::move(comm));
}

void FsdpParamGroup::set_reduce_scatter_group(CollectiveGroup group) {
  TORCH_CHECK_VALUE(!group || group.size() == shard_group_.size(), "fsdp_ext FsdpParamGroup(",
                    module_fqn_, "): a reduce-scatter group of ", group.size(),
                    " ranks for a shard group of ", shard_group_.size());
  reduce_scatter_group_ = std::move(group);
  if (reduce_scatter_group_) reduce_scatter_group_.set_custom_reduce_scatter(custom_reduce_scatter_);
}

void FsdpParamGroup::unshard() {
  if (pending_all_gather_ || sharded_state_ == ShardedState::kUnsharded) return;
  EventTrace::emit(TraceEvent::kUnshard, module_fqn_, training_state_);
  if (!options_.unshard_in_backward && training_state_ == TrainingState::kPreBackward) return;
  FsdpStreams* streams = comm_->streams();
  if (streams && reshard_after_forward_event_) {
    // The post-forward shards were written on the compute stream.
    streams->all_gather_streams_wait(reshard_after_forward_event_);
    reshard_after_forward_event_.reset();
  }
  const CollectiveGroup& group = sharded_state_ == ShardedState::kShardedPostForward
                                     ? post_forward_group_
                                     : shard_group_;
  PendingAllGather pending{at::Tensor(), {}, group.size(), {},
                           sharded_state_ == ShardedState::kSharded};
  if (pending.world_size > 1) {
    ProfilerRange range([&] { return profile_label("FSDP::all_gather"); });
    if (host_shared_) {
      unshard_host_shared(pending);
      pending_all_gather_ = std::move(pending);
      return;
    }
    if (per_parameter_on(group, CollectiveGroup::Purpose::kAllGather, pending.from_sharded)) {
      issue_per_parameter_all_gather(group, pending);
      pending_all_gather_ = std::move(pending);
      return;
    }
    // Note [which streams an unshard runs on]: a forward or backward unshard
    // (the group's own or a prefetch) copies in on the copy-in stream and
    // gathers on the all-gather stream, so both overlap the compute stream's
    // current module; an unshard outside them (FSDPModule.unshard) stays on
    // the compute stream, as upstream's.
    const bool side_streams = streams && (training_state_ == TrainingState::kForward ||
                                          training_state_ == TrainingState::kPreBackward);
    std::optional<c10::StreamGuard> on_copy_in;
    if (side_streams) on_copy_in.emplace(streams->all_gather_copy_in());
    std::vector<at::Tensor> inputs;
    std::vector<at::ScalarType> dtypes;
    inputs.reserve(params_.size());
    dtypes.reserve(params_.size());
    // One dtype for the flat buffer: the parameters' common unsharded dtype,
    // or bytes when they differ (as upstream).
    const at::ScalarType common = params_.front()->unsharded_dtype();
    at::ScalarType buffer_dtype = common;
    int64_t input_bytes = 0;
    const auto add_input = [&](at::Tensor input, at::ScalarType dtype) {
      if (dtype != common) buffer_dtype = at::kByte;
      pending.split_sizes.push_back(input.numel());
      input_bytes += input.numel() * static_cast<int64_t>(c10::elementSize(dtype));
      inputs.push_back(std::move(input));
      dtypes.push_back(dtype);
    };
    for (const auto& param : params_) {
      if (!param->has_extension()) {
        add_input(param->all_gather_input(), param->unsharded_dtype());
        pending.extension_inputs.emplace_back();
        continue;
      }
      // The pre hook's inputs, each gathered in its own dtype.
      std::vector<at::Tensor> extension_inputs = param->extension_inputs();
      for (const at::Tensor& input : extension_inputs) add_input(input, input.scalar_type());
      pending.extension_inputs.push_back(std::move(extension_inputs));
    }
    const int64_t input_numel = input_bytes / static_cast<int64_t>(c10::elementSize(buffer_dtype));
    pending.output = group.buffer(input_numel * pending.world_size,
                                  inputs.front().options().dtype(buffer_dtype),
                                  options_.allocate_from_group,
                                  CollectiveGroup::Purpose::kAllGather);
    at::Tensor input;
    {
      ProfilerRange copy_in([&] { return profile_label("FSDP::all_gather_copy_in"); });
      input = all_gather_copy_in(inputs, dtypes, pending.output, group.rank(), pending.world_size);
    }
    if (!streams) {
      pending.work = group.all_gather(pending.output, input);
    } else {
      const c10::Stream copy_in_stream = streams->current();
      on_copy_in.reset();
      const c10::Stream gather_stream = side_streams ? streams->all_gather() : copy_in_stream;
      streams->wait_stream(gather_stream, copy_in_stream);
      c10::StreamGuard on_gather(gather_stream);
      // As upstream's async_op=False: the gather stream waits for the
      // collective (a stream wait; the host goes on), and the compute
      // stream will wait for the gather stream's event before the copy-out.
      wait_releasing_gil(group.all_gather(pending.output, input));
      pending.gathered = streams->record(gather_stream);
    }
  }
  pending_all_gather_ = std::move(pending);
}

bool FsdpParamGroup::per_parameter_on(const CollectiveGroup& group,
                                      CollectiveGroup::Purpose purpose, bool from_sharded) const {
  if (!options_.per_parameter_collectives || group.size() == 1) return false;
  // All-gather extensions gather their own inputs, and the backend cannot
  // read a subclass tensor in place (Note [tensor subclass parameters]): the
  // flat path serves them.
  if (std::any_of(params_.begin(), params_.end(), [](const auto& param) {
        return param->has_extension() || is_python_subclass(param->padded_sharded_data());
      })) {
    return false;
  }
  // Host memory only: our CUDA path has no coalesced collectives.
  if (!params_.front()->padded_sharded_data().is_cpu()) return false;
  if (!group.is_ours(params_.front()->padded_sharded_data().device().type(), purpose)) {
    return false;
  }
  // A rank's rows of a dim-0 shard are one block of the padded parameter;
  // shards on another dim interleave with the other ranks' (post-forward
  // chunks are blocks of the unsharded data whatever the dim).
  if (!from_sharded) return true;
  return std::all_of(params_.begin(), params_.end(),
                     [](const auto& param) { return param->shard_dim() == 0; });
}

void FsdpParamGroup::issue_per_parameter_all_gather(const CollectiveGroup& group,
                                                    PendingAllGather& pending) {
  std::vector<at::Tensor> outputs;
  {
    // Only mixed precision copies here: the shard cast to the parameter dtype.
    ProfilerRange copy_in([&] { return profile_label("FSDP::all_gather_copy_in"); });
    for (const auto& param : params_) {
      at::Tensor input = param->all_gather_input();
      if (input.scalar_type() != param->unsharded_dtype()) {
        input = input.to(param->unsharded_dtype());
      }
      const at::Tensor& output = param->allocated_all_gather_output();
      TORCH_CHECK(output.numel() == input.numel() * pending.world_size, "fsdp_ext FsdpParamGroup(",
                  module_fqn_, "): parameter ", param->fqn(), " gathers ", input.numel(),
                  " elements from each of ", pending.world_size, " ranks into ", output.numel());
      outputs.push_back(output);
      pending.inputs.push_back(std::move(input));
    }
  }
  pending.per_parameter = true;
  pending.work = group.all_gather_coalesced(outputs, pending.inputs);
}

namespace {

// A parameter's bytes in the host-shared region, and the room it takes there
// (the next parameter starts 64-byte aligned).
int64_t host_shared_param_bytes(const FsdpParam& param) {
  return param.all_gather_output_numel() *
         static_cast<int64_t>(c10::elementSize(param.unsharded_dtype()));
}
int64_t host_shared_param_room(const FsdpParam& param) {
  return (host_shared_param_bytes(param) + 63) / 64 * 64;
}
// Shard-group rank `rank`'s slot of the parameter in this host's memory.
at::Tensor host_shared_slot(FsdpParam& param, int64_t rank) {
  const int64_t padded = param.padded_shard_numel();
  return param.allocated_all_gather_output().narrow(0, rank * padded, padded);
}

}  // namespace

int64_t FsdpParamGroup::host_shared_bytes() const {
  int64_t bytes = 0;
  for (const auto& param : params_) bytes += host_shared_param_room(*param);
  return bytes;
}

void FsdpParamGroup::use_host_shared(at::Tensor region, at::Tensor control,
                                     std::vector<int64_t> host_ranks,
                                     std::vector<int64_t> host_pids,
                                     std::vector<int64_t> column_ranks,
                                     std::chrono::milliseconds timeout) {
  const int64_t world = shard_group_.size();
  const int64_t rank = shard_group_.rank();
  const auto where = [&] { return "fsdp_ext FsdpParamGroup(" + module_fqn_ + ")"; };
  TORCH_CHECK_VALUE(host_pids.size() == host_ranks.size(), where(), ": ", host_pids.size(),
                    " pids for ", host_ranks.size(), " ranks on this host");
  TORCH_CHECK_VALUE(static_cast<int64_t>(host_ranks.size() * column_ranks.size()) == world,
                    where(), ": ", host_ranks.size(), " ranks per host times ",
                    column_ranks.size(), " hosts where the shard group has ", world);
  const auto position = [&](const std::vector<int64_t>& ranks) {
    const auto it = std::find(ranks.begin(), ranks.end(), rank);
    TORCH_CHECK_VALUE(it != ranks.end(), where(), ": rank ", rank, " is not in ", ranks);
    return static_cast<int64_t>(it - ranks.begin());
  };
  const int64_t local = position(host_ranks);
  position(column_ranks);
  TORCH_CHECK_VALUE(region.scalar_type() == at::kByte && region.dim() == 1 &&
                        region.numel() == host_shared_bytes(),
                    where(), ": a host-shared region of ", region.numel(),
                    " bytes where the parameters need ", host_shared_bytes());
  TORCH_CHECK_NOT_IMPLEMENTED(column_ranks.size() == 1 || !shard_group_.python_impl(), where(),
                              ": host-shared parameters across hosts need a process group "
                              "with a C++ backend (this one is implemented in Python)");
  for (const auto& param : params_) {
    TORCH_CHECK_NOT_IMPLEMENTED(!param->has_extension(), where(), ": ", param->fqn(),
                                " has an all-gather extension, which host-shared parameters "
                                "do not support");
    // Host-shared memory is filled and compared in place.
    TORCH_CHECK_NOT_IMPLEMENTED(!is_python_subclass(param->padded_sharded_data()), where(), ": ",
                                param->fqn(), " is a tensor subclass (or a fake tensor), which "
                                "host-shared parameters do not support");
    // A rank's shard of a dim-d > 0 parameter is not one block of it.
    TORCH_CHECK_NOT_IMPLEMENTED(param->shard_dim() == 0, where(),
                                ": host-shared parameters need every parameter sharded on dim "
                                "0; ", param->fqn(), " is sharded on dim ", param->shard_dim());
  }
  int64_t offset = 0;
  for (const auto& param : params_) {
    param->use_host_shared_output(region.narrow(0, offset, host_shared_param_bytes(*param))
                                      .view(param->unsharded_dtype()));
    offset += host_shared_param_room(*param);
  }
  host_shared_column_peers_.clear();
  for (int64_t peer : column_ranks) {
    if (peer != rank) host_shared_column_peers_.push_back(peer);
  }
  host_shared_ = std::make_unique<HostSharedParameters>(
      std::move(control), local, host_ranks, host_pids, timeout,
      "fsdp_ext host-shared parameters of " + (module_fqn_.empty() ? "the root" : module_fqn_));
}

void FsdpParamGroup::unshard_host_shared(PendingAllGather& pending) {
  const int64_t rank = shard_group_.rank();
  ++host_shared_epoch_;
  // Note [the backward reuses the forward's host-shared values]: across
  // hosts, a backward unshard whose slots are current sends flags only.
  const bool across_hosts = !host_shared_column_peers_.empty();
  const bool in_backward = training_state_ == TrainingState::kPreBackward;
  const bool unchanged = across_hosts && in_backward && host_shared_slots_current();
  if (unchanged) {
    host_shared_->enter_unchanged(host_shared_epoch_);
  } else {
    host_shared_->enter(host_shared_epoch_);
    ProfilerRange copy_in([&] { return profile_label("FSDP::all_gather_copy_in"); });
    for (const auto& param : params_) {
      at::Tensor slot = host_shared_slot(*param, rank);
      // Raw: no version-counter bump on the parameters autograd saved.
      copy_cast_raw(slot.data_ptr(), slot.scalar_type(), param->padded_sharded_data());
    }
  }
  pending.per_parameter = true;  // the parameters' memory is written: no copy-out
  if (!across_hosts) {
    host_shared_->publish(host_shared_epoch_);
    return;
  }
  // Note [host-shared parameters across hosts] (host_shared_parameters.hpp):
  // this rank's slots go to its column peers, theirs come straight into
  // this host's memory; published once they are in (wait_for_unshard).
  pending.across_hosts = true;
  if (!in_backward) {
    for (int64_t peer : host_shared_column_peers_) {
      receive_host_shared_slots(peer, pending.column_exchange);
      send_host_shared_slots(peer, pending.column_exchange);
    }
    return;
  }
  // In backward, a flag per peer first; data only where it changed.
  const auto peers = static_cast<int64_t>(host_shared_column_peers_.size());
  pending.column_flags = at::empty({peers}, at::TensorOptions().dtype(at::kLong));
  at::Tensor flag = at::full({1}, unchanged ? 0 : 1, at::TensorOptions().dtype(at::kLong));
  pending.inputs.push_back(flag);  // alive until the sends complete
  for (int64_t i = 0; i < peers; ++i) {
    const int64_t peer = host_shared_column_peers_[i];
    at::Tensor theirs = pending.column_flags.narrow(0, i, 1);
    pending.column_flag_receives.push_back(
        shard_group_.recv(theirs, peer, HostSharedParameters::kColumnFlagTag));
    pending.column_exchange.push_back(
        shard_group_.send(flag, peer, HostSharedParameters::kColumnFlagTag));
    if (!unchanged) send_host_shared_slots(peer, pending.column_exchange);
  }
}

bool FsdpParamGroup::host_shared_slots_current() {
  ProfilerRange range([&] { return profile_label("FSDP::host_shared_compare"); });
  const int64_t rank = shard_group_.rank();
  for (const auto& param : params_) {
    at::Tensor slot = host_shared_slot(*param, rank);
    if (!equals_cast_raw(slot.data_ptr(), slot.scalar_type(), param->padded_sharded_data())) {
      return false;
    }
  }
  return true;
}

void FsdpParamGroup::send_host_shared_slots(int64_t peer, std::vector<WorkPtr>& works) {
  const int64_t rank = shard_group_.rank();
  for (const auto& param : params_) {
    at::Tensor mine = host_shared_slot(*param, rank);
    works.push_back(shard_group_.send(mine, peer, HostSharedParameters::kColumnTag));
  }
}

void FsdpParamGroup::receive_host_shared_slots(int64_t peer, std::vector<WorkPtr>& works) {
  for (const auto& param : params_) {
    at::Tensor theirs = host_shared_slot(*param, peer);
    works.push_back(shard_group_.recv(theirs, peer, HostSharedParameters::kColumnTag));
  }
}

void FsdpParamGroup::finish_column_exchange(PendingAllGather& pending) {
  for (const WorkPtr& work : pending.column_flag_receives) wait_releasing_gil(work);
  if (pending.column_flags.defined()) {
    const int64_t* flags = pending.column_flags.data_ptr<int64_t>();
    for (size_t i = 0; i < host_shared_column_peers_.size(); ++i) {
      if (flags[i] == 0) continue;
      // This rank may have entered without waiting (its own slots were
      // unchanged); the peer's slots it now receives are writes.
      host_shared_->wait_until_all_entered(host_shared_epoch_);
      receive_host_shared_slots(host_shared_column_peers_[i], pending.column_exchange);
    }
  }
  for (const WorkPtr& work : pending.column_exchange) wait_releasing_gil(work);
  host_shared_->publish(host_shared_epoch_);
}

void FsdpParamGroup::wait_for_unshard() {
  if (!pending_all_gather_) return;
  PendingAllGather pending = std::move(*pending_all_gather_);
  pending_all_gather_.reset();
  FsdpStreams* streams = comm_->streams();
  if (streams && training_state_ == TrainingState::kForward) {
    // Note [keeping collective buffers alive across streams]: the previous
    // forward group's all-gather output is free once its copy-out is done.
    comm_->release_all_gather_state();
  }
  if (streams) FsdpStreams::wait_event(streams->current(), pending.gathered);
  if (pending.world_size == 1) {
    // Nothing to gather: copy (cast) each shard into its own unsharded
    // storage, which reshard can release without touching the sharded data.
    // The copy keeps the version counter unchanged, as autograd's saved
    // tensors expect.
    for (const auto& param : params_) {
      if (param->has_extension()) {
        const std::vector<at::Tensor> inputs = param->extension_inputs();
        const std::vector<at::Tensor> outputs = param->extension_outputs(inputs, 1);
        for (size_t i = 0; i < inputs.size(); ++i) copy_cast_into(outputs[i], inputs[i]);
        continue;
      }
      copy_cast_into(param->allocated_all_gather_output(), param->all_gather_input());
    }
  } else if (pending.per_parameter) {
    // The collective wrote the parameters' own storage: nothing to copy.
    ProfilerRange range([&] { return profile_label("FSDP::all_gather_wait"); });
    wait_releasing_gil(pending.work);
    if (pending.across_hosts) finish_column_exchange(pending);
  } else {
    ProfilerRange range([&] { return profile_label("FSDP::all_gather_copy_out"); });
    wait_releasing_gil(pending.work);
    std::vector<at::Tensor> outputs;
    std::vector<int64_t> shard_dims;
    outputs.reserve(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& param = params_[i];
      if (param->has_extension()) {
        // One output per input. Sharded on dim d > 0 (evenly: checked at
        // fully_shard), each input has the shard's shape, so its output is
        // laid out as the unsharded parameter's shape and filled along d, as
        // upstream's chunk-cat does.
        const int64_t dim = param->shard_dim();
        for (at::Tensor& output :
             param->extension_outputs(pending.extension_inputs[i], pending.world_size)) {
          if (dim != 0) {
            TORCH_CHECK_VALUE(output.numel() == c10::multiply_integers(param->orig_size()),
                              "fsdp_ext FsdpParamGroup(", module_fqn_, "): parameter ",
                              param->fqn(), " is sharded on dim ", dim, ", so its all-gather "
                              "extension's inputs must have the shard's shape; one has ",
                              output.numel() / pending.world_size, " elements, the shard ",
                              param->padded_shard_numel());
            output = output.view(param->orig_size());
          }
          outputs.push_back(std::move(output));
          shard_dims.push_back(dim);
        }
        continue;
      }
      const int64_t dim = pending.from_sharded ? param->shard_dim() : 0;
      const at::Tensor& output = param->allocated_all_gather_output();
      outputs.push_back(dim == 0 ? output : output.view(param->orig_size()));
      shard_dims.push_back(dim);
    }
    pending.extension_inputs.clear();
    all_gather_copy_out(pending.output, pending.split_sizes, pending.world_size, outputs,
                        shard_dims);
  }
  for (const auto& param : params_) param->init_unsharded_param();
  to_unsharded();
  if (streams && pending.output.defined()) {
    StreamEvent copied_out = streams->record(streams->current());
    if (training_state_ == TrainingState::kForward) {
      // Kept until the next group's copy-out: its all-gather may overlap
      // this copy-out (the root's post-forward releases the last one).
      comm_->all_gather_state = HeldBuffer{std::move(pending.output), std::move(copied_out)};
    } else {
      streams->all_gather_streams_wait(copied_out);
    }
  }
}

void FsdpParamGroup::reshard() {
  if (training_state_ == TrainingState::kForward && !reshard_after_forward_) return;
  EventTrace::emit(TraceEvent::kReshard, module_fqn_, training_state_);
  // Host-shared parameters need no post-forward copy: the memory stays.
  if (training_state_ == TrainingState::kForward && uses_post_forward_mesh() && !host_shared_) {
    to_sharded_post_forward();
    // The post-forward shards are written on the compute stream and read by
    // the next unshard's copy-in on the copy-in stream.
    if (FsdpStreams* streams = comm_->streams()) {
      reshard_after_forward_event_ = streams->record(streams->current());
    }
    return;
  }
  to_sharded();
}

void FsdpParamGroup::pre_forward() {
  ProfilerRange range([&] { return profile_label("FSDP::pre_forward"); });
  training_state_ = TrainingState::kForward;
  unshard();
  wait_for_unshard();
}

void FsdpParamGroup::post_forward(bool inside_backward) {
  ProfilerRange range([&] { return profile_label("FSDP::post_forward"); });
  // Activation-checkpoint recomputation runs forward hooks inside backward;
  // it must neither reshard nor change the forward order.
  if (!inside_backward) {
    reshard();
    post_forward_indices_.push_back(comm_->post_forward_order.size());
    comm_->post_forward_order.push_back(weak_from_this());
  }
  training_state_ = TrainingState::kIdle;
}

void FsdpParamGroup::pre_backward() {
  // Called for every output gradient of the module: the unshard once, the
  // explicit prefetches each time (no-ops once issued), as upstream.
  if (training_state_ != TrainingState::kPreBackward) {
    ProfilerRange range([&] { return profile_label("FSDP::pre_backward"); });
    training_state_ = TrainingState::kPreBackward;
    unshard();
    wait_for_unshard();
    if (!explicit_backward_prefetch_) backward_prefetch();
  }
  for (const auto& weak : backward_prefetch_) {
    if (auto target = weak.lock()) target->prefetch_unshard(TrainingState::kPreBackward);
  }
}

namespace {
std::vector<std::weak_ptr<FsdpParamGroup>> weak_all(
    const std::vector<std::shared_ptr<FsdpParamGroup>>& groups) {
  return {groups.begin(), groups.end()};
}
}  // namespace

void FsdpParamGroup::set_forward_prefetch(std::vector<std::shared_ptr<FsdpParamGroup>> targets) {
  forward_prefetch_ = weak_all(targets);
}

void FsdpParamGroup::set_backward_prefetch(std::vector<std::shared_ptr<FsdpParamGroup>> targets,
                                           bool replaces_implicit) {
  backward_prefetch_ = weak_all(targets);
  explicit_backward_prefetch_ = replaces_implicit;
}

void FsdpParamGroup::prefetch_forward_targets() {
  for (const auto& weak : forward_prefetch_) {
    if (auto target = weak.lock()) target->prefetch_unshard(TrainingState::kForward);
  }
}

void FsdpParamGroup::backward_prefetch() {
  if (training_state_ != TrainingState::kPreBackward || post_forward_indices_.empty()) return;
  const size_t index = post_forward_indices_.back();
  post_forward_indices_.pop_back();
  if (index == 0) return;
  if (auto target = comm_->post_forward_order[index - 1].lock()) {
    target->prefetch_unshard(TrainingState::kPreBackward);
  }
}

void FsdpParamGroup::prefetch_unshard(TrainingState state) {
  ProfilerRange range([&] {
    const char* pass = state == TrainingState::kForward ? "forward" : "backward";
    return std::string("FSDP::") + pass + "_prefetch for " + module_fqn_;
  });
  const TrainingState previous = training_state_;
  training_state_ = state;
  try {
    unshard();
  } catch (...) {
    training_state_ = previous;
    throw;
  }
  training_state_ = previous;
}

void FsdpParamGroup::run_pre_backward() {
  pre_backward_method_.call([this] { pre_backward(); });
}

void FsdpParamGroup::run_post_backward() {
  post_backward_method_.call([this] { post_backward(); });
}

void FsdpParamGroup::post_backward() {
  training_state_ = TrainingState::kPostBackward;
  post_backward_pending_ = !options_.reduce_grads;
  {
    ProfilerRange range([&] { return profile_label("FSDP::post_backward_accumulate"); });
    for (const auto& param : params_) param->accumulate_unsharded_grad_if_needed();
  }
  std::vector<std::shared_ptr<FsdpParam>> with_grad;
  std::vector<at::Tensor> grads;
  std::optional<ProfilerRange> reshard_range;
  reshard_range.emplace([&] { return profile_label("FSDP::post_backward_reshard"); });
  if (options_.reduce_grads) {
    if (options_.reduce_scatter_unused_params) check_unused_param_grad_dtypes();
    // Take the gradients before resharding; they stay valid without the
    // unsharded storage.
    for (size_t index : reduce_order_) {
      const std::shared_ptr<FsdpParam>& param = params_[index];
      at::Tensor grad = param->take_unsharded_grad();
      if (!grad.defined() && options_.reduce_scatter_unused_params &&
          param->has_unsharded_param() && param->requires_grad()) {
        // Every rank must issue the same reduce-scatter even where this
        // rank's forward did not use the parameter (conditional branches).
        grad = param->zero_unsharded_grad();
      }
      if (!grad.defined()) continue;
      with_grad.push_back(param);
      grads.push_back(std::move(grad));
    }
  }
  // Without gradient sync the gradients stay on the unsharded parameters (or
  // in reduce_dtype accumulators) until a step that reduces.
  if (options_.reshard_after_backward) reshard();
  if (!options_.reduce_grads) {
    for (const auto& param : params_) param->to_accumulated_grad_if_needed();
    reshard_range.reset();
  } else {
    reshard_range.reset();
    // Earlier groups' reduce-scatters overlapped this group's backward;
    // finish the oldest until fewer than the cap remain in flight (one by
    // default, as upstream keeps), each holding its input buffer.
    const size_t keep = static_cast<size_t>(comm_->max_reduces_in_flight() - 1);
    if (comm_->reduces_in_flight() > keep || comm_->reduce_scatter_states.size() > keep) {
      // Upstream names this one with the parentheses even for the root.
      ProfilerRange range([&] { return "FSDP::post_backward_rs_wait (" + module_fqn_ + ")"; });
      comm_->finish_reduces(keep);
      comm_->release_reduce_scatter_states(keep);
    }
    if (!grads.empty()) {
      ProfilerRange range([&] { return profile_label("FSDP::post_backward_reduce"); });
      reduce_gradients(std::move(with_grad), std::move(grads));
    }
  }
  EventTrace::emit(TraceEvent::kPostBackward, module_fqn_, training_state_);
}

void FsdpParamGroup::check_unused_param_grad_dtypes() const {
  if (!torch_compat::kGradDtypePolicies || reduce_dtype_) return;
  for (const auto& param : params_) {
    TORCH_CHECK_VALUE(!param->requires_grad() || param->unsharded_grad_dtype(),
                      "fsdp_ext fully_shard(", module_fqn_, "): set_reduce_scatter_unused_params "
                      "needs MixedPrecisionPolicy.reduce_dtype where a parameter's grad_dtype is "
                      "None (", param->fqn(), "): the zeros an unused parameter contributes must "
                      "have one dtype on every rank. Set reduce_dtype to the dtype its gradients "
                      "have.");
  }
}

at::ScalarType FsdpParamGroup::reduce_dtype_of(
    const std::vector<std::shared_ptr<FsdpParam>>& params,
    const std::vector<at::Tensor>& grads) const {
  if (!torch_compat::kGradDtypePolicies) {
    // Checked at run time, as upstream does: a real error when, say, fp8
    // weights do not produce gradients of the higher precision.
    const at::ScalarType grad_dtype = grads.front().scalar_type();
    for (const at::Tensor& grad : grads) {
      if (grad.scalar_type() != grad_dtype) {
        raise_assertion("FSDP reduce-scatter expects uniform gradient dtype but got " +
                        dtype_set({grad_dtype, grad.scalar_type()}) + " in " + module_fqn_);
      }
    }
    return reduce_dtype_.value_or(grad_dtype);
  }
  if (reduce_dtype_) return *reduce_dtype_;
  // The unsharded grad dtypes agree across ranks, where gradients may not (a
  // fresh gradient is not upcast yet: Note [a wider gradient dtype]). The
  // held partial sum has an earlier backward's reduce dtype, which this one
  // must not narrow.
  at::ScalarType promoted = params.front()->unsharded_grad_dtype().value_or(
      grads.front().scalar_type());
  for (size_t i = 1; i < params.size(); ++i) {
    promoted = at::promoteTypes(
        promoted, params[i]->unsharded_grad_dtype().value_or(grads[i].scalar_type()));
  }
  if (partial_reduce_output_.defined()) {
    promoted = at::promoteTypes(promoted, partial_reduce_output_.scalar_type());
  }
  return promoted;
}

void FsdpParamGroup::reduce_gradients(std::vector<std::shared_ptr<FsdpParam>> params,
                                      std::vector<at::Tensor> grads) {
  const at::ScalarType reduce_dtype = reduce_dtype_of(params, grads);
  const CollectiveGroup& group = reduce_scatter_group();
  const int64_t world = group.size();
  const int64_t replicas = replicate_group_ ? replicate_group_.size() : 0;
  PendingReduce reduce;
  reduce.group = shared_from_this();
  reduce.factors = reduce_factors(reduce_dtype, world, replicas, options_.gradient_divide_factor,
                                  options_.force_sum_reduction_for_comms);
  reduce.all_reduce = options_.all_reduce_grads;
  const ReduceFactors& factors = reduce.factors;
  int64_t row_numel = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].is_contiguous()) grads[i] = grads[i].contiguous();
    row_numel += params[i]->padded_shard_numel();
  }
  const at::TensorOptions options = grads.front().options().dtype(reduce_dtype);
  const c10::DeviceType device = grads.front().device().type();
  // Dividing by the group size is AVG: where the backend's AVG is that same
  // divide, it makes it inside the reduction instead of a pass here.
  // On a device mesh NCCL's AVG too: upstream asks for it, and NCCL's
  // rounding differs from a SUM and a divide.
  const bool average =
      world > 1 && factors.reduce_scatter_divide && *factors.reduce_scatter_divide == world &&
      !factors.pre_multiply &&
      (device == c10::DeviceType::CPU
           ? group.is_ours(device, CollectiveGroup::Purpose::kReduceScatter)
           : group.averages(device, CollectiveGroup::Purpose::kReduceScatter));
  if (average) reduce.factors.reduce_scatter_divide.reset();
  if (reduces_in_place(params, grads, world, factors, reduce_dtype)) {
    // Note [a gradient that is its own shard]: one shard rank, no replicas,
    // no factor, no cast, no hook, on the host: the reduction is the
    // identity, so each gradient becomes its shard as it is (contiguous,
    // above), with no packing into a flat buffer and no copy; upstream
    // copies it in and out, to the same values. The gradient was taken from
    // the unsharded parameter and owns its storage, so nothing else refers
    // to it.
    for (size_t i = 0; i < grads.size(); ++i) {
      const at::IntArrayRef shard_size(params[i]->sharded_size());
      params[i]->accumulate_sharded_grad(
          grads[i].sizes() == shard_size ? grads[i] : grads[i].view(shard_size));
    }
    return;
  }
  if (world > 1 && !factors.pre_divide && !factors.pre_multiply &&
      per_parameter_on(group, CollectiveGroup::Purpose::kReduceScatter, /*from_sharded=*/true)) {
    reduce.output = group.buffer(row_numel, options, options_.allocate_from_group,
                                 CollectiveGroup::Purpose::kReduceScatter);
    std::vector<at::Tensor> outputs;
    {
      ProfilerRange copy_in([&] { return profile_label("FSDP::reduce_scatter_copy_in"); });
      int64_t offset = 0;
      for (size_t i = 0; i < grads.size(); ++i) {
        const int64_t padded = params[i]->padded_shard_numel();
        at::Tensor flat = grads[i].view(-1);  // contiguous (above)
        // Read where it lies when it already is the padded parameter's
        // layout; otherwise one copy, padded with zeros (and cast).
        if (flat.scalar_type() != reduce_dtype || flat.numel() != padded * world) {
          at::Tensor laid_out = at::empty({padded * world}, options);
          laid_out.narrow(0, 0, flat.numel()).copy_(flat);
          laid_out.narrow(0, flat.numel(), padded * world - flat.numel()).zero_();
          flat = std::move(laid_out);
        }
        reduce.member_inputs.push_back(std::move(flat));
        outputs.push_back(reduce.output.narrow(0, offset, padded));
        offset += padded;
      }
    }
    grads.clear();
    reduce.work = group.reduce_scatter_coalesced(outputs, reduce.member_inputs, average);
    reduce.params = std::move(params);
    comm_->add_reduce(std::move(reduce));
    return;
  }
  std::vector<int64_t> shard_dims;
  for (const auto& param : params) shard_dims.push_back(param->shard_dim());
  reduce.input = group.buffer(row_numel * world, options, options_.allocate_from_group,
                                    CollectiveGroup::Purpose::kReduceScatter);
  {
    ProfilerRange copy_in([&] { return profile_label("FSDP::reduce_scatter_copy_in"); });
    reduce_scatter_copy_in(grads, world, reduce.input, shard_dims);
  }
  grads.clear();  // the unsharded gradients are no longer needed
  if (FsdpStreams* streams = comm_->streams()) {
    reduce.params = std::move(params);
    reduce_on_streams(*streams, std::move(reduce), world, average);
    return;
  }
  if (factors.pre_divide) reduce.input.div_(*factors.pre_divide);
  if (world > 1) {
    reduce.output = group.buffer(row_numel, options, options_.allocate_from_group,
                                 CollectiveGroup::Purpose::kReduceScatter);
    reduce.work = group.reduce_scatter(reduce.output, reduce.input, factors.pre_multiply, average);
  } else {
    // The shard is the whole gradient: nothing to reduce-scatter.
    reduce.output = std::move(reduce.input);
    if (factors.single_rank_divide) reduce.output.div_(*factors.single_rank_divide);
  }
  reduce.params = std::move(params);
  if (!reduce.work && !replicate_group_) {
    complete_reduce(std::move(reduce));  // no collective to overlap
  } else {
    comm_->add_reduce(std::move(reduce));
  }
}

bool FsdpParamGroup::reduces_in_place(const std::vector<std::shared_ptr<FsdpParam>>& params,
                                      const std::vector<at::Tensor>& grads, int64_t world,
                                      const ReduceFactors& factors,
                                      at::ScalarType reduce_dtype) const {
  if (world != 1 || replicate_group_ || comm_->streams() != nullptr) return false;
  if (all_reduce_hook_ && !all_reduce_hook_.is_none()) return false;  // it sees the flat buffer
  // A custom reduce-scatter allocates the buffer, at world size 1 too.
  if (reduce_scatter_group().has_custom_comm()) return false;
  if (factors.pre_divide || factors.pre_multiply || factors.single_rank_divide ||
      factors.reduce_scatter_divide || factors.all_reduce_divide || factors.post_divide) {
    return false;
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& grad = grads[i];
    // No cast on the way in nor back (sharded grad dtype None: kept as it is).
    if (grad.scalar_type() != reduce_dtype ||
        params[i]->sharded_grad_dtype().value_or(reduce_dtype) != reduce_dtype) {
      return false;
    }
    // On the host, unpadded: the shard is the whole gradient. Copied as
    // upstream copies: a gradient with a history (create_graph); a tensor
    // subclass (an all-gather extension's), whose copy-in makes it plain; a
    // view into a larger storage (the gradient of a slice of torch.cat's
    // output), which would keep that storage alive and share it.
    if (!grad.is_cpu() || grad.requires_grad() || params[i]->has_extension() ||
        grad.key_set().has(c10::DispatchKey::Python) ||
        grad.numel() != params[i]->padded_shard_numel() || grad.storage_offset() != 0 ||
        grad.storage().nbytes() != grad.nbytes()) {
      return false;
    }
  }
  return true;
}

void FsdpParamGroup::reduce_on_streams(FsdpStreams& streams, PendingReduce reduce,
                                       int64_t world, bool average) {
  // Note [a reduction on the side streams]: the copy-in ran on the compute
  // stream (so the unsharded gradients could be dropped by the host); the
  // reduce-scatter stream waits for it, reduces, and finishes the reduction
  // in its own order (divide, HSDP all-reduce on the all-reduce stream, cast,
  // accumulate), with no host wait. The compute stream waits for the last
  // post-reduce event at the end of backward; the input is held until the
  // compute stream has waited for the reduce-scatter (comm_context.hpp).
  const ReduceFactors& factors = reduce.factors;
  const c10::Stream reduce_scatter_stream = streams.reduce_scatter();
  streams.wait_stream(reduce_scatter_stream, streams.current());
  c10::StreamGuard on_reduce_scatter(reduce_scatter_stream);
  if (factors.pre_divide) reduce.input.div_(*factors.pre_divide);
  const CollectiveGroup& group = reduce_scatter_group();
  if (world > 1) {
    reduce.output = group.buffer(reduce.input.numel() / world, reduce.input.options(),
                                 options_.allocate_from_group,
                                 CollectiveGroup::Purpose::kReduceScatter);
    wait_releasing_gil(
        group.reduce_scatter(reduce.output, reduce.input, factors.pre_multiply, average));
  } else {
    // Nothing to reduce-scatter: the output is a copy on this stream, as
    // upstream's, not the input itself (allocated on the compute stream,
    // which could reuse it while this stream still works on it).
    reduce.output = at::empty_like(reduce.input);
    reduce.output.copy_(reduce.input);
    if (factors.single_rank_divide) reduce.output.div_(*factors.single_rank_divide);
  }
  comm_->reduce_scatter_states.push_back(
      HeldBuffer{std::move(reduce.input), streams.record(reduce_scatter_stream)});
  reduce.input = at::Tensor();
  complete_reduce(std::move(reduce));
}

void FsdpParamGroup::complete_reduce(PendingReduce reduce) {
  // Upstream finishes a reduction inside its post_backward_reduce range (the
  // stream does the waiting); ours finishes later, under its own name.
  ProfilerRange range([&] { return profile_label("FSDP::post_backward_reduce_complete"); });
  const ReduceFactors& factors = reduce.factors;
  wait_releasing_gil(reduce.work);
  reduce.input = at::Tensor();
  reduce.member_inputs.clear();
  at::Tensor output = std::move(reduce.output);
  // On the side streams (reduce_on_streams): the stream this reduction ends
  // on, whose event the compute stream waits for at the end of backward.
  FsdpStreams* streams = comm_->streams();
  std::optional<c10::StreamGuard> on_all_reduce;
  // The output as allocated (on the reduce-scatter stream): the cast and the
  // accumulation below may drop it while the stream they run on, the
  // all-reduce stream under HSDP, still uses it.
  const at::Tensor allocated = streams ? output : at::Tensor();
  const auto mark_post_reduce = [&] {
    if (!streams) return;
    const c10::Stream stream = streams->current();
    StreamEvent done = streams->record(stream);
    if (stream != streams->reduce_scatter()) comm_->post_reduce_buffers.push_back({allocated, done});
    comm_->add_post_reduce_event(stream, std::move(done));
  };
  if (factors.reduce_scatter_divide) output.div_(*factors.reduce_scatter_divide);
  if (replicate_group_) {
    if (!reduce.all_reduce) {
      // Accumulate locally; a later backward all-reduces the sum.
      if (partial_reduce_output_.defined() &&
          partial_reduce_output_.scalar_type() != output.scalar_type()) {
        // A wider reduce dtype than the held sum's (reduce_dtype_of).
        partial_reduce_output_ = partial_reduce_output_.to(output.scalar_type());
      }
      if (partial_reduce_output_.defined()) {
        partial_reduce_output_.add_(output);
      } else {
        partial_reduce_output_ = output;
      }
      mark_post_reduce();
      return;
    }
    if (partial_reduce_output_.defined()) {
      // Of this reduction's dtype or a narrower one (reduce_dtype_of).
      output.add_(partial_reduce_output_);
      partial_reduce_output_ = at::Tensor();
    }
    if (streams) {
      streams->wait_stream(streams->all_reduce(), streams->current());
      on_all_reduce.emplace(streams->all_reduce());
    }
    // NCCL divides in its kernel (AVG) where upstream asks it to.
    const c10::DeviceType device = output.device().type();
    const bool average = factors.all_reduce_divide && device != c10::DeviceType::CPU &&
                         replicate_group_.averages(device, CollectiveGroup::Purpose::kAllReduce);
    wait_releasing_gil(replicate_group_.all_reduce(output, average));
    if (factors.all_reduce_divide && !average) output.div_(*factors.all_reduce_divide);
  }
  if (all_reduce_hook_ && !all_reduce_hook_.is_none()) {
    // set_all_reduce_hook: after the reduce-scatter (FSDP) or the all-reduce
    // (HSDP), before the final divide, in place, as upstream runs it.
    py::gil_scoped_acquire gil;
    all_reduce_hook_(output);
  }
  if (factors.post_divide) output.div_(*factors.post_divide);
  accumulate_reduced_shards(reduce.params, output);
  mark_post_reduce();
}

// Note [casting reduced shards back]
// Each parameter's reduced shard becomes, or is added to, its sharded
// gradient in its sharded grad dtype. Parameters are packed by that dtype
// (reduce_order_), so the output is a run per dtype: a run in the reduce
// dtype (or whose dtype is any) is viewed where it lies, any other is cast
// once into a buffer of its own. Views of an uncast run keep the whole
// output alive, the cast runs' regions too; where those are the larger part
// the uncast runs are copied instead, so that the output can go (upstream
// makes the same choice).
void FsdpParamGroup::accumulate_reduced_shards(const std::vector<std::shared_ptr<FsdpParam>>& params,
                                               const at::Tensor& output) {
  const at::ScalarType reduce_dtype = output.scalar_type();
  const auto run_dtype = [&](const FsdpParam& param) {
    return param.sharded_grad_dtype().value_or(reduce_dtype);
  };
  int64_t cast_numel = 0;
  for (const auto& param : params) {
    if (run_dtype(*param) != reduce_dtype) cast_numel += param->padded_shard_numel();
  }
  const bool copy_uncast = cast_numel > output.numel() - cast_numel;
  int64_t offset = 0;
  for (size_t begin = 0; begin < params.size();) {
    const at::ScalarType dtype = run_dtype(*params[begin]);
    size_t end = begin;
    int64_t run_numel = 0;
    while (end < params.size() && run_dtype(*params[end]) == dtype) {
      run_numel += params[end++]->padded_shard_numel();
    }
    at::Tensor run = output.narrow(0, offset, run_numel);
    if (dtype != reduce_dtype) {
      run = run.to(dtype);
    } else if (copy_uncast) {
      run = run.clone();
    }
    int64_t run_offset = 0;
    for (size_t i = begin; i < end; ++i) {
      const FsdpParam& param = *params[i];
      const int64_t shard_numel = c10::multiply_integers(param.sharded_size());
      params[i]->accumulate_sharded_grad(
          run.narrow(0, run_offset, shard_numel).view(param.sharded_size()));
      run_offset += param.padded_shard_numel();
    }
    offset += run_numel;
    begin = end;
  }
}

std::string FsdpParamGroup::profile_label(const char* phase) const {
  std::string label(phase);
  if (!module_fqn_.empty()) label += " (" + module_fqn_ + ")";
  return label + profile_label_suffix_;
}

void FsdpParamGroup::drop_pending_all_gather() {
  if (!pending_all_gather_) return;
  PendingAllGather pending = std::move(*pending_all_gather_);
  pending_all_gather_.reset();
  // The output was allocated on the copy-in stream and is dropped here: the
  // copy-in stream may reuse it only after the gather (as upstream, the
  // compute stream waits for it too).
  if (FsdpStreams* streams = comm_->streams()) {
    FsdpStreams::wait_event(streams->current(), pending.gathered);
    streams->all_gather_streams_wait(pending.gathered);
  }
  wait_releasing_gil(pending.work);
  // Every rank drops the same prefetch: each completes its part of the
  // epoch, so its messages cannot be taken for the next one's.
  if (pending.across_hosts) finish_column_exchange(pending);
}

void FsdpParamGroup::finish_backward(bool is_last_backward, bool defer_reduction) {
  // A group autograd never reached (its inputs need no gradient, or its
  // module was unused) still reduces what it has, now or, deferred, at the
  // caller's finalize_backward.
  if (training_state_ != TrainingState::kPostBackward) {
    if (defer_reduction && options_.reduce_grads) {
      post_backward_pending_ = true;
    } else {
      run_post_backward();
    }
  }
  training_state_ = TrainingState::kIdle;
  if (is_last_backward) finalize_backward();
}

void FsdpParamGroup::finalize_backward() {
  // A prefetch whose module never ran (mistargeted): complete and drop it.
  drop_pending_all_gather();
  post_forward_indices_.clear();
}

void FsdpParamGroup::reset_iter_state() {
  drop_pending_all_gather();
  if (FsdpStreams* streams = comm_->streams()) {
    streams->all_gather_streams_wait(reshard_after_forward_event_);
  }
  reshard_after_forward_event_.reset();
  partial_reduce_output_ = at::Tensor();
  post_backward_pending_ = false;
  // The failed iteration's gradients must not be reduced with the next one.
  for (const auto& param : params_) param->drop_unsharded_grad();
  post_forward_indices_.clear();
  training_state_ = TrainingState::kIdle;
  to_sharded();
}

void FsdpParamGroup::reset_sharded_params() {
  for (const auto& param : params_) param->reset_sharded_param();
}

void FsdpParamGroup::to_sharded() {
  if (sharded_state_ == ShardedState::kSharded) return;
  for (const auto& param : params_) param->to_sharded();
  sharded_state_ = ShardedState::kSharded;
}

void FsdpParamGroup::to_sharded_post_forward() {
  if (sharded_state_ == ShardedState::kShardedPostForward) return;
  const int64_t rank = post_forward_group_.rank();
  const int64_t world = post_forward_group_.size();
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i]->to_sharded_post_forward(rank, world, post_forward_specs_[i]);
  }
  sharded_state_ = ShardedState::kShardedPostForward;
}

void FsdpParamGroup::to_unsharded() {
  if (sharded_state_ == ShardedState::kUnsharded) return;
  for (const auto& param : params_) param->to_unsharded();
  sharded_state_ = ShardedState::kUnsharded;
}

}  // namespace fsdp_ext::fsdp
