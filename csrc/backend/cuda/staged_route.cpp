// The staged route of a group's CUDA path (cuda_path.hpp): an op on CUDA
// tensors runs as the same op on pinned host copies, through this group's
// CPU transport. Every op has it; it is the fallback wherever IPC does not
// work, and how ops the fast routes do not implement run.
//
// The copies run on the group's stream after the caller's current stream;
// the host waits for the device-to-host copies (this route's one host
// synchronisation) and for the CPU collective, then enqueues the copies back.
// The Work's end is their completion, as on the other routes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cuda/cuda_path.hpp"
#include "backend/cuda/cuda_work.hpp"
#include "backend/fsdp_ext_backend.hpp"

namespace fsdp_ext::backend {
namespace {
std::atomic<bool> staging_fails_for_tests{false};
}  // namespace

void fail_next_staging_for_tests() { staging_fails_for_tests = true; }

WorkPtr CudaPath::run_staged(const OpLabel& label, CudaOp& op) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  staged_ops_.fetch_add(1);
  // One pinned host tensor per distinct device tensor: an in-place op's
  // tensor is an input and an output, and must stay one tensor on the host.
  std::vector<at::Tensor> device_tensors;
  std::vector<at::Tensor> host_tensors;
  const auto host_of = [&](const at::Tensor& tensor) {
    for (size_t i = 0; i < device_tensors.size(); ++i) {
      if (device_tensors[i].is_same(tensor)) return host_tensors[i];
    }
    device_tensors.push_back(tensor);
    host_tensors.push_back(at::empty(tensor.sizes(),
                                     tensor.options().device(at::kCPU).pinned_memory(true)));
    return host_tensors.back();
  };
  std::vector<at::Tensor> host_inputs, host_outputs;
  // The peers are in (or on their way to) the host collective by now: a
  // failure here on one rank -- no pinned memory left, a copy that fails --
  // is told to them as this rank's failed collective, rather than raised
  // here alone, which would leave them waiting for their timeout.
  try {
    if (staging_fails_for_tests.exchange(false)) {
      throw std::runtime_error("injected by fail_next_staging_for_tests");
    }
    follow_current_stream();
    for (const at::Tensor& input : op.inputs) host_inputs.push_back(host_of(input));
    for (const at::Tensor& output : op.outputs) host_outputs.push_back(host_of(output));
    c10::cuda::CUDAStreamGuard on_stream(stream_);
    for (size_t i = 0; i < op.inputs.size(); ++i) {
      host_inputs[i].copy_(op.inputs[i], /*non_blocking=*/true);
    }
    c10::cuda::CUDAEvent copied;
    copied.record(stream_);
    copied.synchronize();
  } catch (const std::exception& error) {
    // c10's errors without their backtrace: the peers read this message too.
    const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
    group_.fail_collective(label, op.timeout,
                           std::string("staging the op's tensors in host memory failed: ") +
                               (c10_error ? c10_error->what_without_backtrace() : error.what()));
  }
  op.on_host(host_inputs, host_outputs)->wait();
  {
    c10::cuda::CUDAStreamGuard on_stream(stream_);
    for (size_t i = 0; i < op.outputs.size(); ++i) {
      op.outputs[i].copy_(host_outputs[i], /*non_blocking=*/true);
    }
  }
  record_stream(op);
  return c10::make_intrusive<CudaWork>(rank_, c10d::OpType::UNKNOWN, label.op, op.outputs,
                                       stream_);
}

}  // namespace fsdp_ext::backend
