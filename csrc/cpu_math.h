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

namespace slipway::cpu {

// ---- loads and stores: compute type is float for float/bf16/fp16 and double for double -------------
inline float ld(float v) { return v; }
inline double ld(double v) { return v; }
inline float ld(c10::BFloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float ld(c10::Half v) { return c10::detail::fp16_ieee_to_fp32_value(v.x); }

inline void st(float* p, float v) { *p = v; }
inline void st(double* p, double v) { *p = v; }
inline void st(c10::BFloat16* p, float v) {
  // Round to nearest even, as c10 does, but branch-free so the loop vectorises; NaN stays a quiet NaN.
  uint32_t u;
  std::memcpy(&u, &v, 4);
  uint32_t r = (u + 0x7FFFU + ((u >> 16) & 1U)) >> 16;
  p->x = static_cast<uint16_t>(v != v ? 0x7FC0U : r);
}
inline void st(c10::Half* p, float v) { p->x = c10::detail::fp16_ieee_from_fp32_value(v); }

// ---- exp ------------------------------------------------------------------------------------------
// Cephes-style expf: x = n·ln2 + r with a two-part ln2, a degree-6 polynomial for e^r and 2^n assembled
// in the exponent bits; about 1-2 ulp on [-87, 88]. Inputs outside are clamped (e^-87 ≈ 1.6e-38 is
// the smallest normal result: no denormals, which are slow on x86); NaN propagates.
inline float fexp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  float t = x * 1.44269504088896341f;
  int32_t n = static_cast<int32_t>(t + (t >= 0.0f ? 0.5f : -0.5f));
  float fn = static_cast<float>(n);
  float r = x - fn * 0.693359375f;
  r = r + fn * 2.12194440e-4f;
  float q = 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  q = q * r * r + r + 1.0f;
  int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return q * scale;
}
inline double fexp(double x) { return std::exp(x); }

// ---- GeLU, tanh approximation ----------------------------------------------------------------------
// 0.5·v·(1 + tanh(u)) = v·σ(2u) with u = √(2/π)(v + 0.044715 v³): one exp, no tanh.
// d/dv = s + 2v·s(1−s)·u', s = σ(2u), 1 − s = e·s with e = exp(−2u).
template <typename A>
inline A gelu_sigmoid(A v) {
  const A k = A(0.7978845608028654), c = A(0.044715);
  A m2u = A(-2) * k * (v + c * v * v * v);
  m2u = m2u < A(-80) ? A(-80) : m2u;  // keeps s and 1−s normal floats; σ is 0/1 to fp32 precision there
  m2u = m2u > A(80) ? A(80) : m2u;
  return A(1) / (A(1) + fexp(m2u));
}
template <typename A>
inline A gelu_fwd(A v) {
  return v * gelu_sigmoid(v);
}
template <typename A>
inline A gelu_grad(A v) {
  const A k = A(0.7978845608028654), c = A(0.044715);
  A s = gelu_sigmoid(v);
  A du = k * (A(1) + A(3) * c * v * v);
  return s + A(2) * v * s * (A(1) - s) * du;
}

// ---- reductions: 16 independent accumulators so the vectoriser needs no reassociation licence -----
constexpr int64_t kLanes = 16;

template <typename A, typename F>
inline A sum_of(int64_t n, F f) {
  A acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) acc[k] += f(j + k);
  A tail = A(0);
  for (; j < n; ++j) tail += f(j);
  A total = tail;
  for (int64_t k = 0; k < kLanes; ++k) total += acc[k];
  return total;
}

template <typename A, typename F>
inline A max_of(int64_t n, F f) {
  const A lowest = -std::numeric_limits<A>::infinity();
  A acc[kLanes];
  for (int64_t k = 0; k < kLanes; ++k) acc[k] = lowest;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) {
      A v = f(j + k);
      acc[k] = v > acc[k] ? v : acc[k];
    }
  A best = lowest;
  for (; j < n; ++j) {
    A v = f(j);
    best = v > best ? v : best;
  }
  for (int64_t k = 0; k < kLanes; ++k) best = acc[k] > best ? acc[k] : best;
  return best;
}

}  // namespace slipway::cpu
