// A build without CUDA (cmake/cuda.cmake says why): CUDA tensors are refused.
#include <c10/util/Exception.h>

#include <cstdlib>

#include "backend/cuda_collectives.hpp"

namespace fsdp_ext::backend {

namespace {
[[noreturn]] void refuse(const OpLabel& label) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      false, label.prefix(),
      "got CUDA tensors, but this build of torch_fsdp_ext has no CUDA path (it was built "
      "without a CUDA compiler, or against a CPU build of torch, or with FSDP_EXT_CUDA=OFF); "
      "rebuild with nvcc on PATH against a CUDA torch, or use CPU tensors, or a "
      "'cpu:fsdp_ext,cuda:nccl' backend string");
  std::abort();  // not reached: the check above throws
}
}  // namespace

bool cuda_path_built() { return false; }

int cuda_device_count() { return 0; }

int cuda_current_device() { return -1; }

void refuse_legacy_ipc_for_tests(bool) {
  TORCH_CHECK(false, "this build of torch_fsdp_ext has no CUDA path");
}

void fail_next_staging_for_tests() {
  TORCH_CHECK(false, "this build of torch_fsdp_ext has no CUDA path");
}

std::shared_ptr<CudaCollectives> make_cuda_collectives(FsdpExtBackend&, const OpLabel& label,
                                                       int, const CudaChoice&,
                                                       const NcclFactory&) {
  refuse(label);
}

std::shared_ptr<CudaBuffers> make_cuda_buffers(const OpLabel& label, int, const CudaChoice&) {
  refuse(label);
}

}  // namespace fsdp_ext::backend
