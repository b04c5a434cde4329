// FsdpParam: one managed parameter of an FSDP group and the tensors it moves
// between (upstream FSDP2's FSDPParam; layouts and semantics as there):
//
//   sharded param     nn.Parameter(DTensor Shard(0)) whose local tensor is the
//                     unpadded prefix of `padded_sharded_data` (dim 0 padded to
//                     ceil(dim0 / world) rows, zeros at the tail);
//   all-gather output a flat buffer of world * padded numel elements in the
//                     unsharded dtype (param_dtype under mixed precision); its
//                     storage is allocated for an unshard and released (resized
//                     to 0 bytes) on reshard, while the tensor objects persist;
//   unsharded param   nn.Parameter viewing the prefix of the all-gather output
//                     with the original shape. The same object every step:
//                     autograd's saved tensors and .grad rely on its identity;
//   post-forward data with reshard_after_forward=k, this rank's 1/k of the
//                     all-gather output, kept as a DTensor on the k-rank mesh;
//   accumulated grad  with reduce_dtype and gradient sync off, the unsharded
//                     gradient kept in reduce_dtype between backwards (upstream's
//                     unsharded_accumulated_grad).
//
// Mixed precision follows upstream's FSDPParam.init_dtype_attrs: the policy's
// param_dtype (torch 2.15: or this parameter's answer of
// param_dtype_override_fn) is dropped where it equals the parameter's dtype or
// the parameter is not floating point; before torch 2.15 reduce_dtype is
// dropped where it equals param_dtype (gradients already arrive in it).
//
// Gradient dtypes (torch 2.15 gives each parameter a grad_dtype policy:
// torch_compat::kGradDtypePolicies):
//   sharded grad dtype    what the reduced shard is cast to and accumulated
//                         in: the parameter's grad_dtype where one was set
//                         (None: left in the reduce dtype), else its original
//                         dtype;
//   unsharded grad dtype  what the gradient is reduced (the group promotes
//                         over its parameters) and accumulated without sync
//                         in: reduce_dtype where set, else the sharded grad
//                         dtype. Before 2.15: reduce_dtype, else the
//                         gradient's own dtype (nullopt).
//
// A parameter that is already a DTensor (tensor parallelism) is sharded by
// its local tensor; `unsharded_spec` is then its original (TP) DTensorSpec:
// the unsharded parameter is a DTensor with it, and its gradients are
// unwrapped to local tensors in that spec's placements before reduction
// (torch_fsdp_ext/fsdp/_tensor_parallel.py).
//
// A parameter whose local tensor defines fsdp_pre_all_gather /
// fsdp_post_all_gather has an AllGatherExtension (torch_fsdp_ext/fsdp/
// _extensions.py, attached at lazy init): its all-gather inputs (any number,
// any dtypes) come from the pre hook instead of the padded shard, and its
// unsharded parameter is what the post hook builds from their gathered
// outputs; reshard frees those outputs through it.
//
// Note [tensor subclass parameters]
// A parameter (or a DTensor parameter's local tensor) may be a tensor
// subclass, as quantised training's weights are (torchao's float8 weights,
// NF4): sharding keeps its class, as upstream's does, by making the padded
// shard with the local tensor's own new_zeros and copy_, which the subclass's
// dispatch answers. A wrapper subclass has no storage of its own (its data
// pointer is null; its data lives in the tensors it wraps), and a fake
// tensor has no data at all, so nothing here reads such a tensor in place:
// with an all-gather extension the pre hook's inputs are gathered; without
// one the copy kernels copy it in with ATen ops, through its dispatch, as
// upstream's copy-in does (copy_kernels.hpp), per-parameter collectives
// (which hand the shard to the backend) are off for its group, and
// host-shared parameters refuse it.
//
// Modules are Python objects, so registration writes the module's
// _parameters dict (or setattr where the class overrides __setattr__), and
// gradient DTensors are built through the Python DTensor constructor; the
// loops over parameters run here, in C++.
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>

#include <optional>
#include <string>
#include <vector>

#include "fsdp/training_state.hpp"  // also FSDP_EXT_HIDDEN

namespace fsdp_ext::fsdp {

namespace py = pybind11;

// One (module, attribute) the parameter is registered on; shared parameters
// have several.
//
// The module is held weakly: the module owns (through its hooks) the FSDP
// state that owns this parameter, and a strong edge back from C++ would be a
// cycle Python's collector cannot see, so a sharded model would never be
// freed. Its _parameters dict holds only parameters, so holding it strongly
// closes no cycle.
struct FSDP_EXT_HIDDEN ModuleSlot {
  py::weakref module;
  py::object parameters;  // module._parameters
  py::str name;
  bool plain_dict_write;  // false where the module class overrides __setattr__
};

class FSDP_EXT_HIDDEN FsdpParam {
 public:
  // shard_dim: the dim the parameter is sharded on (shard_placement_fn's
  // Shard(d); 0 by default). Dims other than 0 are sharded evenly, no padding.
  FsdpParam(std::string fqn, std::vector<ModuleSlot> slots, py::object sharded_param,
            at::Tensor padded_sharded_data, std::vector<int64_t> orig_size,
            std::vector<int64_t> sharded_size, int64_t shard_world_size, int64_t shard_dim = 0);

  // Transitions; each registers the matching parameter on every slot.
  void to_sharded();
  // Keeps chunk `rank` of `world` (the post-forward mesh) of the all-gather
  // output as a DTensor with `spec`, then releases the unsharded storage.
  void to_sharded_post_forward(int64_t rank, int64_t world, const py::object& spec);
  void to_unsharded();
  ShardedState sharded_state() const { return state_; }

  // Applies a MixedPrecisionPolicy's dtypes (nullopt: unset), clamped as in
  // the file comment. Kept across reset_sharded_param (a dtype change).
  void init_dtype_attrs(std::optional<at::ScalarType> param_dtype,
                        std::optional<at::ScalarType> reduce_dtype);
  // torch 2.15's MixedPrecisionPolicy.param_dtype_override_fn, asked once at
  // fully_shard: this parameter's param_dtype in place of the policy's
  // (nullopt: the policy's).
  void set_param_dtype_override(std::optional<at::ScalarType> dtype) {
    param_dtype_override_ = dtype;
  }
  std::optional<at::ScalarType> param_dtype_override() const { return param_dtype_override_; }
  at::ScalarType orig_dtype() const { return padded_sharded_data_.scalar_type(); }
  std::optional<at::ScalarType> param_dtype() const { return param_dtype_; }
  std::optional<at::ScalarType> reduce_dtype() const { return reduce_dtype_; }
  // The dtype of the all-gather and of the unsharded parameter.
  at::ScalarType unsharded_dtype() const { return param_dtype_.value_or(orig_dtype()); }
  // The gradient dtypes of the file comment (nullopt: any, the reduce dtype).
  std::optional<at::ScalarType> sharded_grad_dtype() const;
  std::optional<at::ScalarType> unsharded_grad_dtype() const;
  // Whether the sharded parameter has a grad_dtype of its own (torch 2.15).
  bool has_grad_dtype_override() const { return grad_dtype_policy_.overridden; }
  // A tensor-parallel parameter whose gradient may be reduced over a mesh dim
  // outside data parallelism (a Replicate placement there: its Partial
  // gradient is all-reduced over TP before FSDP reduces it), in the
  // gradient's dtype: Note [a wider gradient dtype] in the .cpp.
  void set_reduces_grad_outside_dp(bool reduces) { reduces_grad_outside_dp_ = reduces; }

  // The flat tensor this rank contributes to the next all-gather.
  const at::Tensor& all_gather_input() const;
  // The all-gather output with its storage allocated (created on first use).
  const at::Tensor& allocated_all_gather_output();
  // Its elements: the padded parameter, every rank's padded shard.
  int64_t all_gather_output_numel() const {
    return padded_sharded_data_.numel() * shard_world_size_;
  }
  // Host-shared parameters (host_shared_parameters.hpp): `output`, a view of
  // the memory every rank of the host maps, is the all-gather output from now
  // on and is never released. Before the unsharded parameter exists.
  void use_host_shared_output(at::Tensor output);
  bool host_shared() const { return host_shared_; }
  // Creates the unsharded nn.Parameter once, viewing the all-gather output
  // (with an extension: the post hook's tensor the first time, and the post
  // hook filling it in place at every later unshard).
  void init_unsharded_param();

  // All-gather extensions (see the file comment); None: the default path.
  void set_extension(py::object extension) { extension_ = std::move(extension); }
  const py::object& extension() const { return extension_; }
  bool has_extension() const { return !extension_.is_none(); }
  // The pre hook's inputs, flat (they may differ in dtype from each other).
  std::vector<at::Tensor> extension_inputs();
  // Their all-gather outputs (world_size times each input's elements), with
  // memory allocated.
  std::vector<at::Tensor> extension_outputs(const std::vector<at::Tensor>& inputs,
                                            int64_t world_size);
  // The module that holds the parameter (upstream passes it to the pre hook).
  py::object owner_module() const { return slots_.front().module(); }
  bool has_unsharded_param() const { return unsharded_tensor_.defined(); }
  // Frees the unsharded storage on resharding, unless it is kept.
  void release_unsharded_storage();
  // FSDPModule.set_keep_unsharded_storage (torch 2.15's): resharding keeps
  // the unsharded storage, so its data pointers stay the same across steps
  // (what a captured CUDA graph replays), for the memory it holds.
  bool keep_unsharded_storage() const { return keep_unsharded_storage_; }
  void set_keep_unsharded_storage(bool keep) { keep_unsharded_storage_ = keep; }

  // Zeros shaped and typed as the unsharded parameter: the gradient of an
  // unused parameter under set_reduce_scatter_unused_params. (The reduce
  // dtype does not depend on their dtype: with a parameter whose gradient
  // dtype is any, the group refuses unused parameters without reduce_dtype.)
  at::Tensor zero_unsharded_grad() const { return local_grad(at::zeros_like(unsharded_tensor_)); }
  // The gradient to reduce (undefined if none): the reduce-dtype accumulator
  // if one exists, else the unsharded parameter's .grad (which becomes None).
  at::Tensor take_unsharded_grad();
  // Forgets the unsharded gradient and the accumulator, converting nothing
  // (no collective: used after a failed iteration).
  void drop_unsharded_grad();
  // Gradient accumulation without sync under reduce_dtype (upstream's names):
  // folds a new .grad into the accumulator, and moves a .grad of another
  // dtype into a fresh accumulator cast to reduce_dtype.
  void accumulate_unsharded_grad_if_needed();
  void to_accumulated_grad_if_needed();
  // Adds `shard` (this rank's reduced gradient, sharded_size, in the sharded
  // grad dtype) into the sharded parameter's DTensor gradient, creating it if
  // absent, then runs the parameter's post-accumulate-grad hooks.
  void accumulate_sharded_grad(const at::Tensor& shard);

  // Re-reads the parameter from its module (load_state_dict(assign=True),
  // Module._apply) and, for a local tensor no longer backed by the padded
  // buffer, makes it the sharded data: as it is when it has the padded size
  // (no copy, as upstream's), padded into a new tensor when shorter. Meta
  // tensors are left alone.
  void reset_sharded_param();

  const std::string& fqn() const { return fqn_; }
  void set_fqn(std::string fqn) { fqn_ = std::move(fqn); }
  const std::vector<int64_t>& orig_size() const { return orig_size_; }
  const std::vector<int64_t>& sharded_size() const { return sharded_size_; }
  int64_t shard_dim() const { return shard_dim_; }
  int64_t padded_shard_numel() const { return padded_sharded_data_.numel(); }
  bool requires_grad() const { return sharded_tensor().requires_grad(); }
  bool is_meta() const { return padded_sharded_data_.is_meta(); }
  const py::object& sharded_param() const { return sharded_param_; }
  const py::object& unsharded_param() const { return unsharded_param_; }
  const at::Tensor& padded_sharded_data() const { return padded_sharded_data_; }
  // None for plain parameters (see the file comment).
  void set_unsharded_spec(py::object spec) { unsharded_spec_ = std::move(spec); }
  // CPUOffloadPolicy(pin_memory=True): re-padded data is pinned again.
  void set_pin_memory(bool pin) { pin_memory_ = pin; }
  bool pin_memory() const { return pin_memory_; }
  const py::object& unsharded_spec() const { return unsharded_spec_; }
  // dp_mesh_dims: the data-parallel mesh dims, where gradients keep their
  // own placements (a tuple of ints; empty otherwise).
  void set_grad_dp_dims(py::object dims) { grad_dp_dims_ = std::move(dims); }
  const py::object& grad_dp_dims() const { return grad_dp_dims_; }
  // Upstream's FSDPParam.shard_mesh: the data-parallel mesh FSDP shards over
  // (its shard dim alone under HSDP), what an all-gather extension's pre hook
  // is given. Not the sharded DTensor's mesh, which for a DTensor (TP)
  // parameter is the full (dp, tp) mesh.
  void set_shard_mesh(py::object mesh) { shard_mesh_ = std::move(mesh); }
  const py::object& shard_mesh() const { return shard_mesh_; }

 private:
  bool is_dtensor() const { return unsharded_spec_ && !unsharded_spec_.is_none(); }
  // A gradient of the unsharded parameter as the plain tensor to reduce
  // (DTensor parameters: its local tensor in the TP placements).
  at::Tensor local_grad(at::Tensor grad) const;
  // The gradient DTensor's spec for a shard of `dtype` (spec_ unless the
  // gradient dtype differs from the parameter's; the last other one is kept).
  const py::object& grad_spec(at::ScalarType dtype);
  // The unsharded parameter's grad_dtype (Note [a wider gradient dtype]).
  void apply_unsharded_grad_dtype();
  // Reads the sharded parameter's grad_dtype policy where it has one set
  // (Tensor._has_grad_dtype_override, torch 2.15); an unset one changes
  // nothing (a parameter rebuilt by Module._apply lost it).
  void capture_grad_dtype_policy(const py::object& param);
  void register_on_modules(const py::object& param);
  // `size` with the shard dim's extent a padded shard's (every rank's, the
  // ceil of the original extent over the shard world).
  std::vector<int64_t> with_padded_shard_dim(std::vector<int64_t> size) const;
  void remember_subclass_local(const at::Tensor& local);
  bool is_subclass_local(const at::Tensor& local) const;
  // Forgets the all-gather output and the unsharded parameter when they no
  // longer have the unsharded dtype (policy or parameter dtype changed).
  void drop_unsharded_of_stale_dtype();
  void clamp_dtypes();
  // The sharded parameter as a C++ tensor. Not cached: holding a second
  // reference would make torch.utils.swap_tensors (Module._apply on DTensor
  // parameters, e.g. to_empty) refuse the swap.
  at::Tensor sharded_tensor() const;

  std::string fqn_;
  std::vector<ModuleSlot> slots_;
  std::vector<int64_t> orig_size_;
  std::vector<int64_t> sharded_size_;  // this rank's unpadded chunk
  int64_t shard_world_size_;
  int64_t shard_dim_;
  ShardedState state_ = ShardedState::kSharded;
  std::optional<at::ScalarType> param_dtype_override_;  // param_dtype_override_fn's
  std::optional<at::ScalarType> policy_param_dtype_;    // as the policy says (or the override)
  std::optional<at::ScalarType> policy_reduce_dtype_;
  std::optional<at::ScalarType> param_dtype_;           // clamped
  std::optional<at::ScalarType> reduce_dtype_;
  struct GradDtypePolicy {
    bool overridden = false;              // grad_dtype set on the parameter
    std::optional<at::ScalarType> dtype;  // with overridden: nullopt is None, any dtype
  };
  GradDtypePolicy grad_dtype_policy_;
  bool reduces_grad_outside_dp_ = false;

  py::object sharded_param_;  // nn.Parameter(DTensor)
  py::object spec_;            // its DTensorSpec, for gradient DTensors
  py::object grad_spec_;       // spec_ for gradients of another dtype (grad_spec),
  at::ScalarType grad_spec_dtype_ = at::kFloat;  // that dtype
  at::Tensor padded_sharded_data_;  // 1-D (a subclass: what its view(-1) returns)
  // The sharded DTensor's local tensor where it is a tensor subclass (Note
  // [tensor subclass parameters]), whose data pointer cannot tell whether it
  // still views our padded data: then only the very tensor we made does.
  // Weak, so that it adds no reference (torch.utils.swap_tensors refuses a
  // tensor referenced twice).
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> subclass_local_;

  at::Tensor all_gather_output_;  // 1-D, world * padded numel
  bool host_shared_ = false;      // all_gather_output_ views host-shared memory
  bool keep_unsharded_storage_ = false;
  py::object unsharded_spec_ = py::none();
  bool pin_memory_ = false;
  py::object grad_dp_dims_ = py::tuple();
  py::object shard_mesh_ = py::none();
  py::object unsharded_param_;
  at::Tensor unsharded_tensor_;  // the parameter (a DTensor for TP parameters)
  at::Tensor accumulated_grad_;  // reduce_dtype, gradient sync off

  py::object extension_ = py::none();
  py::object post_forward_param_;
  at::Tensor post_forward_data_;  // 1-D
};

}  // namespace fsdp_ext::fsdp
