// LayerNorm over the last dim, forward and backward, with fp32 statistics for any storage type.
// Forward: one block per row, the row cached in shared memory as fp32, two-pass mean/variance.
// Backward: a fixed number of blocks each walk a strided set of rows, writing dx and accumulating their
// rows' dγ/dβ in shared memory; a second kernel sums those per-block partials column by column in a
// fixed order (deterministic, no atomics).
#include "common.cuh"

namespace slipway::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kPartialBlocks = 256;  // blocks of the backward pass, hence partial rows to reduce

template <typename T>
__global__ void layer_norm_fwd_kernel(const T* __restrict__ x, const float* __restrict__ w,
                                      const float* __restrict__ b, T* __restrict__ y, float* __restrict__ mean,
                                      float* __restrict__ rstd, int64_t rows, int64_t h, float eps) {
  extern __shared__ float row[];
  __shared__ float red[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * h;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      float v = to_f(xr[j]);
      row[j] = v;
      s += v;
    }
    const float mu = block_sum(s, red) / static_cast<float>(h);
    float ss = 0.0f;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) ss += (row[j] - mu) * (row[j] - mu);
    const float rs = rsqrtf(block_sum(ss, red) / static_cast<float>(h) + eps);
    T* yr = y + r * h;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) yr[j] = from_f<T>((row[j] - mu) * rs * w[j] + b[j]);
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

template <typename T>
__global__ void layer_norm_bwd_kernel(const T* __restrict__ g, const T* __restrict__ x, const float* __restrict__ w,
                                      const float* __restrict__ mean, const float* __restrict__ rstd,
                                      T* __restrict__ dx, float* __restrict__ partial, int64_t rows, int64_t h) {
  extern __shared__ float acc[];  // [2, h]: this block's dγ, dβ
  __shared__ float red[32];
  for (int64_t j = threadIdx.x; j < 2 * h; j += blockDim.x) acc[j] = 0.0f;
  __syncthreads();  // acc[h + j] is zeroed by another thread than the one that accumulates into it
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *gr = g + r * h, *xr = x + r * h;
    const float mu = mean[r], rs = rstd[r];
    float c1 = 0.0f, c2 = 0.0f;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      const float gj = to_f(gr[j]), xh = (to_f(xr[j]) - mu) * rs, gw = gj * w[j];
      acc[j] += gj * xh;
      acc[h + j] += gj;
      c1 += gw;
      c2 += gw * xh;
    }
    c1 = block_sum(c1, red) / static_cast<float>(h);
    c2 = block_sum(c2, red) / static_cast<float>(h);
    T* dr = dx + r * h;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      const float xh = (to_f(xr[j]) - mu) * rs;
      dr[j] = from_f<T>(rs * (to_f(gr[j]) * w[j] - c1 - xh * c2));
    }
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < 2 * h; j += blockDim.x) partial[blockIdx.x * 2 * h + j] = acc[j];
}

// out[j] = Σ_p partial[p, j] for the 2h columns (dγ then dβ), summed in block order.
__global__ void column_sum_kernel(const float* __restrict__ partial, int64_t parts, int64_t h2,
                                  float* __restrict__ gw, float* __restrict__ gb, int64_t h) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= h2) return;
  float s = 0.0f;
  for (int64_t p = 0; p < parts; ++p) s += partial[p * h2 + j];
  if (j < h)
    gw[j] = s;
  else
    gb[j - h] = s;
}

int64_t parts_for(int64_t rows) { return rows < kPartialBlocks ? (rows < 1 ? 1 : rows) : kPartialBlocks; }

}  // namespace

cudaError_t layer_norm_fwd(DType t, const void* x, const float* w, const float* b, void* y, float* mean,
                           float* rstd, int64_t rows, int64_t h, float eps, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(h) * sizeof(float);
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto kernel = layer_norm_fwd_kernel<T>;
    cudaError_t err = allow_smem(kernel, smem);
    if (err != cudaSuccess) return err;
    kernel<<<grid_for(rows < (1 << 20) ? rows : (1 << 20)), kThreads, smem, stream>>>(
        static_cast<const T*>(x), w, b, static_cast<T*>(y), mean, rstd, rows, h, eps);
    return cudaGetLastError();
  });
}

int64_t layer_norm_bwd_workspace(int64_t rows, int64_t h) { return parts_for(rows) * 2 * h; }

cudaError_t layer_norm_bwd(DType t, const void* grad, const void* x, const float* w, const float* mean,
                           const float* rstd, void* dx, float* gw, float* gb, float* workspace, int64_t rows,
                           int64_t h, cudaStream_t stream) {
  const int64_t parts = parts_for(rows);
  const size_t smem = static_cast<size_t>(2 * h) * sizeof(float);
  cudaError_t err = dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto kernel = layer_norm_bwd_kernel<T>;
    cudaError_t e = allow_smem(kernel, smem);
    if (e != cudaSuccess) return e;
    kernel<<<static_cast<unsigned>(parts), kThreads, smem, stream>>>(
        static_cast<const T*>(grad), static_cast<const T*>(x), w, mean, rstd, static_cast<T*>(dx), workspace, rows,
        h);
    return cudaGetLastError();
  });
  if (err != cudaSuccess) return err;
  const int64_t h2 = 2 * h;
  column_sum_kernel<<<static_cast<unsigned>((h2 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      workspace, parts, h2, gw, gb, h);
  return cudaGetLastError();
}

}  // namespace slipway::cuda
