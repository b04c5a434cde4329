#include "fsdp/fsdp_param_group.hpp"

#include <c10/util/Exception.h>

#include <cstring>

#include "fsdp/copy_kernels.hpp"
#include "fsdp/event_trace.hpp"
#include "fsdp/group_collectives.hpp"

namespace fsdp_ext::fsdp {
namespace {

// How gradients are divided around a SUM reduce-scatter, as upstream's
// _get_gradient_divide_factors decides (its AVG is SUM then divide by the
// world size; its PREMUL_SUM(1/f) is a multiply by 1/f before the SUM, which
// gloo also supports). Dtypes that may overflow split the factor into a
// power-of-two pre-divide and the rest after.
struct DivideFactors {
  std::optional<double> pre_multiply;
  std::optional<double> post_divide;
};

DivideFactors divide_factors(at::ScalarType dtype, int64_t world, std::optional<double> factor) {
  if (world == 1) {
    if (factor && *factor != 1.0) return {std::nullopt, *factor};
    return {};
  }
  const bool overflow_risk = dtype != at::kFloat && dtype != at::kBFloat16;
  if (!overflow_risk) {
    if (!factor || *factor == static_cast<double>(world)) return {std::nullopt, world};
    return {1.0 / *factor, std::nullopt};
  }
  const double total = factor.value_or(static_cast<double>(world));
  double pre = 1;
  while (std::fmod(total, pre) == 0 && total / pre > pre) pre *= 2;
  DivideFactors out;
  if (pre != 1) out.pre_multiply = 1.0 / pre;
  if (total / pre != 1) out.post_divide = total / pre;
  return out;
}

}  // namespace

FsdpParamGroup::FsdpParamGroup(std::vector<std::shared_ptr<FsdpParam>> params,
                               ProcessGroupPtr shard_group)
    : params_(std::move(params)),
      shard_group_(std::move(shard_group)),
      comm_(std::make_shared<FsdpCommContext>()) {
  TORCH_CHECK_VALUE(shard_group_, "fsdp_ext FsdpParamGroup: no shard process group");
  TORCH_CHECK_VALUE(!params_.empty(), "fsdp_ext FsdpParamGroup: no parameters");
}

void FsdpParamGroup::set_reshard_after_forward(bool reshard, ProcessGroupPtr post_forward_group,
                                               std::vector<py::object> post_forward_specs) {
  TORCH_CHECK_VALUE(!post_forward_group || post_forward_specs.size() == params_.size(),
                    "fsdp_ext FsdpParamGroup(", module_fqn_, "): ", post_forward_specs.size(),
                    " post-forward specs for ", params_.size(), " parameters");
  // Parameters still on the old post-forward mesh go back to full sharding
  // first: the next unshard must not gather over a group that is gone.
  if (sharded_state_ == ShardedState::kShardedPostForward) to_sharded();
  reshard_after_forward_ = reshard;
  post_forward_group_ = reshard ? std::move(post_forward_group) : ProcessGroupPtr();
  post_forward_specs_ = post_forward_group_ ? std::move(post_forward_specs)
                                            : std::vector<py::object>();
}

void FsdpParamGroup::unshard() {
  if (pending_all_gather_ || sharded_state_ == ShardedState::kUnsharded) return;
  EventTrace::emit(TraceEvent::kUnshard, module_fqn_, training_state_);
  if (!options_.unshard_in_backward && training_state_ == TrainingState::kPreBackward) return;
  const ProcessGroupPtr& group = sharded_state_ == ShardedState::kShardedPostForward
                                     ? post_forward_group_
                                     : shard_group_;
  PendingAllGather pending{at::Tensor(), {}, group->getSize(), {}};
  if (pending.world_size > 1) {
    std::vector<at::Tensor> inputs;
    inputs.reserve(params_.size());
    int64_t input_numel = 0;
    for (const auto& param : params_) {
      inputs.push_back(param->all_gather_input());
      pending.split_sizes.push_back(inputs.back().numel());
      input_numel += inputs.back().numel();
    }
    pending.output = comm_buffer(*group, input_numel * pending.world_size, inputs.front().options());
    at::Tensor input =
        all_gather_copy_in(inputs, pending.output, group->getRank(), pending.world_size);
    pending.work = all_gather_flat(*group, pending.output, input);
  }
  pending_all_gather_ = std::move(pending);
}

void FsdpParamGroup::wait_for_unshard() {
  if (!pending_all_gather_) return;
  PendingAllGather pending = std::move(*pending_all_gather_);
  pending_all_gather_.reset();
  if (pending.world_size == 1) {
    // Nothing to gather: copy each shard into its own unsharded storage, which
    // reshard can release without touching the sharded data. A raw copy keeps
    // the version counter unchanged, as autograd's saved tensors expect.
    for (const auto& param : params_) {
      const at::Tensor& output = param->allocated_all_gather_output();
      const at::Tensor& input = param->all_gather_input();
      if (input.nbytes() != 0) std::memcpy(output.data_ptr(), input.data_ptr(), input.nbytes());
    }
  } else {
    wait_releasing_gil(pending.work);
    std::vector<at::Tensor> outputs;
    outputs.reserve(params_.size());
    for (const auto& param : params_) outputs.push_back(param->allocated_all_gather_output());
    all_gather_copy_out(pending.output, pending.split_sizes, pending.world_size, outputs);
  }
  for (const auto& param : params_) param->init_unsharded_param();
  to_unsharded();
}

void FsdpParamGroup::reshard() {
  if (training_state_ == TrainingState::kForward && !reshard_after_forward_) return;
  EventTrace::emit(TraceEvent::kReshard, module_fqn_, training_state_);
  if (training_state_ == TrainingState::kForward && uses_post_forward_mesh()) {
    to_sharded_post_forward();
    return;
  }
  to_sharded();
}

void FsdpParamGroup::pre_forward() {
  training_state_ = TrainingState::kForward;
  unshard();
  wait_for_unshard();
}

void FsdpParamGroup::post_forward(bool inside_backward) {
  // Activation-checkpoint recomputation runs forward hooks inside backward;
  // it must neither reshard nor change the forward order.
  if (!inside_backward) {
    reshard();
    post_forward_indices_.push_back(comm_->post_forward_order.size());
    comm_->post_forward_order.push_back(weak_from_this());
  }
  training_state_ = TrainingState::kIdle;
}

void FsdpParamGroup::pre_backward(bool default_prefetch) {
  if (training_state_ == TrainingState::kPreBackward) return;
  training_state_ = TrainingState::kPreBackward;
  unshard();
  wait_for_unshard();
  if (default_prefetch) backward_prefetch();
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

void FsdpParamGroup::post_backward() {
  training_state_ = TrainingState::kPostBackward;
  std::vector<std::shared_ptr<FsdpParam>> with_grad;
  std::vector<at::Tensor> grads;
  if (options_.reduce_grads) {
    // Take the gradients before resharding; they stay valid without the
    // unsharded storage.
    for (const auto& param : params_) {
      at::Tensor grad = param->take_unsharded_grad();
      if (!grad.defined()) continue;
      with_grad.push_back(param);
      grads.push_back(std::move(grad));
    }
  }
  // Without gradient sync the gradients stay on the unsharded parameters and
  // accumulate there until a step that reduces.
  if (options_.reshard_after_backward) reshard();
  if (options_.reduce_grads) {
    // The previous group's reduce-scatter overlapped this group's backward;
    // finish it before issuing the next (one in flight, as upstream keeps).
    comm_->finish_reduces(0);
    if (!grads.empty()) reduce_gradients(std::move(with_grad), std::move(grads));
  }
  EventTrace::emit(TraceEvent::kPostBackward, module_fqn_, training_state_);
}

void FsdpParamGroup::reduce_gradients(std::vector<std::shared_ptr<FsdpParam>> params,
                                      std::vector<at::Tensor> grads) {
  const at::ScalarType dtype = grads.front().scalar_type();
  for (const at::Tensor& grad : grads) {
    TORCH_CHECK_TYPE(grad.scalar_type() == dtype, "fsdp_ext post_backward(", module_fqn_,
                     "): FSDP reduce-scatter expects uniform gradient dtype but got ", dtype,
                     " and ", grad.scalar_type());
  }
  const int64_t world = shard_group_->getSize();
  const DivideFactors factors = divide_factors(dtype, world, options_.gradient_divide_factor);
  if (world == 1) {
    // The shard is the whole parameter: no collective, no copy.
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor grad = grads[i].reshape(params[i]->sharded_size());
      if (factors.post_divide) grad = grad / *factors.post_divide;
      params[i]->accumulate_sharded_grad(grad);
    }
    return;
  }
  int64_t row_numel = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].is_contiguous()) grads[i] = grads[i].contiguous();
    row_numel += params[i]->padded_shard_numel();
  }
  PendingReduce reduce;
  reduce.input = comm_buffer(*shard_group_, row_numel * world, grads.front().options());
  reduce_scatter_copy_in(grads, world, reduce.input);
  grads.clear();  // the unsharded gradients are no longer needed
  if (factors.pre_multiply) reduce.input.mul_(*factors.pre_multiply);
  reduce.output = comm_buffer(*shard_group_, row_numel, reduce.input.options());
  reduce.work = reduce_scatter_flat(*shard_group_, reduce.output, reduce.input);
  reduce.post_divide = factors.post_divide;
  reduce.params = std::move(params);
  comm_->add_reduce(std::move(reduce));
}

at::Tensor FsdpParamGroup::comm_buffer(c10d::ProcessGroup& group, int64_t numel,
                                       const at::TensorOptions& options) const {
  if (options_.allocate_from_group) {
    c10::intrusive_ptr<c10d::Backend> backend = group.getBackend(options.device().type());
    if (backend->supportsTensorAlloc(options.device().index())) {
      return backend->allocateTensor(numel, options);
    }
  }
  return at::empty({numel}, options);
}

void FsdpParamGroup::drop_pending_all_gather() {
  if (!pending_all_gather_) return;
  PendingAllGather pending = std::move(*pending_all_gather_);
  pending_all_gather_.reset();
  if (pending.work) wait_releasing_gil(pending.work);
}

void FsdpParamGroup::finalize_backward() {
  // A prefetch whose module never ran (mistargeted): complete and drop it.
  drop_pending_all_gather();
  post_forward_indices_.clear();
}

void FsdpParamGroup::reset_iter_state() {
  drop_pending_all_gather();
  // The failed iteration's gradients must not be reduced with the next one.
  for (const auto& param : params_) param->take_unsharded_grad();
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
  const int64_t rank = post_forward_group_->getRank();
  const int64_t world = post_forward_group_->getSize();
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
