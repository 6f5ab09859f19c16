// CPU loops of the row-wise ops: causal softmax, LayerNorm, cross-entropy over a local vocab shard.
// One row at a time through a per-thread fp32 (or fp64) scratch row, so each input element is read from
// memory once and each output written once; statistics are always kept in the compute type A.
#pragma once
#include <type_traits>

#include "cpu_math.h"

namespace slipway::cpu {

// y[j] = softmax(scale · x[:n])[j] for j < n, 0 for n ≤ j < sk (the causally masked future keys).
template <typename T, typename A>
SLIPWAY_CLONES void causal_softmax_row(const T* __restrict x, T* __restrict y, int64_t n, int64_t sk, A scale,
                                       A* __restrict buf) {
  for (int64_t j = 0; j < n; ++j) buf[j] = ld(x[j]) * scale;
  const A mx = max_arr<A>(buf, n);
  for (int64_t j = 0; j < n; ++j) buf[j] = fexp(buf[j] - mx);
  const A total = sum_arr<A>(buf, n);
  const A inv = n > 0 ? A(1) / total : A(0);
  for (int64_t j = 0; j < n; ++j) st(&y[j], buf[j] * inv);
  for (int64_t j = n; j < sk; ++j) st(&y[j], A(0));
}

// dx[j] = scale · y[j] · (g[j] − Σ_k g[k] y[k]); masked keys have y = 0 and so dx = 0.
template <typename T, typename A>
SLIPWAY_CLONES void causal_softmax_bwd_row(const T* __restrict g, const T* __restrict y, T* __restrict dx,
                                           int64_t n, int64_t sk, A scale, A* __restrict buf) {
  for (int64_t j = 0; j < n; ++j) buf[j] = ld(g[j]) * ld(y[j]);
  const A dot = sum_arr<A>(buf, n);
  for (int64_t j = 0; j < n; ++j) st(&dx[j], scale * ld(y[j]) * (ld(g[j]) - dot));
  for (int64_t j = n; j < sk; ++j) st(&dx[j], A(0));
}

// LayerNorm of one row: two-pass mean/variance (exact for large means, unlike Σx² − (Σx)²) over the
// row (converted into `buf` when stored in bf16/fp16); returns mean and rstd = 1/sqrt(var + eps).
template <typename T, typename A>
SLIPWAY_CLONES void layer_norm_row(const T* __restrict x, const A* __restrict w, const A* __restrict b,
                                   T* __restrict y, int64_t h, A eps, A* __restrict buf, A* mean_out,
                                   A* rstd_out) {
  const A* row = reinterpret_cast<const A*>(x);  // read in place when stored in the compute type
  if constexpr (!std::is_same_v<T, A>) {
    for (int64_t j = 0; j < h; ++j) buf[j] = ld(x[j]);
    row = buf;
  }
  const A mean = sum_arr<A>(row, h) / A(h);
  const A rstd = A(1) / std::sqrt(sqdev_arr<A>(row, mean, h) / A(h) + eps);
  for (int64_t j = 0; j < h; ++j) st(&y[j], (row[j] - mean) * rstd * w[j] + b[j]);
  *mean_out = mean;
  *rstd_out = rstd;
}

// LayerNorm backward of one row. Accumulates this row's dγ, dβ into gw, gb (per-thread partials).
// dx = rstd · (g·w − mean(g·w) − x̂ · mean(g·w·x̂)).
template <typename T, typename A>
SLIPWAY_CLONES void layer_norm_bwd_row(const T* __restrict g, const T* __restrict x, const A* __restrict w,
                                       A mean, A rstd, T* __restrict dx, int64_t h, A* __restrict gw,
                                       A* __restrict gb, A* __restrict buf) {
  A* __restrict xhat = buf;
  A* __restrict gxh = buf + h;
  for (int64_t j = 0; j < h; ++j) {
    const A gj = ld(g[j]), xh = (ld(x[j]) - mean) * rstd;
    xhat[j] = xh;
    gxh[j] = gj * w[j];
    gw[j] += gj * xh;
    gb[j] += gj;
  }
  const A c1 = sum_arr<A>(gxh, h) / A(h);
  const A c2 = dot_arr<A>(gxh, xhat, h) / A(h);
  for (int64_t j = 0; j < h; ++j) st(&dx[j], rstd * (gxh[j] - c1 - xhat[j] * c2));
}

// Local statistics of one row of logits over a vocab shard: max, Σ exp(l − max), and the target's
// logit when the target falls in this shard (local index t in [0, v)), else 0. `buf` holds v values.
template <typename T, typename A>
SLIPWAY_CLONES void ce_stats_row(const T* __restrict l, int64_t v, int64_t t, A* __restrict buf, A* mx_out,
                                 A* se_out, A* tl_out) {
  for (int64_t j = 0; j < v; ++j) buf[j] = ld(l[j]);
  const A mx = max_arr<A>(buf, v);
  for (int64_t j = 0; j < v; ++j) buf[j] = fexp(buf[j] - mx);
  *mx_out = mx;
  *se_out = sum_arr<A>(buf, v);
  *tl_out = (t >= 0 && t < v) ? ld(l[t]) : A(0);
}

// dl[j] = (exp(l[j] − lse) − [j == t]) · gl, written to `out` (which may alias `l`: in-place gradient).
template <typename T, typename A>
SLIPWAY_CLONES void ce_grad_row(const T* l, T* out, int64_t v, int64_t t, A lse, A gl) {
  const bool hit = t >= 0 && t < v;
  const A lt = hit ? ld(l[t]) : A(0);  // read before the loop: `out` may already have overwritten it
  for (int64_t j = 0; j < v; ++j) st(&out[j], fexp(ld(l[j]) - lse) * gl);
  if (hit) st(&out[t], (fexp(lt - lse) - A(1)) * gl);
}

}  // namespace slipway::cpu
