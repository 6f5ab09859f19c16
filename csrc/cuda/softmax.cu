// Scale + causal (upper-triangular) mask + softmax over the last dim of [..., sq, sk] scores, forward and
// backward (Megatron's scaled_upper_triang_masked_softmax). One block per row; the row's scaled scores
// are held in shared memory as fp32, so global memory is read once and written once. Only the visible
// keys j <= i + (sk − sq) are read; masked probabilities are written as 0.
#include "common.cuh"

namespace slipway::cuda {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ int64_t visible_keys(int64_t r, int64_t sq, int64_t sk) {
  int64_t n = r % sq + (sk - sq) + 1;
  return n < 0 ? 0 : (n > sk ? sk : n);
}

template <typename T>
__global__ void causal_softmax_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t sq,
                                          int64_t sk, float scale) {
  extern __shared__ float row[];
  __shared__ float red[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * sk;
    T* yr = y + r * sk;
    const int64_t n = visible_keys(r, sq, sk);
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      float v = to_f(xr[j]) * scale;
      row[j] = v;
      mx = fmaxf(mx, v);
    }
    mx = block_max(mx, red);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      float e = __expf(row[j] - mx);
      row[j] = e;
      sum += e;
    }
    sum = block_sum(sum, red);
    const float inv = n > 0 ? 1.0f / sum : 0.0f;
    for (int64_t j = threadIdx.x; j < sk; j += blockDim.x) yr[j] = from_f<T>(j < n ? row[j] * inv : 0.0f);
    __syncthreads();  // `row` is reused by the next row of this block
  }
}

template <typename T>
__global__ void causal_softmax_bwd_kernel(const T* __restrict__ g, const T* __restrict__ y, T* __restrict__ dx,
                                          int64_t rows, int64_t sq, int64_t sk, float scale) {
  __shared__ float red[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *gr = g + r * sk, *yr = y + r * sk;
    T* dr = dx + r * sk;
    const int64_t n = visible_keys(r, sq, sk);
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) dot += to_f(gr[j]) * to_f(yr[j]);
    dot = block_sum(dot, red);
    for (int64_t j = threadIdx.x; j < sk; j += blockDim.x)
      dr[j] = from_f<T>(j < n ? scale * to_f(yr[j]) * (to_f(gr[j]) - dot) : 0.0f);
  }
}

unsigned row_grid(int64_t rows) { return grid_for(rows < (1 << 20) ? rows : (1 << 20)); }

}  // namespace

cudaError_t causal_softmax_fwd(DType t, const void* x, void* y, int64_t rows, int64_t sq, int64_t sk, float scale,
                               cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(sk) * sizeof(float);
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto kernel = causal_softmax_fwd_kernel<T>;
    if (smem > 48 * 1024) {  // long rows: opt in to the large shared-memory carve-out (up to 227 KB on sm_90)
      cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
      if (err != cudaSuccess) return err;
    }
    kernel<<<row_grid(rows), kThreads, smem, stream>>>(static_cast<const T*>(x), static_cast<T*>(y), rows, sq, sk,
                                                       scale);
    return cudaGetLastError();
  });
}

cudaError_t causal_softmax_bwd(DType t, const void* grad, const void* y, void* dx, int64_t rows, int64_t sq,
                               int64_t sk, float scale, cudaStream_t stream) {
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    causal_softmax_bwd_kernel<T><<<row_grid(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(grad), static_cast<const T*>(y), static_cast<T*>(dx), rows, sq, sk, scale);
    return cudaGetLastError();
  });
}

}  // namespace slipway::cuda
