// Tensors whose ops a Python tensor subclass answers (__torch_dispatch__:
// quantised weights, wrappers). Their data may not be where a data pointer
// says (a wrapper subclass has no storage of its own: its data pointer is
// null), so the runtime reads them only through ATen ops, never in place
// (Note [tensor subclass parameters], fsdp_param.hpp).
#pragma once

#include <ATen/ATen.h>

namespace fsdp_ext::fsdp {

inline bool is_python_subclass(const at::Tensor& tensor) {
  return tensor.defined() && tensor.unsafeGetTensorImpl()->is_python_dispatch();
}

}  // namespace fsdp_ext::fsdp
