#include "device/reduce_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "device/cuda_check.h"

namespace fsdp_ext::device {
namespace {

struct Inputs {
  const void* data[kMaxReduceInputs];
};

// How a stored element is computed with (halves in float) and stored back.
template <typename T>
struct Arith {
  using Acc = T;
  __device__ static Acc load(T v) { return v; }
  __device__ static T store(Acc v) { return v; }
};
template <>
struct Arith<__half> {
  using Acc = float;
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Arith<__nv_bfloat16> {
  using Acc = float;
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

template <typename A>
__device__ bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>) {
    return v != v;
  } else {
    return false;
  }
}

// One step of the reduction, in the accumulation type. Integer sums and
// products wrap (done unsigned); NaN propagates through MIN/MAX, as torch's.
template <typename A>
__device__ A combine(A a, A b, comm::ReduceKind kind) {
  switch (kind) {
    case comm::ReduceKind::kSum:
      if constexpr (std::is_integral_v<A> && !std::is_same_v<A, bool>) {
        using U = std::make_unsigned_t<A>;
        return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
      } else {
        return a + b;
      }
    case comm::ReduceKind::kProduct:
      if constexpr (std::is_integral_v<A> && !std::is_same_v<A, bool>) {
        using U = std::make_unsigned_t<A>;
        return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
      } else {
        return a * b;
      }
    case comm::ReduceKind::kMin:
      if (is_nan(a) || is_nan(b)) return a + b;
      return b < a ? b : a;
    case comm::ReduceKind::kMax:
      if (is_nan(a) || is_nan(b)) return a + b;
      return a < b ? b : a;
    default:
      if constexpr (std::is_integral_v<A>) {
        if (kind == comm::ReduceKind::kBitAnd) return static_cast<A>(a & b);
        if (kind == comm::ReduceKind::kBitOr) return static_cast<A>(a | b);
        return static_cast<A>(a ^ b);
      } else {
        return a;  // bitwise ops on floats are refused before a launch
      }
  }
}

// PREMUL_SUM's scaling, rounded on its own as the CPU kernels round it
// (scaled into scratch, then summed). nvcc contracts a multiply and the add
// after it into one fused multiply-add by default, which rounds once and so
// differs in the last bit; the _rn intrinsics are never contracted.
template <typename A>
__device__ A scaled(A v, double factor) {
  if constexpr (std::is_same_v<A, double>) {
    return __dmul_rn(v, factor);
  } else {
    return __fmul_rn(v, static_cast<float>(factor));
  }
}

template <typename T>
__global__ void reduce_kernel(T* out, Inputs inputs, int input_count, size_t count,
                              comm::ReduceKind kind, double pre_scale, double post_divisor) {
  using A = typename Arith<T>::Acc;
  const bool scale = pre_scale != 1.0;
  const bool divide = post_divisor != 1.0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    auto contribution = [&](int k) {
      A v = Arith<T>::load(static_cast<const T*>(inputs.data[k])[i]);
      if constexpr (std::is_floating_point_v<A>) {
        if (scale) v = Arith<T>::load(Arith<T>::store(scaled(v, pre_scale)));
      }
      return v;
    };
    A acc = contribution(0);
    for (int k = 1; k < input_count; ++k) {
      acc = Arith<T>::load(Arith<T>::store(combine<A>(acc, contribution(k), kind)));
    }
    if constexpr (std::is_floating_point_v<A>) {
      if (divide) acc = acc / static_cast<A>(post_divisor);
    }
    out[i] = Arith<T>::store(acc);
  }
}

// Bool on the device as on the CPU (comm/reduce_kernels.cpp): bytes 0/1;
// SUM/MAX are a logical or, PRODUCT/MIN a logical and.
__global__ void reduce_bool_kernel(uint8_t* out, Inputs inputs, int input_count, size_t count,
                                   comm::ReduceKind kind) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    uint8_t acc = static_cast<const uint8_t*>(inputs.data[0])[i];
    for (int k = 1; k < input_count; ++k) {
      const uint8_t v = static_cast<const uint8_t*>(inputs.data[k])[i];
      switch (kind) {
        case comm::ReduceKind::kSum:
        case comm::ReduceKind::kMax:
        case comm::ReduceKind::kBitOr: acc = acc | v; break;
        case comm::ReduceKind::kBitXor: acc = acc ^ v; break;
        default: acc = acc & v; break;
      }
    }
    out[i] = acc;
  }
}

template <typename T>
void launch(void* out, const Inputs& inputs, int input_count, size_t count,
            const comm::ReduceSpec& spec, unsigned blocks, cudaStream_t stream) {
  reduce_kernel<T><<<blocks, 256, 0, stream>>>(static_cast<T*>(out), inputs, input_count, count,
                                               spec.kind, spec.pre_scale, spec.post_divisor);
}

}  // namespace

void reduce_on_device(void* out, const void* const* inputs, int input_count, size_t count,
                      const comm::ReduceSpec& spec, cudaStream_t stream) {
  if (count == 0 || input_count == 0) return;
  if (input_count > kMaxReduceInputs) {
    throw comm::CommError(comm::ErrorKind::kDevice,
                          "a device reduction over " + std::to_string(input_count) +
                              " contributions; at most " + std::to_string(kMaxReduceInputs));
  }
  Inputs table{};
  for (int k = 0; k < input_count; ++k) table.data[k] = inputs[k];
  // Enough blocks to fill the device several times over, then a
  // grid-stride loop: 4 blocks of 256 threads per multiprocessor.
  int device = 0, processors = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  const size_t wanted = (count + 255) / 256;
  const unsigned blocks = static_cast<unsigned>(
      wanted < static_cast<size_t>(processors) * 4 ? wanted : static_cast<size_t>(processors) * 4);
  switch (spec.type) {
    case comm::DataType::kFloat32: launch<float>(out, table, input_count, count, spec, blocks, stream); break;
    case comm::DataType::kFloat64: launch<double>(out, table, input_count, count, spec, blocks, stream); break;
    case comm::DataType::kFloat16: launch<__half>(out, table, input_count, count, spec, blocks, stream); break;
    case comm::DataType::kBFloat16: launch<__nv_bfloat16>(out, table, input_count, count, spec, blocks, stream); break;
    case comm::DataType::kInt8: launch<int8_t>(out, table, input_count, count, spec, blocks, stream); break;
    case comm::DataType::kUInt8: launch<uint8_t>(out, table, input_count, count, spec, blocks, stream); break;
    case comm::DataType::kInt32: launch<int32_t>(out, table, input_count, count, spec, blocks, stream); break;
    case comm::DataType::kInt64: launch<int64_t>(out, table, input_count, count, spec, blocks, stream); break;
    case comm::DataType::kBool:
      reduce_bool_kernel<<<blocks, 256, 0, stream>>>(static_cast<uint8_t*>(out), table,
                                                     input_count, count, spec.kind);
      break;
  }
  check_cuda(cudaGetLastError(), "the device reduction kernel's launch");
}

}  // namespace fsdp_ext::device
