// Tensor-side helpers shared by the CUDA bindings (bindings.cpp, bindings_llama.cpp): the storage-type
// mapping onto the launchers' DType, launch-error checks, the current stream. CUDA builds only.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels.h"

namespace slipway::cuda {

inline DType dtype_of(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: break;
  }
  TORCH_CHECK(false, "slipway::", op, " on CUDA supports float32, bfloat16 and float16; got ", t, ".");
  return DType::kFloat32;  // unreachable: TORCH_CHECK(false) throws
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "slipway::", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

inline cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
}

inline at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

inline int64_t rows_of(const at::Tensor& t, int64_t width) { return width == 0 ? 0 : t.numel() / width; }

}  // namespace slipway::cuda
