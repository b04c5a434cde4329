// Python bindings of the FSDP runtime (csrc/fsdp): the parameter, the group
// state machine, the shared comm context and the event trace sink. The thin
// Python layer (torch_fsdp_ext/fsdp) builds these at fully_shard time and
// calls them from module and autograd hooks.
#include <pybind11/native_enum.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include "fsdp/comm_context.hpp"
#include "fsdp/event_trace.hpp"
#include "fsdp/fsdp_param.hpp"
#include "fsdp/fsdp_param_group.hpp"
#include "fsdp/fsdp_state.hpp"
#include "fsdp/shard_extent.hpp"

namespace py = pybind11;

namespace fsdp_ext::python {

using fsdp::FsdpCommContext;
using fsdp::FsdpParam;
using fsdp::FsdpParamGroup;
using fsdp::CollectiveGroup;
using fsdp::ProcessGroupPtr;
using fsdp::TrainingState;

void bind_forward_hooks(py::module_& m);  // forward_hook_callables.cpp

namespace {

// A Python process group object (or None) as the runtime's CollectiveGroup.
// Only a ProcessGroup subclass written in Python (e.g. torch's threaded test
// group) needs its collectives issued through torch.distributed.
CollectiveGroup collective_group(const py::object& group) {
  if (group.is_none()) return {};
  auto process_group = group.cast<ProcessGroupPtr>();
  // Leaked on purpose: a static py::object would be released after the
  // interpreter is gone.
  static const py::object* native =
      new py::object(py::module_::import("torch.distributed").attr("ProcessGroup"));
  const bool python_impl = !py::type::of(group).is(*native);
  return CollectiveGroup(std::move(process_group), group, python_impl);
}

// `group.<method>()` as a Python callable that holds the group weakly: the
// group keeps it (ReplaceableMethod), so a strong reference would be a cycle.
py::object bound_group_method(const std::shared_ptr<FsdpParamGroup>& group,
                              void (FsdpParamGroup::*method)()) {
  std::weak_ptr<FsdpParamGroup> weak = group;
  return py::cpp_function([weak, method] {
    std::shared_ptr<FsdpParamGroup> alive = weak.lock();
    if (!alive) throw std::runtime_error("FsdpParamGroup method called after its group was freed");
    ((*alive).*method)();
  });
}

// The getter and setter of a group method Python may assign
// (ReplaceableMethod): `slot` is its accessor, `method` the C++ method.
using GroupMethod = void (FsdpParamGroup::*)();
using MethodSlot = fsdp::ReplaceableMethod& (FsdpParamGroup::*)();

auto replaceable_getter(MethodSlot slot, GroupMethod method) {
  return [slot, method](const std::shared_ptr<FsdpParamGroup>& self) {
    return ((*self).*slot)().get([&] { return bound_group_method(self, method); });
  };
}

auto replaceable_setter(MethodSlot slot) {
  return [slot](FsdpParamGroup& self, py::object value) { (self.*slot)().set(std::move(value)); };
}

}  // namespace

void bind_fsdp_runtime(py::module_& m) {
  m.attr("_HOST_SHARED_CONTROL_BYTES_PER_RANK") = fsdp::HostSharedParameters::kControlBytesPerRank;
  // The state enums, exported to users as torch_fsdp_ext.TrainingState /
  // ShardedState (upstream's member names and values).
  // Real enum.Enum classes (py::native_enum), as upstream's are.
  py::native_enum<TrainingState>(m, "TrainingState", "enum.Enum",
                                 "A parameter group's place in the training step.")
      .value("FORWARD", TrainingState::kForward)
      .value("PRE_BACKWARD", TrainingState::kPreBackward)
      .value("POST_BACKWARD", TrainingState::kPostBackward)
      .value("IDLE", TrainingState::kIdle)
      .finalize();
  py::native_enum<fsdp::ShardedState>(m, "ShardedState", "enum.Enum",
                                      "Which parameters a group's modules hold.")
      .value("SHARDED", fsdp::ShardedState::kSharded)
      .value("SHARDED_POST_FORWARD", fsdp::ShardedState::kShardedPostForward)
      .value("UNSHARDED", fsdp::ShardedState::kUnsharded)
      .finalize();
  m.def(
      "_fsdp_shard_extent",
      [](int64_t size, int64_t world, int64_t rank) {
        TORCH_CHECK_VALUE(world >= 1 && rank >= 0 && rank < world && size >= 0,
                          "fsdp_ext _fsdp_shard_extent: bad size ", size, " world ", world,
                          " rank ", rank);
        const fsdp::ShardExtent e = fsdp::shard_extent(size, world, rank);
        return py::make_tuple(e.padded, e.start, e.length);
      },
      py::arg("size"), py::arg("world"), py::arg("rank"),
      "(padded slots per rank, first owned index, owned length) along one dimension.");

  py::class_<FsdpParam, std::shared_ptr<FsdpParam>>(m, "FsdpParam")
      .def(py::init([](std::string fqn, const py::list& slots, py::object sharded_param,
                       at::Tensor padded_sharded_data, std::vector<int64_t> orig_size,
                       std::vector<int64_t> sharded_size, int64_t shard_world_size,
                       int64_t shard_dim) {
             std::vector<fsdp::ModuleSlot> module_slots;
             for (const py::handle& slot : slots) {
               auto entry = slot.cast<py::tuple>();
               py::object module = entry[0];
               module_slots.push_back({py::weakref(module), module.attr("_parameters"),
                                       entry[1].cast<py::str>(), entry[2].cast<bool>()});
             }
             return std::make_shared<FsdpParam>(
                 std::move(fqn), std::move(module_slots), std::move(sharded_param),
                 std::move(padded_sharded_data), std::move(orig_size), std::move(sharded_size),
                 shard_world_size, shard_dim);
           }),
           py::arg("fqn"), py::arg("slots"), py::arg("sharded_param"),
           py::arg("padded_sharded_data"), py::arg("orig_size"), py::arg("sharded_size"),
           py::arg("shard_world_size"), py::arg("shard_dim") = 0,
           "slots: (module, attribute name, write module._parameters directly) per holder.")
      .def_property("fqn", &FsdpParam::fqn, &FsdpParam::set_fqn)
      .def_property("keep_unsharded_storage", &FsdpParam::keep_unsharded_storage,
                    &FsdpParam::set_keep_unsharded_storage)
      .def_property_readonly("sharded_state", &FsdpParam::sharded_state)
      .def_property_readonly("sharded_param", &FsdpParam::sharded_param)
      .def_property("unsharded_spec", &FsdpParam::unsharded_spec, &FsdpParam::set_unsharded_spec,
                    "A DTensor parameter's original (TP) DTensorSpec; None for plain ones.")
      .def_property("pin_memory", &FsdpParam::pin_memory, &FsdpParam::set_pin_memory,
                    "Keep the padded sharded data in pinned memory (CPUOffloadPolicy).")
      .def_property("shard_mesh", &FsdpParam::shard_mesh, &FsdpParam::set_shard_mesh,
                    "upstream's FSDPParam.shard_mesh: the data-parallel mesh it is sharded over "
                    "(the shard dim under HSDP), what all-gather extensions are given.")
      .def_property("grad_dp_dims", &FsdpParam::grad_dp_dims, &FsdpParam::set_grad_dp_dims,
                    "dp_mesh_dims: mesh dims where gradients keep their placements.")
      .def_property("param_dtype_override", &FsdpParam::param_dtype_override,
                    &FsdpParam::set_param_dtype_override,
                    "MixedPrecisionPolicy.param_dtype_override_fn's answer (None: the policy's).")
      .def_property("reduces_grad_outside_dp", nullptr, &FsdpParam::set_reduces_grad_outside_dp,
                    "A TP parameter whose gradient may be reduced over TP first.")
      .def_property_readonly("sharded_grad_dtype", &FsdpParam::sharded_grad_dtype,
                             "The dtype of its sharded gradient (None: the reduce dtype).")
      .def_property_readonly("unsharded_grad_dtype", &FsdpParam::unsharded_grad_dtype,
                             "The dtype its gradient is reduced in (None: the gradient's own).")
      .def_property_readonly("unsharded_param", &FsdpParam::unsharded_param)
      .def_property_readonly("_unsharded_param", &FsdpParam::unsharded_param,
                             "upstream's name of unsharded_param (read by torch's FSDPMemTracker)")
      .def_property_readonly("shard_dim", &FsdpParam::shard_dim)
      .def_property_readonly("padded_sharded_data", &FsdpParam::padded_sharded_data)
      .def_property_readonly("is_meta", &FsdpParam::is_meta)
      .def_property_readonly("orig_size", &FsdpParam::orig_size)
      .def_property_readonly("owner_module", &FsdpParam::owner_module,
                             "The module holding the parameter (None once it is gone).")
      .def_property("extension", &FsdpParam::extension, &FsdpParam::set_extension,
                    "Its AllGatherExtension (torch_fsdp_ext/fsdp/_extensions.py), or None.")
      .def("__repr__", [](const FsdpParam& p) {
        std::string sizes;
        for (int64_t s : p.orig_size()) sizes += (sizes.empty() ? "" : ", ") + std::to_string(s);
        return "FsdpParam(fqn=" + p.fqn() + ", orig_size=(" + sizes + "))";
      });

  // dynamic_attr: the Python side keeps the asynchronous gradient reduction
  // in flight on the context (FSDPModule.finalize_backward(async_op=True)),
  // which every root sharing the context must see.
  py::class_<FsdpCommContext, std::shared_ptr<FsdpCommContext>>(m, "FsdpCommContext",
                                                                py::dynamic_attr())
      .def(py::init<>())
      .def_property("max_reduces_in_flight", &FsdpCommContext::max_reduces_in_flight,
                    &FsdpCommContext::set_max_reduces_in_flight,
                    "The largest set_reduce_scatter_max_input_buffers over the groups.")
      .def("use_device", [](FsdpCommContext& self, const py::object& device, bool streams) {
             self.use_device(device.cast<c10::Device>(), streams);
           }, py::arg("device"), py::arg("streams"),
           "A root on an accelerator: make the side streams (streams=False keeps every "
           "collective on the compute stream).")
      .def("root_pre_forward", &FsdpCommContext::root_pre_forward,
           "The all-gather streams wait for the compute stream (the optimizer's updates).")
      .def("release_all_gather_state", &FsdpCommContext::release_all_gather_state,
           "The root's post-forward: release the last forward all-gather output.")
      .def("all_gather_streams", &FsdpCommContext::all_gather_streams,
           "The all-gather copy-in and all-gather streams (empty without side streams).")
      .def_property_readonly("uses_streams",
                             [](const FsdpCommContext& self) { return self.streams() != nullptr; })
      .def("holds_groups_other_than", &FsdpCommContext::holds_groups_other_than,
           py::arg("groups"),
           "Whether reductions in flight or the forward order hold another root's groups.")
      .def("drop_reduces", &FsdpCommContext::drop_reduces,
           "Wait for in-flight reduce-scatters and discard their results.")
      .def("finish_backward", &FsdpCommContext::finish_backward, py::arg("is_last_backward"),
           "Complete every reduction in flight; after the last backward, forget the forward "
           "order.");

  py::class_<FsdpParamGroup, std::shared_ptr<FsdpParamGroup>>(m, "FsdpParamGroup")
      .def(py::init([](std::vector<std::shared_ptr<FsdpParam>> params,
                       const py::object& shard_group, const py::object& replicate_group) {
             return std::make_shared<FsdpParamGroup>(std::move(params),
                                                     collective_group(shard_group),
                                                     collective_group(replicate_group));
           }),
           py::arg("params"), py::arg("shard_group"), py::arg("replicate_group") = py::none(),
           "shard_group: None for one shard rank (DDP); replicate_group: HSDP's or DDP's group "
           "across replicas (None for FSDP).")
      .def("init_mp_dtypes", &FsdpParamGroup::init_mp_dtypes, py::arg("param_dtype"),
           py::arg("reduce_dtype"),
           "Apply a MixedPrecisionPolicy's dtypes; AssertionError if trainable parameters disagree.")
      .def(
          "set_reshard_after_forward",
          [](FsdpParamGroup& g, bool reshard, const py::object& post_forward_group,
             std::vector<py::object> specs) {
            g.set_reshard_after_forward(reshard, collective_group(post_forward_group),
                                        std::move(specs));
          },
          py::arg("reshard"), py::arg("post_forward_group") = py::none(),
          py::arg("post_forward_specs") = std::vector<py::object>())
      .def_property("comm_ctx", &FsdpParamGroup::comm_context,
                    &FsdpParamGroup::set_comm_context)
      .def("unshard", &FsdpParamGroup::unshard)
      .def("wait_for_unshard", &FsdpParamGroup::wait_for_unshard)
      .def("reshard", &FsdpParamGroup::reshard)
      .def("pre_forward", &FsdpParamGroup::pre_forward)
      .def("post_forward", &FsdpParamGroup::post_forward, py::arg("inside_backward"))
      // Properties, not methods: Python may assign them, as upstream's tools
      // do (Note [a group's backward methods replaced from Python]).
      .def_property("pre_backward",
                    replaceable_getter(&FsdpParamGroup::pre_backward_method,
                                       &FsdpParamGroup::pre_backward),
                    replaceable_setter(&FsdpParamGroup::pre_backward_method))
      .def("set_forward_prefetch", &FsdpParamGroup::set_forward_prefetch, py::arg("targets"))
      .def("set_backward_prefetch", &FsdpParamGroup::set_backward_prefetch, py::arg("targets"),
           py::arg("replaces_implicit"))
      .def("prefetch_forward_targets", &FsdpParamGroup::prefetch_forward_targets)
      .def_property("post_backward",
                    replaceable_getter(&FsdpParamGroup::post_backward_method,
                                       &FsdpParamGroup::post_backward),
                    replaceable_setter(&FsdpParamGroup::post_backward_method))
      .def("finish_backward", &FsdpParamGroup::finish_backward, py::arg("is_last_backward"),
           py::arg("defer_reduction") = false)
      .def("finalize_backward", &FsdpParamGroup::finalize_backward)
      .def_property_readonly("post_backward_pending", &FsdpParamGroup::post_backward_pending)
      .def_property_readonly("has_partial_reduce_output",
                             &FsdpParamGroup::has_partial_reduce_output)
      .def("prefetch_unshard", &FsdpParamGroup::prefetch_unshard, py::arg("training_state"))
      .def("reset_iter_state", &FsdpParamGroup::reset_iter_state)
      .def("to_sharded", &FsdpParamGroup::to_sharded)
      .def("reset_sharded_params", &FsdpParamGroup::reset_sharded_params)
      .def_property("training_state", &FsdpParamGroup::training_state,
                    &FsdpParamGroup::set_training_state)
      .def_property_readonly("sharded_state", &FsdpParamGroup::sharded_state)
      .def_property("module_fqn", &FsdpParamGroup::module_fqn, &FsdpParamGroup::set_module_fqn)
      .def_property("profile_label_suffix", &FsdpParamGroup::profile_label_suffix,
                    &FsdpParamGroup::set_profile_label_suffix)
      .def_property_readonly("params", &FsdpParamGroup::params)
      .def_property_readonly("fsdp_params", &FsdpParamGroup::params, "upstream's name of params")
      .def_property_readonly("uses_post_forward_mesh", &FsdpParamGroup::uses_post_forward_mesh)
      .def_property_readonly("shard_group",
                             [](const FsdpParamGroup& g) { return g.shard_group().process_group(); })
      .def_property_readonly("replicate_group",
                             [](const FsdpParamGroup& g) {
                               const CollectiveGroup& group = g.replicate_group();
                               return group ? py::cast(group.process_group()) : py::none();
                             })
      .def_property(
          "all_reduce_grads", [](FsdpParamGroup& g) { return g.options().all_reduce_grads; },
          [](FsdpParamGroup& g, bool v) { g.options().all_reduce_grads = v; })
      .def_property(
          "reduce_grads", [](FsdpParamGroup& g) { return g.options().reduce_grads; },
          [](FsdpParamGroup& g, bool v) { g.options().reduce_grads = v; })
      .def_property(
          "reshard_after_backward", [](FsdpParamGroup& g) { return g.options().reshard_after_backward; },
          [](FsdpParamGroup& g, bool v) { g.options().reshard_after_backward = v; })
      .def_property(
          "unshard_in_backward", [](FsdpParamGroup& g) { return g.options().unshard_in_backward; },
          [](FsdpParamGroup& g, bool v) { g.options().unshard_in_backward = v; })
      .def_property(
          "allocate_from_group", [](FsdpParamGroup& g) { return g.options().allocate_from_group; },
          [](FsdpParamGroup& g, bool v) { g.options().allocate_from_group = v; })
      .def("host_shared_bytes", &FsdpParamGroup::host_shared_bytes)
      .def(
          "use_host_shared",
          [](FsdpParamGroup& g, at::Tensor region, at::Tensor control,
             std::vector<int64_t> host_ranks, std::vector<int64_t> host_pids,
             std::vector<int64_t> column_ranks, double timeout_seconds) {
            g.use_host_shared(std::move(region), std::move(control), std::move(host_ranks),
                              std::move(host_pids), std::move(column_ranks),
                              std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1e3)));
          },
          py::arg("region"), py::arg("control"), py::arg("host_ranks"), py::arg("host_pids"),
          py::arg("column_ranks"), py::arg("timeout_seconds"))
      .def_property_readonly("host_shared", &FsdpParamGroup::host_shared)
      .def_property(
          "per_parameter_collectives",
          [](FsdpParamGroup& g) { return g.options().per_parameter_collectives; },
          [](FsdpParamGroup& g, bool v) { g.options().per_parameter_collectives = v; })
      .def_property(
          "gradient_divide_factor",
          [](FsdpParamGroup& g) { return g.options().gradient_divide_factor; },
          [](FsdpParamGroup& g, std::optional<double> v) { g.options().gradient_divide_factor = v; })
      .def_property(
          "force_sum_reduction_for_comms",
          [](FsdpParamGroup& g) { return g.options().force_sum_reduction_for_comms; },
          [](FsdpParamGroup& g, bool v) { g.options().force_sum_reduction_for_comms = v; })
      .def_property(
          "reduce_scatter_max_input_buffers",
          [](FsdpParamGroup& g) { return g.options().reduce_scatter_max_input_buffers; },
          [](FsdpParamGroup& g, int64_t v) {
            TORCH_CHECK_VALUE(v >= 1, "max_input_buffers must be a positive int, got ", v);
            g.options().reduce_scatter_max_input_buffers = v;
          })
      .def_property(
          "reduce_scatter_unused_params",
          [](FsdpParamGroup& g) { return g.options().reduce_scatter_unused_params; },
          [](FsdpParamGroup& g, bool v) { g.options().reduce_scatter_unused_params = v; })
      .def("set_custom_all_gather", &FsdpParamGroup::set_custom_all_gather, py::arg("comm"))
      .def("set_custom_reduce_scatter", &FsdpParamGroup::set_custom_reduce_scatter,
           py::arg("comm"))
      .def_property_readonly("has_custom_comm", &FsdpParamGroup::has_custom_comm)
      .def("set_all_reduce_hook", &FsdpParamGroup::set_all_reduce_hook, py::arg("hook"))
      .def(
          "set_reduce_scatter_group",
          [](FsdpParamGroup& g, const py::object& group) {
            g.set_reduce_scatter_group(collective_group(group));
          },
          py::arg("group"), "A separate group for reduce-scatters; None: the shard group.")
      .def_property_readonly("reduce_scatter_group", [](const FsdpParamGroup& g) {
        return g.has_separate_reduce_scatter_group()
                   ? py::cast(g.reduce_scatter_group().process_group())
                   : py::none();
      });

  // The hook layer's state (fsdp_state.hpp).
  py::class_<fsdp::FsdpStateContext, std::shared_ptr<fsdp::FsdpStateContext>>(
      m, "FsdpStateContext", "Shared by the states under one root: the end-of-backward callback.")
      .def(py::init<>())
      .def("set_final_callback", &fsdp::FsdpStateContext::set_final_callback,
           py::arg("callback"),
           "A callable returning the callable to run at the end of backward, or None "
           "(weakref.WeakMethod).")
      .def_property_readonly("final_callback_queued",
                             &fsdp::FsdpStateContext::final_callback_queued)
      .def("final_callback_done", &fsdp::FsdpStateContext::final_callback_done)
      .def("set_forward_root", &fsdp::FsdpStateContext::set_forward_root, py::arg("state"),
           "The state whose pre-forward started the current forward; None between forwards.")
      .def("set_states", &fsdp::FsdpStateContext::set_states, py::arg("states"),
           "Every state under the root, in order (held weakly).")
      .def("finish_backward", &fsdp::FsdpStateContext::finish_backward,
           py::arg("is_last_backward"), py::arg("defer_reduction") = false,
           "Each state's finish_backward, in order.");
  py::class_<fsdp::FsdpState, std::shared_ptr<fsdp::FsdpState>>(
      m, "FsdpState", "The hook layer's state of one fully_shard call; its backward hooks.")
      .def(py::init<>())
      .def_property("training_state", &fsdp::FsdpState::training_state,
                    &fsdp::FsdpState::set_training_state)
      .def_property("context", &fsdp::FsdpState::context, &fsdp::FsdpState::set_context)
      .def_property("groups", &fsdp::FsdpState::groups, &fsdp::FsdpState::set_groups)
      .def("set_groupless_forward_prefetch",
           &fsdp::FsdpState::set_groupless_forward_prefetch, py::arg("targets"))
      .def("set_groupless_backward_prefetch",
           &fsdp::FsdpState::set_groupless_backward_prefetch, py::arg("targets"))
      .def_property_readonly("in_pre_backward", &fsdp::FsdpState::in_pre_backward)
      .def("enter_forward", &fsdp::FsdpState::enter_forward,
           "FORWARD; True when this is the state's first forward hook of the pass.")
      .def("pre_forward_groups", &fsdp::FsdpState::pre_forward_groups, py::arg("grad_inputs"),
           "Each group's pre_forward; the post-backward node on grad_inputs for each group "
           "entering FORWARD. Returns grad_inputs wrapped.")
      .def("prefetch_forward", &fsdp::FsdpState::prefetch_forward)
      .def("post_forward_groups", &fsdp::FsdpState::post_forward_groups,
           py::arg("inside_backward"), py::arg("grad_outputs"),
           "Each group's post_forward, the pre-backward hook on grad_outputs, IDLE.")
      .def_property("module_classes", &fsdp::FsdpState::module_classes,
                    &fsdp::FsdpState::set_module_classes)
      .def("register_pre_backward", &fsdp::FsdpState::register_pre_backward,
           py::arg("outputs"),
           "A C++ hook on each output that requires grad: the state's pre_backward.")
      .def(
          "set_forward_setup",
          [](fsdp::FsdpState& state, bool ready, std::optional<at::ScalarType> input_dtype,
             std::optional<at::ScalarType> output_dtype) {
            state.set_forward_setup({ready, input_dtype, output_dtype});
          },
          py::arg("ready"), py::arg("input_dtype"), py::arg("output_dtype"),
          "Whether the C++ forward hooks may take this state's forwards, and its casts.");

  // The module forward hooks' C++ path (forward_hooks.hpp), as builtin
  // functions (forward_hook_callables.cpp).
  bind_forward_hooks(m);

  m.def("_fsdp_set_trace_sink", &fsdp::EventTrace::set_sink, py::arg("record"),
        "Install record(event, module_fqn, training_state) for every group event; None removes.");
}

}  // namespace fsdp_ext::python
