// FsdpParamGroup: the parameters one fully_shard call manages, moved together
// (upstream FSDP2's FSDPParamGroup). One flat all-gather unshards them, one
// flat reduce-scatter reduces their gradients; the training-state and
// sharded-state machines below decide when:
//
//   pre_forward   FORWARD; unshard (unless prefetched) and wait
//   post_forward  reshard (fully, to the post-forward mesh, or not at all)
//                 and record the forward order for backward prefetch; IDLE
//   pre_backward  PRE_BACKWARD; unshard and wait; prefetch the group whose
//                 forward finished just before this one
//   post_backward POST_BACKWARD; take the unsharded gradients, reshard,
//                 issue the reduce-scatter (completed by the next group's
//                 post_backward or at the end of backward: divide, HSDP
//                 all-reduce across replicas, cast to the parameters' dtype,
//                 accumulate into the sharded gradients)
//
// HSDP: the shard group is the mesh's last dim, the replicate group its
// first; parameters are gathered within the shard group and gradients are
// reduce-scattered there, then all-reduced across the replicate group.
//
// Collectives go through c10d::ProcessGroup, so any backend works and
// CommDebugMode counts them as c10d::_allgather_base_ / _reduce_scatter_base_.
// Entry points are called from Python hooks with the GIL held.
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/collective_group.hpp"
#include "fsdp/comm_context.hpp"
#include "fsdp/fsdp_param.hpp"
#include "fsdp/host_shared_parameters.hpp"
#include "fsdp/replaceable_method.hpp"
#include "fsdp/training_state.hpp"

namespace fsdp_ext::fsdp {

// Knobs set through FSDPModule's setters (upstream's names and defaults).
struct GroupOptions {
  bool reduce_grads = true;
  // HSDP: all-reduce across replicas after the reduce-scatter; off, the
  // reduce-scattered gradients accumulate locally until a step that does.
  bool all_reduce_grads = true;
  bool reshard_after_backward = true;
  bool unshard_in_backward = true;
  std::optional<double> gradient_divide_factor;
  // All-gather outputs and reduce-scatter buffers come from the process
  // group's allocator where its backend has one (fsdp_ext on one host: peers
  // read them in place), as upstream's
  // set_allocate_memory_from_process_group_for_comm.
  bool allocate_from_group = false;
  // Ours only (FSDPModule.set_per_parameter_collectives): over our backend,
  // the all-gather writes each parameter's unsharded storage directly and the
  // reduce-scatter reads each gradient where it lies: one coalesced
  // collective per group with a member per parameter, no copy-out, and no
  // reduce-scatter copy-in for gradients already laid out as their padded
  // parameter (dim-0 sharding, rows divisible by the world size). Groups it
  // cannot serve (a parameter sharded on another dim, PREMUL_SUM or a
  // pre-divide, custom comms, other backends) keep the flat collectives.
  bool per_parameter_collectives = false;
  // Reductions use SUM only, dividing before or after (changes where the
  // division happens, hence the rounding: gradient_divide.hpp).
  bool force_sum_reduction_for_comms = false;
  // Reduce-scatters (and their input buffers) allowed in flight when the
  // next group issues its own: more overlap for more memory. The comm
  // context applies the largest over its groups, resolved at lazy init.
  int64_t reduce_scatter_max_input_buffers = 1;
  // Parameters that got no gradient this backward are reduce-scattered as
  // zeros, so ranks that took different branches issue the same collective.
  bool reduce_scatter_unused_params = false;
};

class FSDP_EXT_HIDDEN FsdpParamGroup : public std::enable_shared_from_this<FsdpParamGroup> {
 public:
  // replicate_group: HSDP's (empty for FSDP).
  FsdpParamGroup(std::vector<std::shared_ptr<FsdpParam>> params, CollectiveGroup shard_group,
                 CollectiveGroup replicate_group = {});

  // Applies a MixedPrecisionPolicy's dtypes to every parameter and checks
  // that trainable parameters agree on their dtype and reduce dtype
  // (upstream's _init_mp_dtypes; AssertionError otherwise); then orders the
  // parameters for reduction by their sharded grad dtype (fsdp_param.hpp).
  void init_mp_dtypes(std::optional<at::ScalarType> param_dtype,
                      std::optional<at::ScalarType> reduce_dtype);

  // reshard_after_forward: false keeps parameters unsharded after forward;
  // true reshards them, to `post_forward_group` (a smaller group of
  // consecutive ranks, with one DTensorSpec per parameter) when given.
  void set_reshard_after_forward(bool reshard, CollectiveGroup post_forward_group = {},
                                 std::vector<py::object> post_forward_specs = {});
  bool uses_post_forward_mesh() const {
    return reshard_after_forward_ && static_cast<bool>(post_forward_group_);
  }

  void set_comm_context(std::shared_ptr<FsdpCommContext> context) { comm_ = std::move(context); }
  const std::shared_ptr<FsdpCommContext>& comm_context() const { return comm_; }

  // Upstream's custom Comm objects (collective_group.hpp); None: the default.
  void set_custom_all_gather(py::object comm);
  void set_custom_reduce_scatter(py::object comm);
  bool has_custom_comm() const { return shard_group_.has_custom_comm(); }
  // set_separate_reduce_scatter_group: reduce-scatters on their own group
  // (over the same ranks as the shard group); empty: the shard group.
  void set_reduce_scatter_group(CollectiveGroup group);
  const CollectiveGroup& reduce_scatter_group() const {
    return reduce_scatter_group_ ? reduce_scatter_group_ : shard_group_;
  }
  bool has_separate_reduce_scatter_group() const {
    return static_cast<bool>(reduce_scatter_group_);
  }
  // hook(reduce_output) (set_all_reduce_hook); None: no hook.
  void set_all_reduce_hook(py::object hook) { all_reduce_hook_ = std::move(hook); }

  // The state machine (see the file comment).
  void unshard();
  void wait_for_unshard();
  void reshard();
  void pre_forward();
  void post_forward(bool inside_backward);
  // Unshards for backward, then prefetches: the explicit backward targets,
  // or (none set) the group whose forward finished just before this one's.
  void pre_backward();
  void post_backward();
  // What the autograd hooks and the end of backward call: pre_backward /
  // post_backward, or what Python assigned in their place (Note [a group's
  // backward methods replaced from Python], replaceable_method.hpp).
  void run_pre_backward();
  void run_post_backward();
  ReplaceableMethod& pre_backward_method() { return pre_backward_method_; }
  ReplaceableMethod& post_backward_method() { return post_backward_method_; }
  void finalize_backward();
  // The root's end-of-backward callback, for every group: post_backward if
  // autograd did not run it, back to IDLE, finalize after the last backward.
  // `defer_reduction` (manual backward finalization): a group that would
  // reduce marks its post_backward pending instead, for the caller's
  // FSDPModule.finalize_backward to run.
  void finish_backward(bool is_last_backward, bool defer_reduction);
  // Whether this group's gradients still await a post_backward that reduces
  // them: set by a post_backward without gradient sync and by a deferred
  // one, cleared by a post_backward that reduces and by reset_iter_state.
  bool post_backward_pending() const { return post_backward_pending_; }
  // HSDP with set_requires_all_reduce(False): reduce-scattered gradients
  // held for a later backward's all-reduce.
  bool has_partial_reduce_output() const { return partial_reduce_output_.defined(); }
  // Unshards this group as if it were in `state` (explicit or implicit
  // prefetch); the state is restored afterwards.
  void prefetch_unshard(TrainingState state);
  // Explicit prefetching (set_modules_to_forward_prefetch / _backward_):
  // the groups this group unshards ahead when its forward starts, or when
  // its backward starts. `replaces_implicit`: the user named modules (even
  // ones without parameters), so the implicit backward prefetch is off.
  void set_forward_prefetch(std::vector<std::shared_ptr<FsdpParamGroup>> targets);
  void set_backward_prefetch(std::vector<std::shared_ptr<FsdpParamGroup>> targets,
                             bool replaces_implicit);
  // Once per forward pass of the owning state, after pre_forward.
  void prefetch_forward_targets();
  // Finishes a reduction this group issued (called by the comm context in
  // issue order): waits, divides, all-reduces across replicas (HSDP), casts
  // to the parameters' dtype and accumulates into the sharded gradients.
  void complete_reduce(PendingReduce reduce);
  // Back to IDLE and SHARDED after an exception mid-step: drops pending
  // collectives (waiting on them) and the forward-order bookkeeping.
  void reset_iter_state();

  // Host-shared parameters (host_shared_parameters.hpp, and the Python
  // setter that maps the memory): bytes of the parameters' region (each
  // parameter padded to its full size, 64-byte aligned, in group order), then
  // the switch itself, given that region, this host's control block, the
  // shard-group ranks on this host (in rank order) and their pids, this
  // rank's column (the shard-group ranks at its position on every host, in
  // host order; just this rank when the group is on one host) and the wait
  // timeout. Before the first forward.
  int64_t host_shared_bytes() const;
  void use_host_shared(at::Tensor region, at::Tensor control, std::vector<int64_t> host_ranks,
                       std::vector<int64_t> host_pids, std::vector<int64_t> column_ranks,
                       std::chrono::milliseconds timeout);
  bool host_shared() const { return host_shared_ != nullptr; }

  // Registers the sharded parameters without a reshard event (state_dict
  // hooks: saved and loaded state is always the sharded DTensors).
  void to_sharded();

  // Re-reads parameters changed since fully_shard (materialised meta tensors,
  // load_state_dict(assign=True), .to()); before first use and after those.
  void reset_sharded_params();

  TrainingState training_state() const { return training_state_; }
  void set_training_state(TrainingState state) { training_state_ = state; }
  ShardedState sharded_state() const { return sharded_state_; }
  bool unshard_pending() const { return pending_all_gather_.has_value(); }
  const std::string& module_fqn() const { return module_fqn_; }
  void set_module_fqn(std::string fqn) { module_fqn_ = std::move(fqn); }
  // Appended to this group's profiler range names: " [pg=N]" where its
  // module has several parameter groups (per-parameter meshes), as upstream.
  void set_profile_label_suffix(std::string suffix) { profile_label_suffix_ = std::move(suffix); }
  const std::string& profile_label_suffix() const { return profile_label_suffix_; }
  const std::vector<std::shared_ptr<FsdpParam>>& params() const { return params_; }
  GroupOptions& options() { return options_; }
  const CollectiveGroup& shard_group() const { return shard_group_; }
  const CollectiveGroup& replicate_group() const { return replicate_group_; }

 private:
  struct PendingAllGather {
    at::Tensor output;                    // flat, world * input numel
    c10::intrusive_ptr<c10d::Work> work;  // null at world size 1
    int64_t world_size;
    std::vector<int64_t> split_sizes;     // elements of each parameter's unsharded dtype
    // Gathered from the sharded parameters (not from post-forward chunks of
    // the flat unsharded data): parameters sharded on dim d > 0 are
    // reassembled along d.
    bool from_sharded = true;
    // Per-parameter collective: the outputs are the parameters' own
    // all-gather outputs (nothing to copy out); `inputs` are kept alive
    // until it completes (casts under mixed precision).
    bool per_parameter = false;
    std::vector<at::Tensor> inputs;
    // Host-shared across hosts: the column exchange's sends and receives,
    // waited before this rank publishes the epoch; in backward also each
    // column peer's flag (1: its data follows) and their receives (Note [the
    // backward reuses the forward's host-shared values]).
    bool across_hosts = false;
    std::vector<WorkPtr> column_exchange;
    at::Tensor column_flags;  // int64, one per column peer
    std::vector<WorkPtr> column_flag_receives;
    // Per parameter, the all-gather extension's inputs (empty without one):
    // the copy-out sizes their outputs from them.
    std::vector<std::vector<at::Tensor>> extension_inputs;
    // On the side streams: the all-gather stream's event after the
    // collective (the copy-out waits for it); null elsewhere.
    StreamEvent gathered;
  };

  // Whether this group's collectives on `group` go per parameter now
  // (GroupOptions::per_parameter_collectives and the conditions there).
  bool per_parameter_on(const CollectiveGroup& group, CollectiveGroup::Purpose purpose,
                        bool from_sharded) const;
  void issue_per_parameter_all_gather(const CollectiveGroup& group, PendingAllGather& pending);
  // Note [ordering of host-shared unsharded parameters]: enter, write this
  // rank's slots, publish.
  void unshard_host_shared(PendingAllGather& pending);
  // Whether this rank's slots already hold its current shards, byte for byte.
  bool host_shared_slots_current();
  // Column exchange pieces: this rank's slots to `peer`, `peer`'s slots into
  // this host's memory; one message per parameter, in parameter order.
  void send_host_shared_slots(int64_t peer, std::vector<WorkPtr>& works);
  void receive_host_shared_slots(int64_t peer, std::vector<WorkPtr>& works);
  // Waits for the column exchange (and flagged data) of a host-shared
  // unshard, then publishes the epoch.
  void finish_column_exchange(PendingAllGather& pending);

  // "FSDP::<phase> (<module fqn>)<suffix>": upstream's profiler range name.
  std::string profile_label(const char* phase) const;
  void to_sharded_post_forward();
  void to_unsharded();
  void backward_prefetch();
  // Waits for an issued all-gather nobody will copy out, and forgets it.
  void drop_pending_all_gather();
  void reduce_gradients(std::vector<std::shared_ptr<FsdpParam>> params,
                        std::vector<at::Tensor> grads);
  // The dtype `grads` (of `params`) are reduced in: the policy's
  // reduce_dtype, else (torch 2.15) the promotion of each parameter's
  // unsharded grad dtype (the gradient's own where that is any) and of the
  // partial output held for HSDP, or (before) the gradients' one dtype.
  at::ScalarType reduce_dtype_of(const std::vector<std::shared_ptr<FsdpParam>>& params,
                                 const std::vector<at::Tensor>& grads) const;
  // set_reduce_scatter_unused_params builds zeros for unused parameters;
  // one whose gradient dtype may be any has no dtype every rank agrees on
  // without a reduce_dtype (ValueError, on every rank alike).
  void check_unused_param_grad_dtypes() const;
  // Whether the reduction of `grads` is the identity and each can become its
  // parameter's sharded gradient as it is (Note [a gradient that is its own
  // shard] in the .cpp).
  bool reduces_in_place(const std::vector<std::shared_ptr<FsdpParam>>& params,
                        const std::vector<at::Tensor>& grads, int64_t world,
                        const ReduceFactors& factors, at::ScalarType reduce_dtype) const;
  // A device reduction whose copy-in is done, on the side streams (Note [a
  // reduction on the side streams] in the .cpp). `average`: AVG asked of the
  // backend in place of the reduce-scatter divide.
  void reduce_on_streams(FsdpStreams& streams, PendingReduce reduce, int64_t world,
                         bool average);
  // The end of complete_reduce: `output` (reduce dtype, the parameters'
  // padded shards in `params`' order) into the sharded gradients.
  void accumulate_reduced_shards(const std::vector<std::shared_ptr<FsdpParam>>& params,
                                 const at::Tensor& output);

  std::vector<std::shared_ptr<FsdpParam>> params_;
  CollectiveGroup shard_group_;
  CollectiveGroup replicate_group_;
  CollectiveGroup post_forward_group_;
  std::vector<py::object> post_forward_specs_;
  CollectiveGroup reduce_scatter_group_;
  py::object custom_all_gather_;  // kept for post-forward groups set later
  py::object custom_reduce_scatter_;  // and for a separate reduce-scatter group
  py::object all_reduce_hook_;
  bool reshard_after_forward_ = true;
  std::shared_ptr<FsdpCommContext> comm_;
  GroupOptions options_;
  std::string module_fqn_;
  std::string profile_label_suffix_;

  TrainingState training_state_ = TrainingState::kIdle;
  ShardedState sharded_state_ = ShardedState::kSharded;
  std::optional<PendingAllGather> pending_all_gather_;
  // Resharded to the post-forward mesh on the compute stream: the next
  // unshard's all-gather streams wait for it.
  StreamEvent reshard_after_forward_event_;
  std::unique_ptr<HostSharedParameters> host_shared_;
  uint64_t host_shared_epoch_ = 0;  // unshards so far (every rank alike)
  std::vector<int64_t> host_shared_column_peers_;  // shard-group ranks on other hosts
  std::vector<size_t> post_forward_indices_;
  ReplaceableMethod pre_backward_method_{"pre_backward"};
  ReplaceableMethod post_backward_method_{"post_backward"};
  // Weak: targets are other groups, which may own (prefetch) this one.
  std::vector<std::weak_ptr<FsdpParamGroup>> forward_prefetch_;
  std::vector<std::weak_ptr<FsdpParamGroup>> backward_prefetch_;
  bool explicit_backward_prefetch_ = false;
  bool post_backward_pending_ = false;
  // Over trainable parameters, set by init_mp_dtypes: the reduce dtype
  // (nullopt: reduce_dtype_of decides per reduction).
  std::optional<at::ScalarType> reduce_dtype_;
  // Indices into params_ in the order gradients are packed for reduction:
  // grouped by sharded grad dtype, each group in parameter order (upstream's
  // reduce-scatter order), so each dtype's shards are one run to cast
  // (Note [casting reduced shards back] in the .cpp). All-gathers keep
  // params_'s order.
  std::vector<size_t> reduce_order_;
  // HSDP without all-reduce: reduce-scattered gradients summed across
  // backwards until one all-reduces (reduce dtype, this rank's chunk).
  at::Tensor partial_reduce_output_;
};

}  // namespace fsdp_ext::fsdp
