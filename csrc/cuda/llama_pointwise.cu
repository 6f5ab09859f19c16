// Pointwise kernels of the Llama-style ops: SwiGLU (bias-free, forward and backward) and the rotary
// apply (rotate-half layout, forward and its transpose for backward). Math in fp32 for every storage type.
#include "common.cuh"

namespace slipway::cuda {
namespace {

constexpr int kThreads = 128;

// σ(a) = 1/(1 + e^−a); for a → −∞, e^−a → inf and σ → 0 cleanly (the fast reciprocal of inf is 0).
__device__ __forceinline__ float sigmoid_f(float a) { return 1.0f / (1.0f + __expf(-a)); }

// One block walks rows; its threads cover a row's f outputs, N at a time (16-byte packs when f and the
// pointers allow), reading gate at x[r, c] and up at x[r, f + c].
template <typename T, int N>
__global__ void swiglu_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t f) {
  const int64_t packs = f / N;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const Pack<T, N>* gate = reinterpret_cast<const Pack<T, N>*>(x + r * 2 * f);
    const Pack<T, N>* up = reinterpret_cast<const Pack<T, N>*>(x + r * 2 * f + f);
    Pack<T, N>* yr = reinterpret_cast<Pack<T, N>*>(y + r * f);
    for (int64_t c = threadIdx.x; c < packs; c += blockDim.x) {
      Pack<T, N> a = gate[c], u = up[c], o;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float av = to_f(a.v[k]);
        o.v[k] = from_f<T>(av * sigmoid_f(av) * to_f(u.v[k]));
      }
      yr[c] = o;
    }
  }
}

// d gate = g · up · σ(a)(1 + a(1 − σ(a))), d up = g · silu(a).
template <typename T, int N>
__global__ void swiglu_bwd_kernel(const T* __restrict__ g, const T* __restrict__ x, T* __restrict__ dx,
                                  int64_t rows, int64_t f) {
  const int64_t packs = f / N;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const Pack<T, N>* gate = reinterpret_cast<const Pack<T, N>*>(x + r * 2 * f);
    const Pack<T, N>* up = reinterpret_cast<const Pack<T, N>*>(x + r * 2 * f + f);
    const Pack<T, N>* gr = reinterpret_cast<const Pack<T, N>*>(g + r * f);
    Pack<T, N>* dgate = reinterpret_cast<Pack<T, N>*>(dx + r * 2 * f);
    Pack<T, N>* dup = reinterpret_cast<Pack<T, N>*>(dx + r * 2 * f + f);
    for (int64_t c = threadIdx.x; c < packs; c += blockDim.x) {
      Pack<T, N> a = gate[c], u = up[c], gi = gr[c], da, du;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float av = to_f(a.v[k]), uv = to_f(u.v[k]), gv = to_f(gi.v[k]), s = sigmoid_f(av);
        da.v[k] = from_f<T>(gv * uv * s * (1.0f + av * (1.0f - s)));
        du.v[k] = from_f<T>(gv * av * s);
      }
      dgate[c] = da;
      dup[c] = du;
    }
  }
}

// One thread per element of [rows, d]; I is the index type (32-bit whenever rows·d fits: a 64-bit
// division per element costs more than the element's memory traffic).
template <typename T, typename I, bool kTranspose>
__global__ void rotary_kernel(const T* __restrict__ x, const float* __restrict__ cs, const float* __restrict__ sn,
                              T* __restrict__ out, I n, I s, I d, I d_rot) {
  const I half = d_rot / 2;
  for (I i = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<I>(gridDim.x) * blockDim.x) {
    const I r = i / d, j = i - r * d;
    if (j >= d_rot) {
      out[i] = x[i];
      continue;
    }
    const I t = (r % s) * d_rot;  // this row's position in the tables
    const bool lo = j < half;
    const I partner = lo ? j + half : j - half;
    // forward: out[j] = x[j]c[j] ∓ x[partner]·s[j]; transpose: dx[j] = g[j]c[j] ± g[partner]·s[partner].
    const float sv = kTranspose ? sn[t + partner] : sn[t + j];
    const float sign = (lo != kTranspose) ? -1.0f : 1.0f;
    out[i] = from_f<T>(to_f(x[i]) * cs[t + j] + sign * to_f(x[i - j + partner]) * sv);
  }
}

unsigned row_grid(int64_t rows) { return grid_for(rows < (1 << 20) ? rows : (1 << 20)); }

template <typename T>
bool packs_fit(int64_t f, const void* a, const void* b, const void* c) {
  return f % pack_width<T>() == 0 && aligned16(a) && aligned16(b) && aligned16(c);
}

template <typename T, typename I, bool kTranspose>
cudaError_t launch_rotary(const void* x, const float* cs, const float* sn, void* out, int64_t n, int64_t s,
                          int64_t d, int64_t d_rot, cudaStream_t stream) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  rotary_kernel<T, I, kTranspose><<<grid_for(blocks < 65536 ? blocks : 65536), kThreads, 0, stream>>>(
      static_cast<const T*>(x), cs, sn, static_cast<T*>(out), static_cast<I>(n), static_cast<I>(s),
      static_cast<I>(d), static_cast<I>(d_rot));
  return cudaGetLastError();
}

}  // namespace

cudaError_t swiglu_fwd(DType t, const void* x, void* y, int64_t rows, int64_t f, cudaStream_t stream) {
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = static_cast<const T*>(x);
    T* yp = static_cast<T*>(y);
    if (packs_fit<T>(f, x, y, y))
      swiglu_fwd_kernel<T, pack_width<T>()><<<row_grid(rows), kThreads, 0, stream>>>(xp, yp, rows, f);
    else
      swiglu_fwd_kernel<T, 1><<<row_grid(rows), kThreads, 0, stream>>>(xp, yp, rows, f);
    return cudaGetLastError();
  });
}

cudaError_t swiglu_bwd(DType t, const void* grad, const void* x, void* dx, int64_t rows, int64_t f,
                       cudaStream_t stream) {
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T *gp = static_cast<const T*>(grad), *xp = static_cast<const T*>(x);
    T* dp = static_cast<T*>(dx);
    if (packs_fit<T>(f, grad, x, dx))
      swiglu_bwd_kernel<T, pack_width<T>()><<<row_grid(rows), kThreads, 0, stream>>>(gp, xp, dp, rows, f);
    else
      swiglu_bwd_kernel<T, 1><<<row_grid(rows), kThreads, 0, stream>>>(gp, xp, dp, rows, f);
    return cudaGetLastError();
  });
}

cudaError_t rotary_apply(DType t, const void* x, const float* cos, const float* sin, void* out, int64_t rows,
                         int64_t s, int64_t d, int64_t d_rot, bool transpose, cudaStream_t stream) {
  const int64_t n = rows * d;
  if (n == 0) return cudaSuccess;
  const bool narrow = n <= 0x7fffffffLL;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (narrow && transpose) return launch_rotary<T, uint32_t, true>(x, cos, sin, out, n, s, d, d_rot, stream);
    if (narrow) return launch_rotary<T, uint32_t, false>(x, cos, sin, out, n, s, d, d_rot, stream);
    if (transpose) return launch_rotary<T, int64_t, true>(x, cos, sin, out, n, s, d, d_rot, stream);
    return launch_rotary<T, int64_t, false>(x, cos, sin, out, n, s, d, d_rot, stream);
  });
}

}  // namespace slipway::cuda
