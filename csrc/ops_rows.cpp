// CPU implementations of the row-wise ops: scale+causal-mask+softmax, LayerNorm, and the local-shard
// cross-entropy primitives (schemas in ops.cpp).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu_rowwise.h"
#include "ops_common.h"

namespace slipway {
namespace {

using at::Tensor;

Tensor scaled_causal_softmax_cpu(const Tensor& scores, double scale) {
  check_scores(scores, "scaled_causal_softmax");
  Tensor xc = scores.contiguous();
  Tensor y = at::empty_like(xc);
  const int64_t sq = xc.size(-2), sk = xc.size(-1), rows = sk == 0 ? 0 : xc.numel() / sk;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "scaled_causal_softmax", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(sk), [&](int64_t r0, int64_t r1) {
      std::vector<A> buf(sk);
      for (int64_t r = r0; r < r1; ++r)
        cpu::causal_softmax_row<scalar_t, A>(xp + r * sk, yp + r * sk, causal_len(r, sq, sk), sk,
                                             static_cast<A>(scale), buf.data());
    });
  });
  return y;
}

Tensor scaled_causal_softmax_backward_cpu(const Tensor& grad, const Tensor& probs, double scale) {
  check_scores(probs, "scaled_causal_softmax_backward");
  check_same(probs, grad, "scaled_causal_softmax_backward", "grad");
  Tensor gc = grad.contiguous(), yc = probs.contiguous();
  Tensor dx = at::empty_like(yc);
  const int64_t sq = yc.size(-2), sk = yc.size(-1), rows = sk == 0 ? 0 : yc.numel() / sk;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, probs.scalar_type(), "causal_softmax_bwd", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t *gp = gc.data_ptr<scalar_t>(), *yp = yc.data_ptr<scalar_t>();
    scalar_t* dp = dx.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(sk), [&](int64_t r0, int64_t r1) {
      std::vector<A> buf(sk);
      for (int64_t r = r0; r < r1; ++r)
        cpu::causal_softmax_bwd_row<scalar_t, A>(gp + r * sk, yp + r * sk, dp + r * sk, causal_len(r, sq, sk),
                                                 sk, static_cast<A>(scale), buf.data());
    });
  });
  return dx;
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_cpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                                double eps) {
  check_vec(x, weight, "layer_norm", "weight");
  check_vec(x, bias, "layer_norm", "bias");
  const at::ScalarType acc = opmath_of(x.scalar_type());
  Tensor xc = x.contiguous(), w = weight.to(acc).contiguous(), b = bias.to(acc).contiguous();
  Tensor y = at::empty_like(xc);
  const int64_t h = x.size(-1), rows = h == 0 ? 0 : xc.numel() / h;
  Tensor mean = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(acc));
  Tensor rstd = at::empty_like(mean);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const A *wp = w.data_ptr<A>(), *bp = b.data_ptr<A>();
    A *mp = mean.data_ptr<A>(), *rp = rstd.data_ptr<A>();
    at::parallel_for(0, rows, grain_rows(h), [&](int64_t r0, int64_t r1) {
      std::vector<A> buf(h);
      for (int64_t r = r0; r < r1; ++r)
        cpu::layer_norm_row<scalar_t, A>(xp + r * h, wp, bp, yp + r * h, h, static_cast<A>(eps), buf.data(),
                                         mp + r, rp + r);
    });
  });
  return {y, mean, rstd};
}

// Each of `parts` tasks owns a contiguous block of rows and its own dγ/dβ partial rows.
std::tuple<Tensor, Tensor, Tensor> layer_norm_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& weight,
                                                         const Tensor& mean, const Tensor& rstd) {
  check_vec(x, weight, "layer_norm_backward", "weight");
  check_same(x, grad, "layer_norm_backward", "grad");
  const at::ScalarType acc = opmath_of(x.scalar_type());
  Tensor xc = x.contiguous(), gc = grad.contiguous(), w = weight.to(acc).contiguous();
  Tensor mc = mean.to(acc).contiguous(), rc = rstd.to(acc).contiguous();
  const int64_t h = x.size(-1), rows = h == 0 ? 0 : xc.numel() / h;
  TORCH_CHECK(mc.numel() == rows && rc.numel() == rows, "slipway::layer_norm_backward: mean/rstd must hold one "
              "value per row (", rows, "), got ", mc.numel(), " and ", rc.numel(), ".");
  Tensor dx = at::empty_like(xc);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  Tensor gw_part = at::zeros({parts, h}, x.options().dtype(acc)), gb_part = at::zeros_like(gw_part);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t *xp = xc.data_ptr<scalar_t>(), *gp = gc.data_ptr<scalar_t>();
    scalar_t* dp = dx.data_ptr<scalar_t>();
    const A *wp = w.data_ptr<A>(), *mp = mc.data_ptr<A>(), *rp = rc.data_ptr<A>();
    A *gwp = gw_part.data_ptr<A>(), *gbp = gb_part.data_ptr<A>();
    at::parallel_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
      std::vector<A> buf(2 * h);
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t r = t * rows / parts; r < (t + 1) * rows / parts; ++r)
          cpu::layer_norm_bwd_row<scalar_t, A>(gp + r * h, xp + r * h, wp, mp[r], rp[r], dp + r * h, h,
                                               gwp + t * h, gbp + t * h, buf.data());
    });
  });
  // One partial row per task, summed in task order (deterministic for a given thread count).
  auto total = [&](const Tensor& part) {
    return (parts == 1 ? part[0] : part.sum(0)).to(weight.scalar_type());
  };
  return {dx, total(gw_part), total(gb_part)};
}

// Logits as [rows, v] with unit stride along the vocab, but any row stride: a vocab slice of padded logits
// (logits[..., :V]) is read where it lies instead of being copied.
Tensor rows_view(const Tensor& logits) {
  Tensor l2 = logits.reshape({-1, logits.size(-1)});
  return l2.stride(1) == 1 || l2.size(1) <= 1 ? l2 : l2.contiguous();
}

std::tuple<Tensor, Tensor, Tensor> ce_local_stats_cpu(const Tensor& logits, const Tensor& target,
                                                    int64_t vocab_start) {
  check_ce(logits, target, "ce_local_stats");
  const at::ScalarType acc = opmath_of(logits.scalar_type());
  Tensor l2 = rows_view(logits), tc = target.to(at::kLong).contiguous();
  Tensor mx = at::empty(target.sizes(), logits.options().dtype(acc));
  Tensor se = at::empty_like(mx), tl = at::empty_like(mx);
  const int64_t v = l2.size(1), rows = l2.size(0), ld = l2.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "ce_local_stats", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* lp = l2.data_ptr<scalar_t>();
    const int64_t* tp = tc.data_ptr<int64_t>();
    A *mp = mx.data_ptr<A>(), *sp = se.data_ptr<A>(), *tlp = tl.data_ptr<A>();
    at::parallel_for(0, rows, grain_rows(v), [&](int64_t r0, int64_t r1) {
      std::vector<A> buf(v);
      for (int64_t r = r0; r < r1; ++r)
        cpu::ce_stats_row<scalar_t, A>(lp + r * ld, v, tp[r] - vocab_start, buf.data(), mp + r, sp + r, tlp + r);
    });
  });
  return {mx, se, tl};
}

// Writes the gradient of per-row loss (lse − target logit) w.r.t. logits into `out`: a new contiguous tensor,
// or the logits' own memory for the in-place variant (`out` then is `logits`, rows at the logits' stride).
void ce_grad_into(const Tensor& logits, const Tensor& out, const Tensor& target, int64_t vocab_start,
                  const Tensor& lse, const Tensor& grad_loss, bool inplace) {
  check_ce(logits, target, "ce_local_grad");
  check_rowvec(target, lse, "ce_local_grad", "lse");
  check_rowvec(target, grad_loss, "ce_local_grad", "grad_loss");
  const at::ScalarType acc = opmath_of(logits.scalar_type());
  Tensor l2 = rows_view(logits);
  Tensor tc = target.to(at::kLong).contiguous(), lc = lse.to(acc).contiguous(), gc = grad_loss.to(acc).contiguous();
  const int64_t v = l2.size(1), rows = l2.size(0), ld = l2.stride(0);
  const int64_t ldo = inplace ? ld : v;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "ce_local_grad", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* lp = l2.data_ptr<scalar_t>();
    scalar_t* op = inplace ? l2.data_ptr<scalar_t>() : out.data_ptr<scalar_t>();
    const int64_t* tp = tc.data_ptr<int64_t>();
    const A *lsp = lc.data_ptr<A>(), *gp = gc.data_ptr<A>();
    at::parallel_for(0, rows, grain_rows(v), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        cpu::ce_grad_row<scalar_t, A>(lp + r * ld, op + r * ldo, v, tp[r] - vocab_start, lsp[r], gp[r]);
    });
  });
}

Tensor ce_local_grad_cpu(const Tensor& logits, const Tensor& target, int64_t vocab_start, const Tensor& lse,
                         const Tensor& grad_loss) {
  Tensor out = at::empty(logits.sizes(), logits.options());
  ce_grad_into(logits, out, target, vocab_start, lse, grad_loss, false);
  return out;
}

void ce_local_grad_inplace_cpu(const Tensor& logits, const Tensor& target, int64_t vocab_start, const Tensor& lse,
                               const Tensor& grad_loss) {
  check_rows_in_place(logits, "ce_local_grad_");
  ce_grad_into(logits, logits, target, vocab_start, lse, grad_loss, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(slipway, CPU, m) {
  m.impl("scaled_causal_softmax", &scaled_causal_softmax_cpu);
  m.impl("scaled_causal_softmax_backward", &scaled_causal_softmax_backward_cpu);
  m.impl("layer_norm", &layer_norm_cpu);
  m.impl("layer_norm_backward", &layer_norm_backward_cpu);
  m.impl("ce_local_stats", &ce_local_stats_cpu);
  m.impl("ce_local_grad", &ce_local_grad_cpu);
  m.impl("ce_local_grad_", &ce_local_grad_inplace_cpu);
}

}  // namespace slipway
