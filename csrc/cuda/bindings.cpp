// CUDA implementations of the slipway ops: tensors → raw pointers, sizes and the current stream, then the
// launchers of csrc/cuda/*.cu. Compiled only in CUDA builds (setup.py); schemas are in csrc/ops.cpp and
// argument checks shared with the CPU wrappers in csrc/ops_common.h.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "../ops_common.h"
#include "../slipway_rng.h"
#include "bindings_common.h"
#include "kernels.h"

namespace slipway {
namespace {

using at::Tensor;
using cuda::DType;
using cuda::check_launch;
using cuda::dtype_of;
using cuda::f32;
using cuda::rows_of;
using cuda::stream_of;

Tensor bias_gelu_cuda(const Tensor& x, const Tensor& bias) {
  check_vec(x, bias, "bias_gelu", "bias");
  c10::cuda::CUDAGuard guard(x.device());
  Tensor xc = x.contiguous(), b = f32(bias), y = at::empty_like(xc);
  const int64_t h = bias.numel();
  check_launch(cuda::bias_gelu_fwd(dtype_of(x.scalar_type(), "bias_gelu"), xc.data_ptr(), b.data_ptr<float>(),
                                   y.data_ptr(), rows_of(xc, h), h, stream_of(x)), "bias_gelu");
  return y;
}

Tensor bias_gelu_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& bias) {
  check_vec(x, bias, "bias_gelu_backward", "bias");
  check_same(x, grad, "bias_gelu_backward", "grad");
  c10::cuda::CUDAGuard guard(x.device());
  Tensor xc = x.contiguous(), gc = grad.contiguous(), b = f32(bias), dx = at::empty_like(xc);
  const int64_t h = bias.numel();
  check_launch(cuda::bias_gelu_bwd(dtype_of(x.scalar_type(), "bias_gelu_backward"), gc.data_ptr(), xc.data_ptr(),
                                   b.data_ptr<float>(), dx.data_ptr(), rows_of(xc, h), h, stream_of(x)),
               "bias_gelu_backward");
  return dx;
}

cuda::DropoutParams dropout_params(double p, const Tensor& seed, const Tensor& like, const char* op) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "slipway::", op, ": dropout p must be in [0, 1), got ", p, ".");
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong && seed.device() == like.device(), "slipway::",
              op, ": seed must be a one-element int64 tensor on ", like.device(), " (drawn with torch's generator "
              "for that device), got ", seed.sizes(), " ", seed.scalar_type(), " on ", seed.device(), ".");
  return {seed.data_ptr<int64_t>(), dropout_threshold(p), static_cast<float>(1.0 / (1.0 - p))};
}

Tensor bias_dropout_add_cuda(const Tensor& x, const std::optional<Tensor>& bias, const Tensor& residual, double p,
                             const Tensor& seed) {
  TORCH_CHECK(x.sizes() == residual.sizes(), "slipway::bias_dropout_add: residual must have x's shape ", x.sizes(),
              ", got ", residual.sizes(), ".");
  c10::cuda::CUDAGuard guard(x.device());
  // The output dtype is x's and the residual's (the bias never promotes it): see csrc/ops.cpp.
  const at::ScalarType out_t = at::promote_types(x.scalar_type(), residual.scalar_type());
  const int64_t h = x.dim() == 0 ? 1 : x.size(-1);
  Tensor b;
  if (bias.has_value()) {
    check_vec(x, *bias, "bias_dropout_add", "bias");
    b = f32(*bias);
  } else {
    b = at::zeros({h}, x.options().dtype(at::kFloat));
  }
  const bool mixed = x.scalar_type() != out_t && out_t == at::kFloat &&
                     (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
  Tensor xc = mixed ? x.contiguous() : x.to(out_t).contiguous();
  Tensor rc = residual.to(out_t).contiguous(), out = at::empty_like(rc);
  cuda::DropoutParams d = dropout_params(p, seed, x, "bias_dropout_add");
  check_launch(cuda::bias_dropout_add_fwd(dtype_of(xc.scalar_type(), "bias_dropout_add"),
                                          dtype_of(out_t, "bias_dropout_add"), xc.data_ptr(), b.data_ptr<float>(),
                                          rc.data_ptr(), out.data_ptr(), rows_of(xc, h), h, d, stream_of(x)),
               "bias_dropout_add");
  return out;
}

Tensor dropout_backward_cuda(const Tensor& grad, double p, const Tensor& seed) {
  c10::cuda::CUDAGuard guard(grad.device());
  cuda::DropoutParams d = dropout_params(p, seed, grad, "dropout_backward");
  Tensor gc = grad.contiguous();
  if (d.threshold == 0) return gc.clone();
  Tensor dx = at::empty_like(gc);
  check_launch(cuda::dropout_bwd(dtype_of(grad.scalar_type(), "dropout_backward"), gc.data_ptr(), dx.data_ptr(),
                                 gc.numel(), d, stream_of(grad)), "dropout_backward");
  return dx;
}

Tensor scaled_causal_softmax_cuda(const Tensor& scores, double scale) {
  check_scores(scores, "scaled_causal_softmax");
  c10::cuda::CUDAGuard guard(scores.device());
  Tensor xc = scores.contiguous(), y = at::empty_like(xc);
  const int64_t sq = xc.size(-2), sk = xc.size(-1);
  check_launch(cuda::causal_softmax_fwd(dtype_of(xc.scalar_type(), "scaled_causal_softmax"), xc.data_ptr(),
                                        y.data_ptr(), rows_of(xc, sk), sq, sk, static_cast<float>(scale),
                                        stream_of(xc)), "scaled_causal_softmax");
  return y;
}

Tensor scaled_causal_softmax_backward_cuda(const Tensor& grad, const Tensor& probs, double scale) {
  check_scores(probs, "scaled_causal_softmax_backward");
  check_same(probs, grad, "scaled_causal_softmax_backward", "grad");
  c10::cuda::CUDAGuard guard(probs.device());
  Tensor gc = grad.contiguous(), yc = probs.contiguous(), dx = at::empty_like(yc);
  const int64_t sq = yc.size(-2), sk = yc.size(-1);
  check_launch(cuda::causal_softmax_bwd(dtype_of(yc.scalar_type(), "scaled_causal_softmax_backward"),
                                        gc.data_ptr(), yc.data_ptr(), dx.data_ptr(), rows_of(yc, sk), sq, sk,
                                        static_cast<float>(scale), stream_of(yc)),
               "scaled_causal_softmax_backward");
  return dx;
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_cuda(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                                 double eps) {
  check_vec(x, weight, "layer_norm", "weight");
  check_vec(x, bias, "layer_norm", "bias");
  c10::cuda::CUDAGuard guard(x.device());
  Tensor xc = x.contiguous(), w = f32(weight), b = f32(bias), y = at::empty_like(xc);
  const int64_t h = x.size(-1);
  Tensor mean = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  Tensor rstd = at::empty_like(mean);
  check_launch(cuda::layer_norm_fwd(dtype_of(x.scalar_type(), "layer_norm"), xc.data_ptr(), w.data_ptr<float>(),
                                    b.data_ptr<float>(), y.data_ptr(), mean.data_ptr<float>(),
                                    rstd.data_ptr<float>(), rows_of(xc, h), h, static_cast<float>(eps),
                                    stream_of(x)), "layer_norm");
  return {y, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_backward_cuda(const Tensor& grad, const Tensor& x,
                                                          const Tensor& weight, const Tensor& mean,
                                                          const Tensor& rstd) {
  check_vec(x, weight, "layer_norm_backward", "weight");
  check_same(x, grad, "layer_norm_backward", "grad");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t h = x.size(-1), rows = rows_of(x, h);
  Tensor xc = x.contiguous(), gc = grad.contiguous(), w = f32(weight), mc = f32(mean), rc = f32(rstd);
  TORCH_CHECK(mc.numel() == rows && rc.numel() == rows, "slipway::layer_norm_backward: mean/rstd must hold one "
              "value per row (", rows, "), got ", mc.numel(), " and ", rc.numel(), ".");
  Tensor dx = at::empty_like(xc);
  Tensor gw = at::empty({h}, x.options().dtype(at::kFloat)), gb = at::empty_like(gw);
  Tensor ws = at::empty({cuda::layer_norm_bwd_workspace(rows, h)}, x.options().dtype(at::kFloat));
  check_launch(cuda::layer_norm_bwd(dtype_of(x.scalar_type(), "layer_norm_backward"), gc.data_ptr(),
                                    xc.data_ptr(), w.data_ptr<float>(), mc.data_ptr<float>(), rc.data_ptr<float>(),
                                    dx.data_ptr(), gw.data_ptr<float>(), gb.data_ptr<float>(),
                                    ws.data_ptr<float>(), rows, h, stream_of(x)), "layer_norm_backward");
  return {dx, gw.to(weight.scalar_type()), gb.to(weight.scalar_type())};
}

// [rows, v] with unit stride along the vocab and any row stride (a vocab slice of padded logits).
Tensor rows_view(const Tensor& logits) {
  Tensor l2 = logits.reshape({-1, logits.size(-1)});
  return l2.stride(1) == 1 || l2.size(1) <= 1 ? l2 : l2.contiguous();
}

std::tuple<Tensor, Tensor, Tensor> ce_local_stats_cuda(const Tensor& logits, const Tensor& target,
                                                     int64_t vocab_start) {
  check_ce(logits, target, "ce_local_stats");
  c10::cuda::CUDAGuard guard(logits.device());
  Tensor l2 = rows_view(logits), tc = target.to(at::kLong).contiguous();
  Tensor mx = at::empty(target.sizes(), logits.options().dtype(at::kFloat));
  Tensor se = at::empty_like(mx), tl = at::empty_like(mx);
  check_launch(cuda::ce_stats(dtype_of(logits.scalar_type(), "ce_local_stats"), l2.data_ptr(), l2.stride(0),
                              tc.data_ptr<int64_t>(), vocab_start, mx.data_ptr<float>(), se.data_ptr<float>(),
                              tl.data_ptr<float>(), l2.size(0), l2.size(1), stream_of(logits)), "ce_local_stats");
  return {mx, se, tl};
}

void ce_grad_into(const Tensor& logits, const Tensor& out, const Tensor& target, int64_t vocab_start,
                  const Tensor& lse, const Tensor& grad_loss, bool inplace) {
  check_ce(logits, target, "ce_local_grad");
  check_rowvec(target, lse, "ce_local_grad", "lse");
  check_rowvec(target, grad_loss, "ce_local_grad", "grad_loss");
  c10::cuda::CUDAGuard guard(logits.device());
  Tensor l2 = rows_view(logits), tc = target.to(at::kLong).contiguous(), lc = f32(lse), gc = f32(grad_loss);
  // In place: the rows are the logits' own, at their stride (csrc/ops_rows.cpp); else a new contiguous tensor.
  void* op = inplace ? l2.data_ptr() : out.data_ptr();
  const int64_t ldo = inplace ? l2.stride(0) : l2.size(1);
  check_launch(cuda::ce_grad(dtype_of(logits.scalar_type(), "ce_local_grad"), l2.data_ptr(), l2.stride(0), op,
                             ldo, tc.data_ptr<int64_t>(), vocab_start, lc.data_ptr<float>(), gc.data_ptr<float>(),
                             l2.size(0), l2.size(1), stream_of(logits)), "ce_local_grad");
}

Tensor ce_local_grad_cuda(const Tensor& logits, const Tensor& target, int64_t vocab_start, const Tensor& lse,
                          const Tensor& grad_loss) {
  Tensor out = at::empty(logits.sizes(), logits.options());
  ce_grad_into(logits, out, target, vocab_start, lse, grad_loss, false);
  return out;
}

void ce_local_grad_inplace_cuda(const Tensor& logits, const Tensor& target, int64_t vocab_start, const Tensor& lse,
                                const Tensor& grad_loss) {
  check_rows_in_place(logits, "ce_local_grad_");
  ce_grad_into(logits, logits, target, vocab_start, lse, grad_loss, true);
}

// Pointer table and chunk list for the one-launch AdamW kernel (layout in csrc/cuda/kernels.h), staged in
// pinned memory and copied asynchronously on the current stream.
Tensor adamw_meta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList model_params, int64_t* n_chunks) {
  const int64_t n = static_cast<int64_t>(params.size()), chunk = cuda::adamw_chunk_size();
  std::vector<int64_t> chunks;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t st = 0; st < params[i].numel(); st += chunk) chunks.insert(chunks.end(), {i, st});
  *n_chunks = static_cast<int64_t>(chunks.size() / 2);
  Tensor host = at::empty({6 * n + static_cast<int64_t>(chunks.size())},
                          at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  auto addr = [](const Tensor& t) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())); };
  for (int64_t i = 0; i < n; ++i) {
    h[6 * i + 0] = addr(params[i]);
    h[6 * i + 1] = addr(grads[i]);
    h[6 * i + 2] = addr(exp_avgs[i]);
    h[6 * i + 3] = addr(exp_avg_sqs[i]);
    h[6 * i + 4] = model_params.empty() ? 0 : addr(model_params[i]);
    h[6 * i + 5] = params[i].numel();
  }
  if (!chunks.empty()) std::memcpy(h + 6 * n, chunks.data(), chunks.size() * sizeof(int64_t));
  return host.to(params[0].device(), /*non_blocking=*/true);
}

void adamw_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList model_params, double lr, double beta1, double beta2,
                     double eps, double weight_decay, int64_t step, double grad_scale) {
  check_adamw(params, grads, exp_avgs, exp_avg_sqs, model_params);
  TORCH_CHECK(step >= 1, "slipway::adamw_step_: step counts from 1 (bias correction), got ", step, ".");
  if (params.empty()) return;
  c10::cuda::CUDAGuard guard(params[0].device());
  const at::ScalarType gt = grads[0].scalar_type();
  const at::ScalarType mt = model_params.empty() ? at::kFloat : model_params[0].scalar_type();
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(grads[i].scalar_type() == gt && grads[i].is_contiguous() && grads[i].device() == params[0].device()
                    && params[i].device() == params[0].device(),
                "slipway::adamw_step_ (CUDA): all grads must be contiguous, of one dtype and on one device with "
                "the params; tensor ", i, " is not.");
    TORCH_CHECK(model_params.empty() || model_params[i].scalar_type() == mt,
                "slipway::adamw_step_ (CUDA): all model_params must share one dtype.");
  }
  int64_t n_chunks = 0;
  Tensor meta = adamw_meta(params, grads, exp_avgs, exp_avg_sqs, model_params, &n_chunks);
  const AdamWScalars s = make_adamw_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  check_launch(cuda::adamw_step(dtype_of(gt, "adamw_step_"), dtype_of(mt, "adamw_step_"), !model_params.empty(),
                                meta.data_ptr<int64_t>(), static_cast<int64_t>(params.size()), n_chunks, s,
                                stream_of(params[0])), "adamw_step_");
}

}  // namespace

TORCH_LIBRARY_IMPL(slipway, CUDA, m) {
  m.impl("bias_gelu", &bias_gelu_cuda);
  m.impl("bias_gelu_backward", &bias_gelu_backward_cuda);
  m.impl("bias_dropout_add", &bias_dropout_add_cuda);
  m.impl("dropout_backward", &dropout_backward_cuda);
  m.impl("scaled_causal_softmax", &scaled_causal_softmax_cuda);
  m.impl("scaled_causal_softmax_backward", &scaled_causal_softmax_backward_cuda);
  m.impl("layer_norm", &layer_norm_cuda);
  m.impl("layer_norm_backward", &layer_norm_backward_cuda);
  m.impl("ce_local_stats", &ce_local_stats_cuda);
  m.impl("ce_local_grad", &ce_local_grad_cuda);
  m.impl("ce_local_grad_", &ce_local_grad_inplace_cuda);
  m.impl("adamw_step_", &adamw_step_cuda);
}

}  // namespace slipway
