#include "fsdp/fsdp_param.hpp"

#include <c10/core/StorageImpl.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <utility>

#include "fsdp/host_block_cache.hpp"
#include "fsdp/dispatch_modes.hpp"
#include "fsdp/shard_extent.hpp"
#include "fsdp/tensor_subclass.hpp"
#include "torch_compat.hpp"

namespace fsdp_ext::fsdp {
namespace {

// Python callables the runtime needs on the per-step path, looked up once.
// Leaked on purpose (see event_trace.cpp).
const py::object& dtensor_class() {
  static py::object* cls =
      new py::object(py::module_::import("torch.distributed.tensor").attr("DTensor"));
  return *cls;
}

const py::object& parameter_class() {
  static py::object* cls = new py::object(py::module_::import("torch.nn").attr("Parameter"));
  return *cls;
}

// DTensor.__new__ is torch's C++ constructor; DTensor.__init__ adds nothing
// but a dynamo-disabled wrapper that costs ~40x the construction itself, and
// this runs for every gradient of every step. Called with positional
// arguments through the vectorcall protocol: pybind's keyword call built a
// dict per call and cost about as much as the construction.
py::object make_dtensor(const at::Tensor& local, const py::object& spec) {
  static py::object* construct = new py::object(dtensor_class().attr("__new__"));
  py::object wrapped = py::reinterpret_steal<py::object>(THPVariable_Wrap(local));
  if (!wrapped) throw py::error_already_set();
  PyObject* args[] = {dtensor_class().ptr(), wrapped.ptr(), spec.ptr(), Py_False};
  PyObject* made = PyObject_Vectorcall(construct->ptr(), args, 4, nullptr);
  if (made == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(made);
}

at::Tensor unpack(const py::object& tensor) { return THPVariable_Unpack(tensor.ptr()); }

// `spec` (a DTensorSpec) describing a tensor of `dtype`: its tensor_meta
// carries the dtype.
py::object spec_with_dtype(const py::object& spec, at::ScalarType dtype) {
  py::object meta = spec.attr("tensor_meta");
  py::object wanted = py::cast(dtype);
  if (meta.is_none() || py::object(meta.attr("dtype")).equal(wanted)) return spec;
  static py::object* replace = new py::object(py::module_::import("dataclasses").attr("replace"));
  static py::object* tensor_meta = new py::object(
      py::module_::import("torch.distributed.tensor._dtensor_spec").attr("TensorMeta"));
  return (*replace)(spec, py::arg("tensor_meta") = (*tensor_meta)(meta.attr("shape"),
                                                                  meta.attr("stride"), wanted));
}

// Whether `a` is a floating-point dtype that holds every value of the
// floating-point dtype `b` (a larger one: fp32 over bf16 and fp16).
bool wider_floating(at::ScalarType a, at::ScalarType b) {
  return at::isFloatingType(a) && at::isFloatingType(b) && c10::elementSize(a) > c10::elementSize(b);
}

// Upstream frees and re-allocates these storages with
// torch.UntypedStorage.resize_, which torch's memory tracker patches to see
// them and a fake tensor's storage answers (dispatch_modes.hpp). While either
// mode is active, ours go the same way. False: neither (or a storage Python
// cannot resize, such as shared memory's), nothing done.
bool resize_where_the_tracker_sees_it(const at::Tensor& tensor, size_t bytes) {
  if (!tensor.storage().resizable() || !allocations_through_dispatcher()) return false;
  py::gil_scoped_acquire gil;
  py::object storage = py::cast(tensor).attr("untyped_storage")();
  storage.attr("resize_")(bytes);
  return true;
}

// Storage is released and re-allocated in place, so every view of it (the
// unsharded parameter, tensors autograd saved in forward) sees the new bytes.
void release_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == 0) return;
  if (resize_where_the_tracker_sees_it(tensor, 0)) return;
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

void allocate_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
  if (storage->nbytes() == bytes) return;
  TORCH_INTERNAL_ASSERT(storage->allocator() != nullptr,
                        "fsdp_ext: all-gather output storage has no allocator");
  if (resize_where_the_tracker_sees_it(tensor, bytes)) return;
  // A host storage first made while the tracker watched has torch's CPU
  // allocator (HostBlockCache::empty): back to the cache from now on. Safe to
  // switch: data already held is freed by its own DataPtr's deleter.
  if (storage->device().is_cpu() && storage->allocator() == c10::GetCPUAllocator()) {
    storage->set_allocator(&HostBlockCache::instance());
  }
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

}  // namespace

FsdpParam::FsdpParam(std::string fqn, std::vector<ModuleSlot> slots, py::object sharded_param,
                     at::Tensor padded_sharded_data, std::vector<int64_t> orig_size,
                     std::vector<int64_t> sharded_size, int64_t shard_world_size,
                     int64_t shard_dim)
    : fqn_(std::move(fqn)),
      slots_(std::move(slots)),
      orig_size_(std::move(orig_size)),
      sharded_size_(std::move(sharded_size)),
      shard_world_size_(shard_world_size),
      shard_dim_(shard_dim),
      sharded_param_(std::move(sharded_param)),
      padded_sharded_data_(std::move(padded_sharded_data)) {
  TORCH_CHECK_VALUE(!slots_.empty(), "fsdp_ext FsdpParam ", fqn_, ": no module holds it");
  TORCH_CHECK_VALUE(shard_dim_ >= 0 && shard_dim_ < static_cast<int64_t>(orig_size_.size()),
                    "fsdp_ext FsdpParam ", fqn_, ": shard dim ", shard_dim_, " is invalid for a ",
                    orig_size_.size(), "-D parameter");
  // A subclass's view(-1) is whatever the subclass makes of it: torchao's
  // int8 training weights answer it with a 2-D wrapper of their own data,
  // which upstream keeps (their all-gather extension gathers their own
  // inputs). Its element count must still be the padded shard's.
  const std::vector<int64_t> padded_size = with_padded_shard_dim(orig_size_);
  TORCH_CHECK_VALUE(
      (padded_sharded_data_.dim() == 1 || is_python_subclass(padded_sharded_data_)) &&
          padded_sharded_data_.numel() == c10::multiply_integers(padded_size),
      "fsdp_ext FsdpParam ", fqn_, ": padded sharded data must be 1-D with the ",
      c10::multiply_integers(padded_size), " elements of a padded shard ", padded_size,
      ", not of size ", padded_sharded_data_.sizes());
  spec_ = sharded_param_.attr("_spec");
  remember_subclass_local(unpack(sharded_param_.attr("_local_tensor")));
  capture_grad_dtype_policy(sharded_param_);
  register_on_modules(sharded_param_);
}

at::Tensor FsdpParam::sharded_tensor() const { return unpack(sharded_param_); }

void FsdpParam::register_on_modules(const py::object& param) {
  for (const ModuleSlot& slot : slots_) {
    if (slot.plain_dict_write) {
      if (PyDict_SetItem(slot.parameters.ptr(), slot.name.ptr(), param.ptr()) != 0) {
        throw py::error_already_set();
      }
    } else {
      py::object module = slot.module();  // None once the module is gone
      if (!module.is_none()) py::setattr(module, slot.name, param);
    }
  }
}

void FsdpParam::to_sharded() {
  register_on_modules(sharded_param_);
  release_unsharded_storage();
  post_forward_param_ = py::object();
  post_forward_data_ = at::Tensor();
  state_ = ShardedState::kSharded;
}

void FsdpParam::to_sharded_post_forward(int64_t rank, int64_t world, const py::object& spec) {
  TORCH_CHECK(state_ == ShardedState::kUnsharded, "fsdp_ext ", fqn_,
              ": resharding to the post-forward mesh needs unsharded parameters");
  const int64_t numel = all_gather_output_.numel();
  TORCH_CHECK(numel % world == 0, "fsdp_ext ", fqn_, ": all-gather output of ", numel,
              " elements does not split over ", world, " post-forward ranks");
  const int64_t chunk = numel / world;
  post_forward_data_ = all_gather_output_.narrow(0, chunk * rank, chunk).clone();
  // This rank's dim-0 chunk of the original shape over `world` ranks.
  std::vector<int64_t> size = orig_size_;
  size[0] = shard_extent(orig_size_[0], world, rank).length;
  at::Tensor local = post_forward_data_.as_strided(size, c10::contiguous_strides(size), 0);
  post_forward_param_ = parameter_class()(make_dtensor(local, spec),
                                          py::arg("requires_grad") = requires_grad());
  if (grad_dtype_policy_.overridden) {
    post_forward_param_.attr("grad_dtype") = py::cast(grad_dtype_policy_.dtype);
  }
  register_on_modules(post_forward_param_);
  release_unsharded_storage();
  state_ = ShardedState::kShardedPostForward;
}

void FsdpParam::to_unsharded() {
  TORCH_CHECK(unsharded_tensor_.defined(), "fsdp_ext ", fqn_,
              ": to_unsharded before the unsharded parameter exists");
  if (unsharded_tensor_.requires_grad() != requires_grad()) {
    unsharded_tensor_.set_requires_grad(requires_grad());
  }
  register_on_modules(unsharded_param_);
  post_forward_param_ = py::object();
  post_forward_data_ = at::Tensor();
  state_ = ShardedState::kUnsharded;
}

const at::Tensor& FsdpParam::all_gather_input() const {
  return state_ == ShardedState::kShardedPostForward ? post_forward_data_ : padded_sharded_data_;
}

void FsdpParam::init_dtype_attrs(std::optional<at::ScalarType> param_dtype,
                                 std::optional<at::ScalarType> reduce_dtype) {
  policy_param_dtype_ = param_dtype;
  policy_reduce_dtype_ = reduce_dtype;
  clamp_dtypes();
}

void FsdpParam::clamp_dtypes() {
  // Before torch 2.15, reduce_dtype is compared with the policy's param_dtype
  // before that is clamped, as upstream does: with param_dtype ==
  // reduce_dtype == the parameter's dtype, neither casts.
  const std::optional<at::ScalarType> param_dtype = param_dtype_override_ ? param_dtype_override_
                                                                          : policy_param_dtype_;
  const bool keeps_reduce_dtype =
      torch_compat::kGradDtypePolicies || policy_reduce_dtype_ != param_dtype;
  reduce_dtype_ = keeps_reduce_dtype ? policy_reduce_dtype_ : std::nullopt;
  const bool floating = at::isFloatingType(orig_dtype());
  param_dtype_ = (param_dtype == orig_dtype() || !floating) ? std::nullopt : param_dtype;
  drop_unsharded_of_stale_dtype();
  apply_unsharded_grad_dtype();
}

std::optional<at::ScalarType> FsdpParam::sharded_grad_dtype() const {
  return grad_dtype_policy_.overridden ? grad_dtype_policy_.dtype
                                       : std::optional<at::ScalarType>(orig_dtype());
}

std::optional<at::ScalarType> FsdpParam::unsharded_grad_dtype() const {
  if (reduce_dtype_ || !torch_compat::kGradDtypePolicies) return reduce_dtype_;
  return sharded_grad_dtype();
}

void FsdpParam::capture_grad_dtype_policy(const py::object& param) {
  if (!torch_compat::kGradDtypePolicies) return;
  if (!py::cast<bool>(param.attr("_has_grad_dtype_override"))) return;
  grad_dtype_policy_.overridden = true;
  grad_dtype_policy_.dtype = py::cast<std::optional<at::ScalarType>>(param.attr("grad_dtype"));
}

// Note [a wider gradient dtype]
// A gradient whose unsharded grad dtype is wider than the dtype its
// parameter computes in (fp32 for bf16) comes from autograd in the compute
// dtype and is upcast where it is copied into the reduce-scatter input, or
// into the accumulator without sync (to_accumulated_grad_if_needed): one
// cast, and no wide copy held through backward. Upstream (torch 2.15) defers
// the upcast the same way, clearing the unsharded parameter's grad_dtype for
// the backward. Every other unsharded grad dtype becomes the unsharded
// parameter's grad_dtype, so autograd produces and accumulates gradients in
// it, as upstream's: a narrower one (fp32 compute, reduce_dtype=bf16) rounds
// each microbatch's gradient before it is added to the others; None lets a
// gradient of any dtype through; and a tensor-parallel parameter whose
// gradient is reduced over TP first (set_reduces_grad_outside_dp) gets it in
// the wider dtype, so that reduction runs in it too.
void FsdpParam::apply_unsharded_grad_dtype() {
  if (!torch_compat::kGradDtypePolicies || !unsharded_param_) return;
  const at::ScalarType compute = unsharded_dtype();
  std::optional<at::ScalarType> grad = unsharded_grad_dtype();
  if (grad && wider_floating(*grad, compute) && !reduces_grad_outside_dp_) grad = compute;
  py::object wanted = grad ? py::cast(*grad) : py::none();
  if (!py::object(unsharded_param_.attr("grad_dtype")).equal(wanted)) {
    unsharded_param_.attr("grad_dtype") = wanted;
  }
}

void FsdpParam::drop_unsharded_of_stale_dtype() {
  if (!all_gather_output_.defined() || all_gather_output_.scalar_type() == unsharded_dtype()) {
    return;
  }
  TORCH_CHECK(state_ != ShardedState::kUnsharded, "fsdp_ext ", fqn_,
              ": the parameter dtype changed while unsharded; reshard first");
  TORCH_CHECK(!host_shared_, "fsdp_ext ", fqn_,
              ": the parameter dtype changed after set_host_shared_parameters laid out the "
              "host-shared memory in ", all_gather_output_.scalar_type());
  all_gather_output_ = at::Tensor();
  unsharded_param_ = py::object();
  unsharded_tensor_ = at::Tensor();
}

void FsdpParam::use_host_shared_output(at::Tensor output) {
  TORCH_CHECK(!unsharded_tensor_.defined(), "fsdp_ext ", fqn_,
              ": host-shared parameters must be set before the first forward");
  TORCH_CHECK(output.dim() == 1 && output.numel() == all_gather_output_numel() &&
                  output.scalar_type() == unsharded_dtype(),
              "fsdp_ext ", fqn_, ": a host-shared all-gather output of ", output.numel(), " ",
              output.scalar_type(), " for ", all_gather_output_numel(), " ", unsharded_dtype());
  all_gather_output_ = std::move(output);
  host_shared_ = true;
}

const at::Tensor& FsdpParam::allocated_all_gather_output() {
  if (host_shared_) return all_gather_output_;
  if (!all_gather_output_.defined()) {
    // On the host from the block cache, which the storage's later
    // re-allocations (allocate_storage) go through too.
    all_gather_output_ =
        padded_sharded_data_.is_cpu()
            ? HostBlockCache::empty(all_gather_output_numel(), unsharded_dtype())
            : at::empty({all_gather_output_numel()},
                        padded_sharded_data_.options().dtype(unsharded_dtype()));
  } else {
    allocate_storage(all_gather_output_);
  }
  return all_gather_output_;
}

std::vector<at::Tensor> FsdpParam::extension_inputs() {
  return py::cast<std::vector<at::Tensor>>(extension_.attr("inputs")());
}

std::vector<at::Tensor> FsdpParam::extension_outputs(const std::vector<at::Tensor>& inputs,
                                                     int64_t world_size) {
  return py::cast<std::vector<at::Tensor>>(extension_.attr("outputs")(inputs, world_size));
}

void FsdpParam::init_unsharded_param() {
  if (has_extension()) {
    py::object dtype = py::cast(unsharded_dtype());
    if (unsharded_tensor_.defined()) {
      extension_.attr("unsharded")(dtype, unsharded_param_);
      return;
    }
    py::object tensor = extension_.attr("unsharded")(dtype, py::none());
    if (is_dtensor()) {
      // The post hook built the local tensor; its own dtype goes into the
      // spec (a quantised tensor keeps the parameter's), as upstream's.
      const at::Tensor local = unpack(tensor);
      tensor = make_dtensor(local, spec_with_dtype(unsharded_spec_, local.scalar_type()));
    }
    unsharded_param_ = parameter_class()(tensor, py::arg("requires_grad") = requires_grad());
    unsharded_tensor_ = unpack(unsharded_param_);
    apply_unsharded_grad_dtype();
    return;
  }
  if (unsharded_tensor_.defined()) return;
  TORCH_CHECK(all_gather_output_.defined(), "fsdp_ext ", fqn_,
              ": init_unsharded_param before the first all-gather");
  at::Tensor view = all_gather_output_.as_strided(orig_size_, c10::contiguous_strides(orig_size_),
                                                  all_gather_output_.storage_offset());
  py::object data = is_dtensor() ? make_dtensor(view, spec_with_dtype(unsharded_spec_,
                                                                      unsharded_dtype()))
                                 : py::reinterpret_steal<py::object>(THPVariable_Wrap(view));
  unsharded_param_ = parameter_class()(data, py::arg("requires_grad") = requires_grad());
  unsharded_tensor_ = unpack(unsharded_param_);
  apply_unsharded_grad_dtype();
}

const py::object& FsdpParam::grad_spec(at::ScalarType dtype) {
  if (dtype == orig_dtype()) return spec_;
  if (!grad_spec_ || grad_spec_dtype_ != dtype) {
    grad_spec_ = spec_with_dtype(spec_, dtype);
    grad_spec_dtype_ = dtype;
  }
  return grad_spec_;
}

at::Tensor FsdpParam::local_grad(at::Tensor grad) const {
  if (!grad.defined() || !is_dtensor()) return grad;
  static py::object* helper = new py::object(
      py::module_::import("torch_fsdp_ext.fsdp._tensor_parallel").attr("local_grad"));
  py::object wrapped = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(grad)));
  return unpack((*helper)(wrapped, unsharded_spec_.attr("placements"), grad_dp_dims_));
}

void FsdpParam::release_unsharded_storage() {
  if (keep_unsharded_storage_) return;
  if (has_extension() && unsharded_tensor_.defined()) extension_.attr("release")();
  // Host-shared memory stays: the other ranks of the host share it.
  if (all_gather_output_.defined() && !host_shared_) release_storage(all_gather_output_);
}

void FsdpParam::drop_unsharded_grad() {
  accumulated_grad_ = at::Tensor();
  if (unsharded_tensor_.defined()) unsharded_tensor_.mutable_grad() = at::Tensor();
}

at::Tensor FsdpParam::take_unsharded_grad() {
  if (accumulated_grad_.defined()) return local_grad(std::exchange(accumulated_grad_, at::Tensor()));
  if (!unsharded_tensor_.defined()) return at::Tensor();
  return local_grad(std::exchange(unsharded_tensor_.mutable_grad(), at::Tensor()));
}

void FsdpParam::accumulate_unsharded_grad_if_needed() {
  if (!accumulated_grad_.defined() || !unsharded_tensor_.defined()) return;
  at::Tensor& grad = unsharded_tensor_.mutable_grad();
  if (!grad.defined()) return;
  // DTensor parameters accumulate DTensors, as upstream: one redistribution
  // (e.g. of a Partial gradient) when the sum is finally reduced.
  accumulated_grad_.add_(std::exchange(grad, at::Tensor()));
}

void FsdpParam::to_accumulated_grad_if_needed() {
  const std::optional<at::ScalarType> dtype = unsharded_grad_dtype();
  if (!dtype || !unsharded_tensor_.defined()) return;
  at::Tensor& grad = unsharded_tensor_.mutable_grad();
  if (!grad.defined() || grad.scalar_type() == *dtype) return;
  accumulated_grad_ = std::exchange(grad, at::Tensor()).to(*dtype);
}

void FsdpParam::accumulate_sharded_grad(const at::Tensor& shard) {
  at::Tensor sharded = sharded_tensor();
  at::Tensor& grad = sharded.mutable_grad();
  if (grad.defined()) {
    py::object existing = py::reinterpret_steal<py::object>(THPVariable_Wrap(grad));
    unpack(existing.attr("_local_tensor")).add_(shard);
  } else {
    grad = unpack(make_dtensor(shard, grad_spec(shard.scalar_type())));
  }
  // The parameter's post-accumulate-grad hooks, read from the tensor object
  // itself (the field behind `_post_accumulate_grad_hooks`): this runs per
  // parameter and step, and an attribute lookup on a tensor subclass costs
  // about a microsecond.
  PyObject* hooks = reinterpret_cast<THPVariable*>(sharded_param_.ptr())->post_accumulate_grad_hooks;
  if (hooks != nullptr && hooks != Py_None) {
    for (auto hook : py::reinterpret_borrow<py::dict>(hooks)) {
      py::reinterpret_borrow<py::object>(hook.second)(sharded_param_);
    }
  }
}

std::vector<int64_t> FsdpParam::with_padded_shard_dim(std::vector<int64_t> size) const {
  size[shard_dim_] = shard_extent(orig_size_[shard_dim_], shard_world_size_, 0).padded;
  return size;
}

void FsdpParam::remember_subclass_local(const at::Tensor& local) {
  subclass_local_.reset();
  if (is_python_subclass(local)) subclass_local_.emplace(local.getIntrusivePtr());
}

bool FsdpParam::is_subclass_local(const at::Tensor& local) const {
  if (!subclass_local_) return false;
  // Alive, so the same address is the same tensor.
  const c10::intrusive_ptr<c10::TensorImpl> alive = subclass_local_->lock();
  return alive && alive.get() == local.unsafeGetTensorImpl();
}

void FsdpParam::reset_sharded_param() {
  const ModuleSlot& owner = slots_.front();
  py::object param = py::reinterpret_borrow<py::dict>(owner.parameters)[owner.name];
  // A grad_dtype set on the sharded parameter since (or on the one that
  // replaced it) is the policy from now on; a parameter rebuilt without one
  // (Module._apply, load_state_dict(assign=True)) gets the policy back.
  capture_grad_dtype_policy(sharded_param_);
  if (!param.is(sharded_param_)) {
    capture_grad_dtype_policy(param);
    sharded_param_ = param;
  }
  if (grad_dtype_policy_.overridden && !py::cast<bool>(param.attr("_has_grad_dtype_override"))) {
    param.attr("grad_dtype") = py::cast(grad_dtype_policy_.dtype);
  }
  spec_ = sharded_param_.attr("_spec");
  grad_spec_ = py::object();
  at::Tensor local = unpack(sharded_param_.attr("_local_tensor"));
  if (local.is_meta()) return;
  // Still a view of our padded data? Data pointers tell for plain tensors
  // (a view of the same memory counts); a subclass must be the very view we
  // made (Note [tensor subclass parameters]).
  const bool backed =
      !padded_sharded_data_.is_meta() &&
      local.scalar_type() == padded_sharded_data_.scalar_type() &&
      local.device() == padded_sharded_data_.device() &&
      (is_python_subclass(local)
           ? is_subclass_local(local)
           : !is_python_subclass(padded_sharded_data_) &&
                 (local.numel() == 0 || local.data_ptr() == padded_sharded_data_.data_ptr()));
  if (backed) return;
  TORCH_CHECK_VALUE(local.dim() >= 1 && local.is_contiguous(), "fsdp_ext ", fqn_,
                    ": the sharded local tensor must be contiguous with at least one dim");
  const std::vector<int64_t> padded_size = with_padded_shard_dim(local.sizes().vec());
  const int64_t dim = shard_dim_;
  // A local tensor of the padded size (an even shard) becomes the sharded
  // data as it is, no copy, as upstream's: after load_state_dict(assign=True)
  // the parameter holds the very tensors loaded (and whatever storage they
  // view, shared or larger, stays alive with them, as upstream's). A shorter
  // one is padded: new_zeros and copy_ keep a tensor subclass's class, as
  // upstream's do.
  at::Tensor padded = local;
  if (local.sizes() != c10::IntArrayRef(padded_size)) {
    padded = local.new_zeros(padded_size);
    padded.narrow(dim, 0, local.size(dim)).copy_(local);
  }
  // CPUOffloadPolicy(pin_memory=True)
  if (pin_memory_ && !padded.is_pinned()) padded = padded.cpu().pin_memory();
  padded_sharded_data_ = padded.view({-1});
  if (padded.is_same(local)) {
    remember_subclass_local(local);
  } else {
    at::Tensor new_local = padded.narrow(dim, 0, local.size(dim));
    remember_subclass_local(new_local);
    sharded_param_.attr("_local_tensor") = new_local;
  }
  // A later all-gather allocates an output of the new unsharded dtype.
  clamp_dtypes();
}

}  // namespace fsdp_ext::fsdp
