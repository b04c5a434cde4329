// torch_fsdp_ext._C: the backend class (a c10d.Backend subclass, so torch's
// ProcessGroup can hold it) and its factory. Registration with
// torch.distributed happens in Python (torch_fsdp_ext/_registration.py).
#include <pybind11/chrono.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include "backend/fsdp_ext_backend.hpp"
#include "comm/algorithm_selection.h"

namespace py = pybind11;
using fsdp_ext::backend::FsdpExtBackend;

PYBIND11_MODULE(_C, m) {
  m.doc() = "fsdp_ext c10d backend (UCX for CPU tensors)";
  // The c10d.Backend base class is registered by torch.distributed.
  py::module_::import("torch.distributed");

  py::class_<FsdpExtBackend, c10d::Backend, c10::intrusive_ptr<FsdpExtBackend>>(
      m, "FsdpExtBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, const std::string& group_name) {
             return c10::make_intrusive<FsdpExtBackend>(store, rank, size, timeout, group_name);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("group_name"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "_selected_algorithm",
      [](const std::string& op, size_t bytes, int group_size) {
        using namespace fsdp_ext::comm;
        if (op == "all_gather_into_tensor") return algorithm_name(select_allgather(bytes, group_size));
        if (op == "reduce_scatter_tensor") return algorithm_name(select_reduce_scatter(bytes, group_size));
        if (op == "all_reduce") return algorithm_name(select_allreduce(bytes, group_size));
        if (op == "broadcast") return algorithm_name(select_broadcast(bytes, group_size));
        throw py::value_error("unknown op '" + op + "'");
      },
      py::arg("op"), py::arg("bytes"), py::arg("group_size"),
      "The algorithm fsdp_ext picks for `op` on a message of `bytes` (the\n"
      "all-gather output / reduce-scatter input / buffer) in a group of `group_size`.");

  m.def("_shutdown_all", &FsdpExtBackend::shutdown_all,
        py::call_guard<py::gil_scoped_release>(),
        "Shut down every live fsdp_ext backend (called at interpreter exit).");
}
