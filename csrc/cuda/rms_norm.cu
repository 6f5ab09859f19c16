// RMSNorm over the last dim, forward and backward, fp32 statistics for any storage type (the same
// structure as layer_norm.cu). Forward: one block per row, the row cached in shared memory as fp32; the
// normalised value is rounded to x's type before the weight multiplies (the eager reference's order).
// Backward: a fixed number of blocks each walk a strided set of rows, writing dx and accumulating their
// rows' dw in shared memory; a second kernel sums the per-block partials in a fixed order (no atomics).
#include "common.cuh"

namespace slipway::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kPartialBlocks = 256;  // blocks of the backward pass, hence partial rows to reduce

template <typename T, typename O>
__global__ void rms_norm_fwd_kernel(const T* __restrict__ x, const float* __restrict__ w, O* __restrict__ y,
                                    float* __restrict__ rstd, int64_t rows, int64_t h, float eps) {
  extern __shared__ float row[];
  __shared__ float red[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * h;
    float ss = 0.0f;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      const float v = to_f(xr[j]);
      row[j] = v;
      ss += v * v;
    }
    const float rs = rsqrtf(block_sum(ss, red) / static_cast<float>(h) + eps);
    O* yr = y + r * h;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) yr[j] = from_f<O>(to_f(from_f<T>(row[j] * rs)) * w[j]);
    if (threadIdx.x == 0) rstd[r] = rs;
  }
}

// dx = rstd · (g·w − x̂ · mean(g·w·x̂)), x̂ = x·rstd; dw partial = Σ_rows g·x̂.
template <typename T, typename G>
__global__ void rms_norm_bwd_kernel(const G* __restrict__ g, const T* __restrict__ x, const float* __restrict__ w,
                                    const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ partial,
                                    int64_t rows, int64_t h) {
  extern __shared__ float acc[];  // [h]: this block's dw
  __shared__ float red[32];
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) acc[j] = 0.0f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const G* gr = g + r * h;
    const T* xr = x + r * h;
    const float rs = rstd[r];
    float c = 0.0f;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      const float gj = to_f(gr[j]), xh = to_f(xr[j]) * rs;
      acc[j] += gj * xh;
      c += gj * w[j] * xh;
    }
    c = block_sum(c, red) / static_cast<float>(h);
    T* dr = dx + r * h;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
      dr[j] = from_f<T>(rs * (to_f(gr[j]) * w[j] - to_f(xr[j]) * rs * c));
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) partial[blockIdx.x * h + j] = acc[j];
}

// gw[j] = Σ_p partial[p, j], summed in block order.
__global__ void rms_column_sum_kernel(const float* __restrict__ partial, int64_t parts, int64_t h,
                                      float* __restrict__ gw) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= h) return;
  float s = 0.0f;
  for (int64_t p = 0; p < parts; ++p) s += partial[p * h + j];
  gw[j] = s;
}

int64_t parts_for(int64_t rows) { return rows < kPartialBlocks ? (rows < 1 ? 1 : rows) : kPartialBlocks; }

template <typename T, typename O>
cudaError_t launch_fwd(const void* x, const float* w, void* y, float* rstd, int64_t rows, int64_t h, float eps,
                       cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(h) * sizeof(float);
  auto kernel = rms_norm_fwd_kernel<T, O>;
  cudaError_t err = allow_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid_for(rows < (1 << 20) ? rows : (1 << 20)), kThreads, smem, stream>>>(
      static_cast<const T*>(x), w, static_cast<O*>(y), rstd, rows, h, eps);
  return cudaGetLastError();
}

template <typename T, typename G>
cudaError_t launch_bwd(const void* grad, const void* x, const float* w, const float* rstd, void* dx,
                       float* workspace, int64_t rows, int64_t h, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(h) * sizeof(float);
  auto kernel = rms_norm_bwd_kernel<T, G>;
  cudaError_t err = allow_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(parts_for(rows)), kThreads, smem, stream>>>(
      static_cast<const G*>(grad), static_cast<const T*>(x), w, rstd, static_cast<T*>(dx), workspace, rows, h);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rms_norm_fwd(DType tx, DType ty, const void* x, const float* w, void* y, float* rstd, int64_t rows,
                         int64_t h, float eps, cudaStream_t stream) {
  if (tx == ty)
    return dispatch(tx, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      return launch_fwd<T, T>(x, w, y, rstd, rows, h, eps, stream);
    });
  if (ty != DType::kFloat32) return cudaErrorInvalidValue;
  if (tx == DType::kBFloat16) return launch_fwd<__nv_bfloat16, float>(x, w, y, rstd, rows, h, eps, stream);
  return launch_fwd<__half, float>(x, w, y, rstd, rows, h, eps, stream);
}

int64_t rms_norm_bwd_workspace(int64_t rows, int64_t h) { return parts_for(rows) * h; }

cudaError_t rms_norm_bwd(DType tx, DType tg, const void* grad, const void* x, const float* w, const float* rstd,
                         void* dx, float* gw, float* workspace, int64_t rows, int64_t h, cudaStream_t stream) {
  if (h == 0) return cudaSuccess;  // nothing to write, and a zero-block grid is a launch error
  cudaError_t err;
  if (tx == tg) {
    err = dispatch(tx, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      return launch_bwd<T, T>(grad, x, w, rstd, dx, workspace, rows, h, stream);
    });
  } else if (tg != DType::kFloat32) {
    return cudaErrorInvalidValue;
  } else if (tx == DType::kBFloat16) {
    err = launch_bwd<__nv_bfloat16, float>(grad, x, w, rstd, dx, workspace, rows, h, stream);
  } else {
    err = launch_bwd<__half, float>(grad, x, w, rstd, dx, workspace, rows, h, stream);
  }
  if (err != cudaSuccess) return err;
  rms_column_sum_kernel<<<static_cast<unsigned>((h + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      workspace, parts_for(rows), h, gw);
  return cudaGetLastError();
}

}  // namespace slipway::cuda
