// CPU loops of the pointwise ops: bias+GeLU, bias+dropout+residual, AdamW. Each loop is one pass over
// memory with the intermediates in registers (the point of fusing), templated over the storage type T
// and compute type A (float, or double for gradcheck), and cloned per ISA level (cpu_math.h).
#pragma once
#include "adamw_math.h"
#include "cpu_math.h"
#include "slipway_rng.h"

namespace slipway::cpu {

// y[r, j] = gelu(x[r, j] + b[j]) for `rows` rows of width h.
template <typename T, typename A>
SLIPWAY_CLONES void bias_gelu_fwd(const T* __restrict x, const A* __restrict b, T* __restrict y, int64_t rows,
                                  int64_t h) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < h; ++j) st(&y[r * h + j], gelu_fwd<A>(ld(x[r * h + j]) + b[j]));
}

// dx[r, j] = g[r, j] · gelu'(x[r, j] + b[j]).
template <typename T, typename A>
SLIPWAY_CLONES void bias_gelu_bwd(const T* __restrict g, const T* __restrict x, const A* __restrict b,
                                  T* __restrict dx, int64_t rows, int64_t h) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < h; ++j) {
      int64_t i = r * h + j;
      st(&dx[i], ld(g[i]) * gelu_grad<A>(ld(x[i]) + b[j]));
    }
}

struct DropoutArgs {
  uint64_t seed;
  uint32_t threshold;  // drop when dropout_bits < threshold (slipway_rng.h)
  float scale;         // 1 / (1 − p)
};

// out = residual + mask · (x + b) · scale over rows [row0, row0 + rows); the mask index is the element's
// flat index in the whole tensor, so the result does not depend on how rows are split across threads.
// TX is x's storage type, TO that of residual and out (fp32 residual stream with bf16 x under autocast).
template <typename TX, typename TO, typename A>
SLIPWAY_CLONES void bias_dropout_add_fwd(const TX* __restrict x, const A* __restrict b, const TO* __restrict res,
                                         TO* __restrict out, int64_t row0, int64_t rows, int64_t h,
                                         DropoutArgs d) {
  const A scale = static_cast<A>(d.scale);
  for (int64_t r = row0; r < row0 + rows; ++r)
    for (int64_t j = 0; j < h; ++j) {
      int64_t i = r * h + j;
      A keep = dropout_bits(d.seed, static_cast<uint64_t>(i)) >= d.threshold ? scale : A(0);
      st(&out[i], ld(res[i]) + (ld(x[i]) + b[j]) * keep);
    }
}

// Dropout off (p = 0 or eval): out = residual + x + b.
template <typename TX, typename TO, typename A>
SLIPWAY_CLONES void bias_add_add_fwd(const TX* __restrict x, const A* __restrict b, const TO* __restrict res,
                                     TO* __restrict out, int64_t row0, int64_t rows, int64_t h) {
  for (int64_t r = row0; r < row0 + rows; ++r)
    for (int64_t j = 0; j < h; ++j) {
      int64_t i = r * h + j;
      st(&out[i], ld(res[i]) + ld(x[i]) + b[j]);
    }
}

// dx = g · mask · scale for flat elements [i0, i1), with the forward's mask regenerated from the seed.
template <typename T, typename A>
SLIPWAY_CLONES void dropout_bwd(const T* __restrict g, T* __restrict dx, int64_t i0, int64_t i1, DropoutArgs d) {
  const A scale = static_cast<A>(d.scale);
  for (int64_t i = i0; i < i1; ++i) {
    A keep = dropout_bits(d.seed, static_cast<uint64_t>(i)) >= d.threshold ? scale : A(0);
    st(&dx[i], ld(g[i]) * keep);
  }
}

// One AdamW step on n elements of an fp32 master copy `p`, with the same operation order as torch:
// p·=decay; m.lerp_(g, 1−β1); v = v·β2 + (1−β2)·g·g; p += −step_size · m / (sqrt(v)/bc2_sqrt + eps).
// FMAs sit where torch's AVX2/AVX-512 kernels have them. Results agree with torch to about an ulp, not
// bitwise: torch's vectorised CPU sqrt is not correctly rounded (this one is).
// When `model` is non-null the updated master value is also rounded into it (bf16/fp16 model weights).
template <typename G, typename M>
SLIPWAY_CLONES void adamw_chunk(float* __restrict p, const G* __restrict g, float* __restrict m,
                                float* __restrict v, M* __restrict model, int64_t n, AdamWScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    float gi = ld(g[i]) * s.grad_scale;
    float pi = p[i] * s.decay;
    float mi = m[i];
    mi = std::fma(s.one_minus_b1, gi - mi, mi);             // torch's vectorised lerp (weight < 0.5)
    float vi = std::fma(s.one_minus_b2 * gi, gi, v[i] * s.beta2);  // mul_(β2).addcmul_(g, g, 1 − β2)
    float denom = std::sqrt(vi) / s.bc2_sqrt + s.eps;
    pi = pi + (s.neg_step_size * mi) / denom;               // addcdiv_: self + (value·t1)/t2
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (model != nullptr) st(&model[i], pi);
  }
}

}  // namespace slipway::cpu
