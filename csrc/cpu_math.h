// Scalar building blocks of the CPU kernels, written so that GCC auto-vectorises the loops that use them
// (-O3 -fno-trapping-math -fno-math-errno, see setup.py) and compiled once per ISA level through
// SLIPWAY_CLONES, which dispatches at load time to AVX-512, AVX2 or baseline code (glibc ifunc).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define SLIPWAY_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SLIPWAY_CLONES
#endif

// Helpers must be inlined into each ISA clone to be compiled for that ISA: an out-of-line copy is
// baseline code (and would pass 64-byte vectors without AVX-512 registers).
#if defined(__GNUC__)
#define SLIPWAY_INLINE inline __attribute__((always_inline))
#else
#define SLIPWAY_INLINE inline
#endif

namespace slipway::cpu {

// ---- loads and stores: compute type is float for float/bf16/fp16 and double for double -------------
SLIPWAY_INLINE float ld(float v) { return v; }
SLIPWAY_INLINE double ld(double v) { return v; }
SLIPWAY_INLINE float ld(c10::BFloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
SLIPWAY_INLINE float ld(c10::Half v) { return c10::detail::fp16_ieee_to_fp32_value(v.x); }

SLIPWAY_INLINE void st(float* p, float v) { *p = v; }
SLIPWAY_INLINE void st(double* p, double v) { *p = v; }
SLIPWAY_INLINE void st(c10::BFloat16* p, float v) {
  // Round to nearest even, as c10 does, but branch-free so the loop vectorises; NaN stays a quiet NaN.
  uint32_t u;
  std::memcpy(&u, &v, 4);
  uint32_t r = (u + 0x7FFFU + ((u >> 16) & 1U)) >> 16;
  p->x = static_cast<uint16_t>(v != v ? 0x7FC0U : r);
}
SLIPWAY_INLINE void st(c10::Half* p, float v) { p->x = c10::detail::fp16_ieee_from_fp32_value(v); }

// ---- exp ------------------------------------------------------------------------------------------
// Cephes-style expf: x = n·ln2 + r with a two-part ln2, a degree-6 polynomial for e^r and 2^n assembled
// in the exponent bits; about 1-2 ulp on [-87, 88]. Inputs outside are clamped (e^-87 ≈ 1.6e-38 is
// the smallest normal result: no denormals, which are slow on x86); NaN propagates.
// exp_from_reduced is that polynomial and exponent assembly given fn = round(x/ln2), the one copy of it:
// fexp below clamps and rounds with a select, exp_clamped (cpu_llama.h) rounds with the 1.5·2^23 trick
// that vectorises.
SLIPWAY_INLINE float exp_from_reduced(float x, float fn) {
  const int32_t n = static_cast<int32_t>(fn);
  float r = x - fn * 0.693359375f;
  r = r + fn * 2.12194440e-4f;
  float q = 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  q = q * r * r + r + 1.0f;
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return q * scale;
}

SLIPWAY_INLINE float fexp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  float t = x * 1.44269504088896341f;
  int32_t n = static_cast<int32_t>(t + (t >= 0.0f ? 0.5f : -0.5f));
  return exp_from_reduced(x, static_cast<float>(n));
}
SLIPWAY_INLINE double fexp(double x) { return std::exp(x); }

// ---- GeLU, tanh approximation ----------------------------------------------------------------------
// 0.5·v·(1 + tanh(u)) = v·σ(2u) with u = √(2/π)(v + 0.044715 v³): one exp, no tanh.
// d/dv = s + 2v·s(1−s)·u', s = σ(2u), 1 − s = e·s with e = exp(−2u).
template <typename A>
SLIPWAY_INLINE A gelu_sigmoid(A v) {
  const A k = A(0.7978845608028654), c = A(0.044715);
  A m2u = A(-2) * k * (v + c * v * v * v);
  m2u = m2u < A(-80) ? A(-80) : m2u;  // keeps s and 1−s normal floats; σ is 0/1 to fp32 precision there
  m2u = m2u > A(80) ? A(80) : m2u;
  return A(1) / (A(1) + fexp(m2u));
}
template <typename A>
SLIPWAY_INLINE A gelu_fwd(A v) {
  return v * gelu_sigmoid(v);
}
template <typename A>
SLIPWAY_INLINE A gelu_grad(A v) {
  const A k = A(0.7978845608028654), c = A(0.044715);
  A s = gelu_sigmoid(v);
  A du = k * (A(1) + A(3) * c * v * v);
  return s + A(2) * v * s * (A(1) - s) * du;
}

// ---- reductions over arrays -----------------------------------------------------------------------
// GCC vector extensions: 16 lanes, which each ISA clone maps to its own registers (one zmm, two ymm or
// four xmm), with two accumulators to hide the add latency. Plain scalar loops would need
// -ffast-math's reassociation licence to vectorise a float sum at all.
template <typename A>
struct Lanes;
template <>
struct Lanes<float> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct Lanes<double> {
  typedef double type __attribute__((vector_size(128)));
};
constexpr int64_t kLanes = 16;

template <typename A>
SLIPWAY_INLINE typename Lanes<A>::type vload(const A* p) {
  typename Lanes<A>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename A>
SLIPWAY_INLINE A hsum(typename Lanes<A>::type v) {
  A s = A(0);
  for (int64_t k = 0; k < kLanes; ++k) s += v[k];
  return s;
}

// Σ p[j] · q[j] (q = nullptr: Σ p[j]).
template <typename A>
SLIPWAY_INLINE A dot_arr(const A* p, const A* q, int64_t n) {
  typename Lanes<A>::type a0 = {}, a1 = {};
  int64_t j = 0;
  for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
    if (q == nullptr) {
      a0 += vload(p + j);
      a1 += vload(p + j + kLanes);
    } else {
      a0 += vload(p + j) * vload(q + j);
      a1 += vload(p + j + kLanes) * vload(q + j + kLanes);
    }
  }
  A s = hsum<A>(a0 + a1);
  for (; j < n; ++j) s += q == nullptr ? p[j] : p[j] * q[j];
  return s;
}
template <typename A>
SLIPWAY_INLINE A sum_arr(const A* p, int64_t n) {
  return dot_arr<A>(p, nullptr, n);
}

// Σ (p[j] − c)².
template <typename A>
SLIPWAY_INLINE A sqdev_arr(const A* p, A c, int64_t n) {
  typename Lanes<A>::type a0 = {}, a1 = {};
  int64_t j = 0;
  for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
    typename Lanes<A>::type d0 = vload(p + j) - c, d1 = vload(p + j + kLanes) - c;
    a0 += d0 * d0;
    a1 += d1 * d1;
  }
  A s = hsum<A>(a0 + a1);
  for (; j < n; ++j) s += (p[j] - c) * (p[j] - c);
  return s;
}

// max_j p[j] (−inf for n = 0; NaNs are skipped, as the subsequent exp/sum propagates them anyway).
template <typename A>
SLIPWAY_INLINE A max_arr(const A* p, int64_t n) {
  const A lowest = -std::numeric_limits<A>::infinity();
  typename Lanes<A>::type m = {};
  m = m + lowest;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    typename Lanes<A>::type v = vload(p + j);
    m = v > m ? v : m;
  }
  A best = lowest;
  for (int64_t k = 0; k < kLanes; ++k) best = m[k] > best ? m[k] : best;
  for (; j < n; ++j) best = p[j] > best ? p[j] : best;
  return best;
}

}  // namespace slipway::cpu
