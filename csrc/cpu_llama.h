// CPU loops of the Llama-style ops: RMSNorm, SwiGLU and the rotary-embedding apply (rotate-half layout),
// forward and backward. As in cpu_rowwise.h / cpu_pointwise.h: one pass over each row with the math in
// the compute type A (fp32, or fp64 for gradcheck), templated over the storage types and cloned per ISA.
#pragma once
#include <type_traits>

#include "cpu_math.h"

namespace slipway::cpu {

// v rounded to the storage type T and read back: the reference casts the normalised row to x's dtype
// before the weight multiplies, and the fused op keeps that rounding so both give the same values.
template <typename T, typename A>
SLIPWAY_INLINE A round_as(A v) {
  if constexpr (std::is_same_v<T, A>) {
    return v;
  } else {
    T t;
    st(&t, v);
    return ld(t);
  }
}

// RMSNorm of one row: rstd = 1/sqrt(mean(x²) + eps); y = w · round_T(x · rstd), stored as O (x's dtype,
// or fp32 when an fp32 weight meets a bf16/fp16 x under autocast, as eager type promotion gives).
template <typename T, typename O, typename A>
SLIPWAY_CLONES void rms_norm_row(const T* __restrict x, const A* __restrict w, O* __restrict y, int64_t h, A eps,
                                 A* __restrict buf, A* rstd_out) {
  const A* row = reinterpret_cast<const A*>(x);  // read in place when stored in the compute type
  if constexpr (!std::is_same_v<T, A>) {
    for (int64_t j = 0; j < h; ++j) buf[j] = ld(x[j]);
    row = buf;
  }
  const A rstd = A(1) / std::sqrt(dot_arr<A>(row, row, h) / A(h) + eps);
  for (int64_t j = 0; j < h; ++j) st(&y[j], round_as<T, A>(row[j] * rstd) * w[j]);
  *rstd_out = rstd;
}

// RMSNorm backward of one row (g in the output's storage type G). With x̂ = x·rstd and n = g·w:
// dx = rstd · (n − x̂ · mean(n·x̂)); this row's dw = g·x̂ is added to gw (a per-thread partial row).
template <typename T, typename G, typename A>
SLIPWAY_CLONES void rms_norm_bwd_row(const G* __restrict g, const T* __restrict x, const A* __restrict w, A rstd,
                                     T* __restrict dx, int64_t h, A* __restrict gw, A* __restrict buf) {
  A* __restrict xhat = buf;
  A* __restrict gn = buf + h;
  for (int64_t j = 0; j < h; ++j) {
    const A gj = ld(g[j]), xh = ld(x[j]) * rstd;
    xhat[j] = xh;
    gn[j] = gj * w[j];
    gw[j] += gj * xh;
  }
  const A c = dot_arr<A>(gn, xhat, h) / A(h);
  for (int64_t j = 0; j < h; ++j) st(&dx[j], rstd * (gn[j] - xhat[j] * c));
}

// e^x for x the caller has clamped to [−87, 80]: fexp's polynomial (cpu_math.h) without its clamps, and
// rounding to nearest by adding and subtracting 1.5·2^23 (exact for |x·log2 e| < 2^22; GCC keeps both adds
// without -ffast-math). fexp's own clamps and rounding select compile to ~20 masked vector instructions in
// these loops, which made the fp32 SwiGLU forward compute-bound and slower than eager.
SLIPWAY_INLINE float exp_clamped(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 · 2^23
  return exp_from_reduced(x, (x * 1.44269504088896341f + kRound) - kRound);
}
SLIPWAY_INLINE double exp_clamped(double x) { return std::exp(x); }

// σ(a), with −a clamped to [−87, 80] so that 1 + e^−a and σ stay normal floats (no denormal slow path);
// σ(a < −80) is below 2e−35, so silu is 0 to fp32 precision there either way. NaN propagates.
template <typename A>
SLIPWAY_INLINE A sigmoid_clamped(A a) {
  A m = -a;
  m = m < A(-87) ? A(-87) : m;
  m = m > A(80) ? A(80) : m;
  return A(1) / (A(1) + exp_clamped(m));
}

// y[r, j] = silu(x[r, j]) · x[r, f + j] for rows of 2f inputs (gate then up) and f outputs.
template <typename T, typename A>
SLIPWAY_CLONES void swiglu_fwd(const T* __restrict x, T* __restrict y, int64_t rows, int64_t f) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict xr = x + r * 2 * f;
    T* __restrict yr = y + r * f;
    for (int64_t j = 0; j < f; ++j) {
      const A a = ld(xr[j]);
      st(&yr[j], a * sigmoid_clamped<A>(a) * ld(xr[f + j]));
    }
  }
}

// d gate = g · up · σ(a)(1 + a(1 − σ(a))), d up = g · silu(a), into rows of 2f like x.
template <typename T, typename A>
SLIPWAY_CLONES void swiglu_bwd(const T* __restrict g, const T* __restrict x, T* __restrict dx, int64_t rows,
                               int64_t f) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict xr = x + r * 2 * f;
    const T* __restrict gr = g + r * f;
    T* __restrict dr = dx + r * 2 * f;
    for (int64_t j = 0; j < f; ++j) {
      const A a = ld(xr[j]), u = ld(xr[f + j]), gj = ld(gr[j]);
      const A s = sigmoid_clamped<A>(a);
      st(&dr[j], gj * u * s * (A(1) + a * (A(1) - s)));
      st(&dr[f + j], gj * a * s);
    }
  }
}

// Rotary apply on one row of d (rotate-half layout over the first d_rot = 2·half dims, the rest copied):
// out[j] = x[j]·c[j] − x[j+half]·s[j], out[j+half] = x[j+half]·c[j+half] + x[j]·s[j+half] (j < half).
// With kTranspose it applies the transposed map (the backward, g in and dx out):
// dx[j] = g[j]·c[j] + g[j+half]·s[j+half], dx[j+half] = g[j+half]·c[j+half] − g[j]·s[j].
template <typename T, typename A, bool kTranspose>
SLIPWAY_CLONES void rotary_row(const T* __restrict x, const A* __restrict c, const A* __restrict s,
                               T* __restrict out, int64_t half, int64_t d) {
  for (int64_t j = 0; j < half; ++j) {
    const A lo = ld(x[j]), hi = ld(x[j + half]);
    const A s_lo = kTranspose ? -s[j + half] : s[j], s_hi = kTranspose ? -s[j] : s[j + half];
    st(&out[j], lo * c[j] - hi * s_lo);
    st(&out[j + half], hi * c[j + half] + lo * s_hi);
  }
  for (int64_t j = 2 * half; j < d; ++j) out[j] = x[j];
}

}  // namespace slipway::cpu
