// Pointwise fused kernels: bias+GeLU (forward, backward) and bias+dropout+residual (forward, backward).
// One block walks rows; its threads cover a row's columns with 16-byte packs when the row width and
// pointers allow it, so each element is read and written once with the math in registers.
#include "../slipway_rng.h"
#include "common.cuh"

namespace slipway::cuda {
namespace {

constexpr int kThreads = 128;
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluC = 0.044715f;

// GeLU(tanh) as v·σ(2u), u = √(2/π)(v + 0.044715v³); σ saturates to 0/1 cleanly (exp → inf gives 0).
__device__ __forceinline__ float gelu_sig(float v) {
  float u = kGeluK * (v + kGeluC * v * v * v);
  return 1.0f / (1.0f + __expf(-2.0f * u));
}
__device__ __forceinline__ float gelu_f(float v) { return v * gelu_sig(v); }
__device__ __forceinline__ float gelu_grad_f(float v) {
  float s = gelu_sig(v);
  return s + 2.0f * v * s * (1.0f - s) * kGeluK * (1.0f + 3.0f * kGeluC * v * v);
}

template <typename T, int N>
__global__ void bias_gelu_fwd_kernel(const T* __restrict__ x, const float* __restrict__ b, T* __restrict__ y,
                                     int64_t rows, int64_t h) {
  const int64_t packs = h / N;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const Pack<T, N>* xr = reinterpret_cast<const Pack<T, N>*>(x + r * h);
    Pack<T, N>* yr = reinterpret_cast<Pack<T, N>*>(y + r * h);
    for (int64_t c = threadIdx.x; c < packs; c += blockDim.x) {
      Pack<T, N> in = xr[c], out;
#pragma unroll
      for (int k = 0; k < N; ++k) out.v[k] = from_f<T>(gelu_f(to_f(in.v[k]) + b[c * N + k]));
      yr[c] = out;
    }
  }
}

template <typename T, int N>
__global__ void bias_gelu_bwd_kernel(const T* __restrict__ g, const T* __restrict__ x, const float* __restrict__ b,
                                     T* __restrict__ dx, int64_t rows, int64_t h) {
  const int64_t packs = h / N;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const Pack<T, N>* xr = reinterpret_cast<const Pack<T, N>*>(x + r * h);
    const Pack<T, N>* gr = reinterpret_cast<const Pack<T, N>*>(g + r * h);
    Pack<T, N>* dr = reinterpret_cast<Pack<T, N>*>(dx + r * h);
    for (int64_t c = threadIdx.x; c < packs; c += blockDim.x) {
      Pack<T, N> xin = xr[c], gin = gr[c], out;
#pragma unroll
      for (int k = 0; k < N; ++k) out.v[k] = from_f<T>(to_f(gin.v[k]) * gelu_grad_f(to_f(xin.v[k]) + b[c * N + k]));
      dr[c] = out;
    }
  }
}

template <typename TX, typename TO, int N, bool kDrop>
__global__ void bias_dropout_add_kernel(const TX* __restrict__ x, const float* __restrict__ b,
                                        const TO* __restrict__ res, TO* __restrict__ out, int64_t rows, int64_t h,
                                        DropoutParams d) {
  const uint64_t seed = kDrop ? static_cast<uint64_t>(*d.seed) : 0;
  const int64_t packs = h / N;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const Pack<TX, N>* xr = reinterpret_cast<const Pack<TX, N>*>(x + r * h);
    const Pack<TO, N>* rr = reinterpret_cast<const Pack<TO, N>*>(res + r * h);
    Pack<TO, N>* orow = reinterpret_cast<Pack<TO, N>*>(out + r * h);
    for (int64_t c = threadIdx.x; c < packs; c += blockDim.x) {
      Pack<TX, N> xin = xr[c];
      Pack<TO, N> rin = rr[c], o;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        float v = to_f(xin.v[k]) + b[c * N + k];
        if (kDrop) {
          const uint64_t idx = static_cast<uint64_t>(r * h + c * N + k);
          v = dropout_bits(seed, idx) >= d.threshold ? v * d.scale : 0.0f;
        }
        o.v[k] = from_f<TO>(to_f(rin.v[k]) + v);
      }
      orow[c] = o;
    }
  }
}

template <typename T, int N>
__global__ void dropout_bwd_kernel(const T* __restrict__ g, T* __restrict__ dx, int64_t n, DropoutParams d) {
  const uint64_t seed = static_cast<uint64_t>(*d.seed);
  const int64_t packs = n / N;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < packs;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Pack<T, N> gin = reinterpret_cast<const Pack<T, N>*>(g)[c], o;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const uint64_t idx = static_cast<uint64_t>(c * N + k);
      o.v[k] = from_f<T>(dropout_bits(seed, idx) >= d.threshold ? to_f(gin.v[k]) * d.scale : 0.0f);
    }
    reinterpret_cast<Pack<T, N>*>(dx)[c] = o;
  }
}

// The widest pack (16 bytes of T, at most that of U) that divides h and keeps every row aligned.
template <typename T, typename U = T>
int pack_for(int64_t h, const void* a, const void* b, const void* c) {
  constexpr int n = pack_width<T>() < pack_width<U>() ? pack_width<T>() : pack_width<U>();
  return (h % n == 0 && aligned16(a) && aligned16(b) && aligned16(c)) ? n : 1;
}

unsigned row_grid(int64_t rows) { return grid_for(rows < (1 << 20) ? rows : (1 << 20)); }

}  // namespace

cudaError_t bias_gelu_fwd(DType t, const void* x, const float* bias, void* y, int64_t rows, int64_t h,
                          cudaStream_t stream) {
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = static_cast<const T*>(x);
    T* yp = static_cast<T*>(y);
    if (pack_for<T>(h, x, y, x) > 1)
      bias_gelu_fwd_kernel<T, pack_width<T>()><<<row_grid(rows), kThreads, 0, stream>>>(xp, bias, yp, rows, h);
    else
      bias_gelu_fwd_kernel<T, 1><<<row_grid(rows), kThreads, 0, stream>>>(xp, bias, yp, rows, h);
    return cudaGetLastError();
  });
}

cudaError_t bias_gelu_bwd(DType t, const void* grad, const void* x, const float* bias, void* dx, int64_t rows,
                          int64_t h, cudaStream_t stream) {
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T *gp = static_cast<const T*>(grad), *xp = static_cast<const T*>(x);
    T* dp = static_cast<T*>(dx);
    if (pack_for<T>(h, grad, x, dx) > 1)
      bias_gelu_bwd_kernel<T, pack_width<T>()><<<row_grid(rows), kThreads, 0, stream>>>(gp, xp, bias, dp, rows, h);
    else
      bias_gelu_bwd_kernel<T, 1><<<row_grid(rows), kThreads, 0, stream>>>(gp, xp, bias, dp, rows, h);
    return cudaGetLastError();
  });
}

namespace {
template <typename TX, typename TO>
cudaError_t launch_bda(const void* x, const float* bias, const void* res, void* out, int64_t rows, int64_t h,
                       DropoutParams d, cudaStream_t stream) {
  const TX* xp = static_cast<const TX*>(x);
  const TO* rp = static_cast<const TO*>(res);
  TO* op = static_cast<TO*>(out);
  constexpr int kN = pack_width<TX>() < pack_width<TO>() ? pack_width<TX>() : pack_width<TO>();
  const bool packed = pack_for<TX, TO>(h, x, res, out) > 1;
  const bool drop = d.threshold != 0;
  const unsigned grid = row_grid(rows);
  if (packed && drop)
    bias_dropout_add_kernel<TX, TO, kN, true><<<grid, kThreads, 0, stream>>>(xp, bias, rp, op, rows, h, d);
  else if (packed)
    bias_dropout_add_kernel<TX, TO, kN, false><<<grid, kThreads, 0, stream>>>(xp, bias, rp, op, rows, h, d);
  else if (drop)
    bias_dropout_add_kernel<TX, TO, 1, true><<<grid, kThreads, 0, stream>>>(xp, bias, rp, op, rows, h, d);
  else
    bias_dropout_add_kernel<TX, TO, 1, false><<<grid, kThreads, 0, stream>>>(xp, bias, rp, op, rows, h, d);
  return cudaGetLastError();
}
}  // namespace

cudaError_t bias_dropout_add_fwd(DType tx, DType to, const void* x, const float* bias, const void* residual,
                                 void* out, int64_t rows, int64_t h, DropoutParams d, cudaStream_t stream) {
  if (tx == to)
    return dispatch(tx, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      return launch_bda<T, T>(x, bias, residual, out, rows, h, d, stream);
    });
  if (to != DType::kFloat32) return cudaErrorInvalidValue;
  if (tx == DType::kBFloat16) return launch_bda<__nv_bfloat16, float>(x, bias, residual, out, rows, h, d, stream);
  return launch_bda<__half, float>(x, bias, residual, out, rows, h, d, stream);
}

cudaError_t dropout_bwd(DType t, const void* grad, void* dx, int64_t n, DropoutParams d, cudaStream_t stream) {
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* gp = static_cast<const T*>(grad);
    T* dp = static_cast<T*>(dx);
    constexpr int kN = pack_width<T>();
    const bool packed = pack_for<T>(n, grad, dx, dx) > 1;
    const int64_t work = packed ? n / kN : n;
    const unsigned grid = grid_for((work + kThreads - 1) / kThreads < 65536 ? (work + kThreads - 1) / kThreads : 65536);
    if (packed)
      dropout_bwd_kernel<T, kN><<<grid, kThreads, 0, stream>>>(gp, dp, n, d);
    else
      dropout_bwd_kernel<T, 1><<<grid, kThreads, 0, stream>>>(gp, dp, n, d);
    return cudaGetLastError();
  });
}

}  // namespace slipway::cuda
