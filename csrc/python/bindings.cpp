// torch_fsdp_ext._C: the backend class (a c10d.Backend subclass, so torch's
// ProcessGroup can hold it) and its factory. Registration with
// torch.distributed happens in Python (torch_fsdp_ext/_registration.py).
#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include "backend/flight_recorder.hpp"
#include "backend/fsdp_ext_backend.hpp"
#include "backend/fsdp_ext_work.hpp"
#include "comm/algorithm_selection.h"
#include "comm/algorithms/small_ops.h"
#include "comm/memory_limits.h"
#include "comm/peer_liveness.h"
#include "comm/ucx_library.h"
#include "fsdp/copy_kernels.hpp"
#include "fsdp/copy_kernels_device.hpp"
#include "fsdp/host_block_cache.hpp"

namespace py = pybind11;
using fsdp_ext::backend::FsdpExtBackend;

namespace fsdp_ext::python {
void bind_fsdp_runtime(py::module_& m);  // fsdp_bindings.cpp
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "fsdp_ext c10d backend (UCX for CPU tensors)";
  // The c10d.Backend base class is registered by torch.distributed.
  py::module_::import("torch.distributed");
  // A wait() that holds the GIL must not wait for the progress thread to let
  // go of the op: it may need the GIL to get there (fsdp_ext_work.hpp).
  fsdp_ext::backend::set_release_wait_check([] { return PyGILState_Check() == 0; });

  py::class_<FsdpExtBackend, c10d::Backend, c10::intrusive_ptr<FsdpExtBackend>>(
      m, "FsdpExtBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, const std::string& group_name,
                       std::optional<fsdp_ext::backend::NcclFactory> nccl_factory,
                       std::vector<uint64_t> global_ranks) {
             auto backend = c10::make_intrusive<FsdpExtBackend>(
                 store, rank, size, timeout, group_name, nccl_factory.value_or(nullptr));
             backend->set_global_ranks(std::move(global_ranks));
             return backend;
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("group_name"), py::arg("nccl_factory") = py::none(),
           py::arg("global_ranks") = std::vector<uint64_t>{},
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly(
          "cuda_route", &FsdpExtBackend::cuda_route_description,
          "How this group's ops on CUDA tensors run ('' before its first one): nccl, ipc\n"
          "or staged through host memory, with why (backend/cuda/cuda_path.hpp).")
      .def_property_readonly(
          "options", &FsdpExtBackend::getBackendOptions,
          "The group's Backend.Options (timeout, group name, global ranks), as gloo's.")
      .def_property_readonly("shared_memory_enabled", &FsdpExtBackend::shared_memory_enabled,
                             "Whether this group's ranks share memory (one host; decided at init).")
      .def(
          "_pool_stats",
          [](const FsdpExtBackend& backend) {
            const fsdp_ext::comm::SharedPoolStats stats = backend.pool_stats();
            py::dict out;
            out["segments"] = stats.segments;
            out["in_use"] = stats.in_use;
            out["reserved_bytes"] = stats.reserved_bytes;
            out["registrations"] = stats.registrations;
            out["allocations"] = stats.allocations;
            out["reuses"] = stats.reuses;
            out["mapped_peer_segments"] = backend.mapped_peer_segments();
            out["pieces_in_place"] = backend.shared_memory_domain().pieces_offered_in_place();
            out["pieces_staged"] = backend.shared_memory_domain().pieces_staged();
            out["process_reads_enabled"] = backend.shared_memory_domain().process_reads();
            out["pieces_process_reads"] =
                backend.shared_memory_domain().pieces_offered_for_process_reads();
            return out;
          },
          "Counters of the group's buffer pool and of peers' segments mapped here\n"
          "(for leak checks), and how many shared-memory pieces were offered to\n"
          "peers in place, after a staging copy, or for process_vm_readv.")
      .def(
          "_cuda_counters",
          [](const FsdpExtBackend& backend) {
            const fsdp_ext::backend::CudaPathCounters path = backend.cuda_path_counters();
            const fsdp_ext::backend::CudaBuffers::Stats buffers = backend.cuda_buffer_stats();
            py::dict out;
            out["staged_ops"] = path.staged_ops;
            out["peer_buffers_opened"] = path.peer_buffers_opened;
            out["buffers"] = buffers.buffers;
            out["buffers_in_use"] = buffers.in_use;
            out["buffer_bytes"] = buffers.reserved_bytes;
            out["allocations"] = buffers.allocations;
            out["reuses"] = buffers.reuses;
            out["buffers_exported"] = buffers.exported;
            return out;
          },
          "Where this group's CUDA ops took their data (ops staged through host\n"
          "memory, peers' buffers opened here) and its device buffers' counters\n"
          "(allocate_tensor on CUDA); zeros before the first of each.")
      .def(
          "_op_counters",
          [](const FsdpExtBackend& backend) {
            py::dict out;
            out["ops"] = backend.engine().ops_run();
            out["collective_sequences"] = backend.engine().sequences_used();
            const FsdpExtBackend::SmallOpCounts small = backend.small_op_counts();
            out["small_ops_enabled"] = small.enabled;
            out["small_ops_on_caller"] = small.on_caller;
            out["small_ops_handed_over"] = small.handed_over;
            out["small_ops_queued"] = small.queued;
            return out;
          },
          "Ops run by the progress engine and collective sequence numbers used\n"
          "(a fused bucket uses one op and one sequence number); small-op channel\n"
          "ops finished on the calling thread, handed to the engine part way, or\n"
          "queued whole.");

  m.def(
      "_selected_algorithm",
      [](const std::string& op, size_t bytes, int group_size, bool shared_memory,
         bool small_op_channel, bool spans_hosts) -> std::string {
        using namespace fsdp_ext::comm;
        // What each rank contributes to the small-op channel, for the ops
        // that may take it (the backend decides the same way: small_ops.cpp).
        auto channel = [&](size_t per_rank, const char* variable) {
          return small_op_channel && group_size > 1 && takes_small_op_channel(per_rank, variable);
        };
        if (op == "all_gather_into_tensor") {
          if (channel(bytes / group_size, "FSDP_EXT_ALLGATHER_ALGO")) return "channel";
          return algorithm_name(select_allgather(bytes, group_size, shared_memory));
        }
        if (op == "reduce_scatter_tensor") {
          if (channel(bytes, "FSDP_EXT_REDUCE_SCATTER_ALGO")) return "channel";
          return algorithm_name(
              select_reduce_scatter(bytes, group_size, shared_memory, spans_hosts));
        }
        if (op == "all_reduce") {
          if (channel(bytes, "FSDP_EXT_ALLREDUCE_ALGO")) return "channel";
          return algorithm_name(select_allreduce(bytes, group_size, shared_memory));
        }
        if (op == "broadcast") {
          if (channel(bytes, "FSDP_EXT_BROADCAST_ALGO")) return "channel";
          return algorithm_name(select_broadcast(bytes, group_size, shared_memory));
        }
        throw py::value_error("unknown op '" + op + "'");
      },
      py::arg("op"), py::arg("bytes"), py::arg("group_size"), py::arg("shared_memory") = true,
      py::arg("small_op_channel") = false, py::arg("spans_hosts") = false,
      "The algorithm fsdp_ext picks for `op` on a message of `bytes` (the\n"
      "all-gather output / reduce-scatter input / buffer) in a group of `group_size`\n"
      "whose ranks do (or do not) share memory and span (or do not span) hosts;\n"
      "\"channel\" where a group with the small-op channel on (one host) completes\n"
      "the op through it.");

  // Which UCX the loader bound (comm/ucx_library.h): torch_fsdp_ext/_native.py
  // checks it against the one _C was built against.
  m.def(
      "_ucx_library",
      [] {
        const fsdp_ext::comm::UcxLibrary library = fsdp_ext::comm::loaded_ucx_library();
        py::dict out;
        out["version"] = library.version;
        out["directory"] = library.directory;
        out["built_against"] = library.built_against;
        return out;
      },
      "The UCX this process runs: {'version', 'directory' (of libucp),\n"
      "'built_against' ('system' or 'wheel')}.");

  // This process's liveness connections (comm/peer_liveness.h), for tests.
  m.def(
      "_liveness_endpoint", [] { return fsdp_ext::comm::PeerLiveness::of_this_process().endpoint(); },
      "Where peers on other hosts connect to watch this process: \"ip,...:port\".");
  m.def(
      "_liveness_connection_count",
      [] { return fsdp_ext::comm::PeerLiveness::of_this_process().connection_count(); },
      "How many peer processes this process holds a liveness connection to.");
  m.def(
      "_liveness_refused_connections",
      [] { return fsdp_ext::comm::PeerLiveness::of_this_process().refused_connections(); },
      "How many connections this process's liveness listener closed unfiled: no\n"
      "valid hello (magic, endpoint, this process's token) within its deadline.");

  // The GIL check of Note [wait() returns once the engine let go]
  // (backend/fsdp_ext_work.hpp): torch's own waits release the GIL, so only a
  // caller like this one reaches it.
  m.def(
      "_wait_holding_gil_for_tests", [](c10d::Work& work) { return work.wait(); },
      py::arg("work"),
      "Tests only: Work.wait() without releasing the GIL, as C++ code that holds it\n"
      "would call it. Returns once the op completed; it does not wait for the\n"
      "progress thread to let go of the op, which may need the GIL to do so.");

  // Fault injection for the CUDA tests (backend/cuda_collectives.hpp).
  m.def("_refuse_legacy_cuda_ipc_for_tests", &fsdp_ext::backend::refuse_legacy_ipc_for_tests,
        py::arg("refuse"),
        "Tests only: this process makes no legacy CUDA IPC handles from now on, as\n"
        "on machines that refuse them, so that the IPC route's fallback to file\n"
        "descriptors runs on any GPU. Raises in a build without the CUDA path.");
  m.def("_fail_next_cuda_staging_for_tests", &fsdp_ext::backend::fail_next_staging_for_tests,
        "Tests only: the next CUDA op this process stages through host memory fails\n"
        "while staging, once (as where pinned memory runs out). Raises in a build\n"
        "without the CUDA path.");

  // The benchmark's physical references (comm/memory_limits.h).
  m.def("_concurrent_peer_copy_seconds", &fsdp_ext::comm::concurrent_peer_copy_seconds,
        py::arg("ranks"), py::arg("bytes"), py::arg("rounds"),
        py::call_guard<py::gil_scoped_release>(),
        "Seconds (best round, first start to last end) for `ranks` threads to each copy\n"
        "`bytes` out of the next one's freshly written buffer, all at once.");
  m.def("_handoff_round_trip_ns", &fsdp_ext::comm::handoff_round_trip_ns,
        py::arg("round_trips"), py::call_guard<py::gil_scoped_release>(),
        "Round trip (ns, best of five batches' medians) of a flag passed between two\n"
        "threads through one cache line.");

  // FSDP copy kernels (the first pieces of the C++ FSDP runtime; see
  // csrc/fsdp/copy_kernels.hpp for the layouts).
  m.def(
      "_fsdp_all_gather_copy_in",
      [](const std::vector<at::Tensor>& shards, const at::Tensor& output, int64_t rank,
         int64_t world_size, std::optional<std::vector<at::ScalarType>> gather_dtypes) {
        std::vector<at::ScalarType> dtypes;
        if (gather_dtypes) {
          dtypes = std::move(*gather_dtypes);
        } else {
          for (const at::Tensor& shard : shards) dtypes.push_back(shard.scalar_type());
        }
        return fsdp_ext::fsdp::all_gather_copy_in(shards, dtypes, output, rank, world_size);
      },
      py::arg("shards"), py::arg("output"), py::arg("rank"), py::arg("world_size"),
      py::arg("gather_dtypes") = py::none(),
      "Copy every shard (cast to its all-gather dtype, default its own) into this rank's\n"
      "chunk of the flat all-gather output; returns that chunk.");
  m.def("_fsdp_all_gather_copy_out", &fsdp_ext::fsdp::all_gather_copy_out, py::arg("output"),
        py::arg("split_sizes"), py::arg("world_size"), py::arg("outputs"),
        py::arg("shard_dims") = std::vector<int64_t>(),
        "Copy the flat all-gather output into per-parameter (world_size x split) tensors.");
  // The host block cache (csrc/fsdp/host_block_cache.hpp) as tests see it.
  m.def("_fsdp_host_cache_empty", &fsdp_ext::fsdp::HostBlockCache::empty, py::arg("numel"),
        py::arg("dtype"), "A 1-D CPU tensor whose storage comes from the host block cache.");
  m.def("_fsdp_host_cache_idle_bytes",
        [] { return fsdp_ext::fsdp::HostBlockCache::instance().idle_bytes(); },
        "Bytes of freed blocks the host block cache keeps for reuse.");
  m.def("_fsdp_host_cache_release_idle",
        [] { fsdp_ext::fsdp::HostBlockCache::instance().release_idle(); },
        "Give every idle block of the host block cache back to the system.");
  m.attr("_fsdp_host_cache_idle_limit") =
      py::int_(fsdp_ext::fsdp::HostBlockCache::kIdleBytesLimit);
  m.def("_fsdp_reduce_scatter_copy_in", &fsdp_ext::fsdp::reduce_scatter_copy_in,
        py::arg("gradients"), py::arg("world_size"), py::arg("output"),
        py::arg("shard_dims") = std::vector<int64_t>(),
        "Write gradients in the reduce-scatter input layout (torch._chunk_cat's).");

  // The same layouts with the device implementations (torch's fused ops),
  // callable on host tensors too, so that tests here check them against the
  // host loops (csrc/fsdp/copy_kernels_device.hpp).
  m.def("_fsdp_device_all_gather_copy_in", &fsdp_ext::fsdp::device_kernels::all_gather_copy_in,
        py::arg("shards"), py::arg("gather_dtypes"), py::arg("input"));
  m.def("_fsdp_device_all_gather_copy_out", &fsdp_ext::fsdp::device_kernels::all_gather_copy_out,
        py::arg("output"), py::arg("split_sizes"), py::arg("world_size"), py::arg("outputs"),
        py::arg("shard_dims"));
  m.def("_fsdp_device_reduce_scatter_copy_in",
        &fsdp_ext::fsdp::device_kernels::reduce_scatter_copy_in, py::arg("gradients"),
        py::arg("world_size"), py::arg("output"), py::arg("shard_dims"));

  m.def("_shutdown_all", &FsdpExtBackend::shutdown_all,
        py::call_guard<py::gil_scoped_release>(),
        "Shut down every live fsdp_ext backend (called at interpreter exit).");
  m.def(
      "_flight_recorder_enabled",
      [] { return fsdp_ext::backend::FlightRecorder::instance().enabled(); },
      "Whether fsdp_ext ops are recorded (TORCH_FR_BUFFER_SIZE > 0).");
  m.def(
      "_flight_recorder_dump",
      [](bool only_active) {
        std::string dump;
        {
          py::gil_scoped_release no_gil;
          dump = fsdp_ext::backend::FlightRecorder::instance().dump(only_active);
        }
        return py::bytes(dump);
      },
      py::arg("only_active") = false,
      "The Flight Recorder's entries of fsdp_ext ops, pickled in torch's dump format.");
  m.def(
      "_flight_recorder_write",
      [](int global_rank) {
        return fsdp_ext::backend::FlightRecorder::instance().write_dump(global_rank);
      },
      py::arg("global_rank"), py::call_guard<py::gil_scoped_release>(),
      "Writes the dump to torch's Flight Recorder file for this rank; returns its path.");
  fsdp_ext::python::bind_fsdp_runtime(m);
}
