// Slipway's fused ops: schemas (shared by every backend) and the CPU implementations of the pointwise
// ops (bias+GeLU, bias+dropout+residual, AdamW); the row-wise ones are in ops_rows.cpp.
// The CUDA implementations register in csrc/cuda/bindings.cpp (CUDA builds only). Autograd and fake
// (meta) kernels are registered in Python, trainer/ops/fused.py, named below via set_python_module so
// torch imports it whenever it needs a fake kernel (torch.compile, opcheck).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu_pointwise.h"
#include "ops_common.h"

namespace slipway {
namespace {

using at::Tensor;

Tensor bias_gelu_cpu(const Tensor& x, const Tensor& bias) {
  check_vec(x, bias, "bias_gelu", "bias");
  Tensor xc = x.contiguous();
  Tensor b = bias.to(opmath_of(x.scalar_type())).contiguous();
  Tensor y = at::empty_like(xc);
  const int64_t h = bias.numel(), rows = h == 0 ? 0 : xc.numel() / h;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const A* bp = b.data_ptr<A>();
    at::parallel_for(0, rows, grain_rows(h), [&](int64_t r0, int64_t r1) {
      cpu::bias_gelu_fwd<scalar_t, A>(xp + r0 * h, bp, yp + r0 * h, r1 - r0, h);
    });
  });
  return y;
}

Tensor bias_gelu_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& bias) {
  check_vec(x, bias, "bias_gelu_backward", "bias");
  check_same(x, grad, "bias_gelu_backward", "grad");
  Tensor xc = x.contiguous(), gc = grad.contiguous();
  Tensor b = bias.to(opmath_of(x.scalar_type())).contiguous();
  Tensor dx = at::empty_like(xc);
  const int64_t h = bias.numel(), rows = h == 0 ? 0 : xc.numel() / h;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t *xp = xc.data_ptr<scalar_t>(), *gp = gc.data_ptr<scalar_t>();
    scalar_t* dp = dx.data_ptr<scalar_t>();
    const A* bp = b.data_ptr<A>();
    at::parallel_for(0, rows, grain_rows(h), [&](int64_t r0, int64_t r1) {
      cpu::bias_gelu_bwd<scalar_t, A>(gp + r0 * h, xp + r0 * h, bp, dp + r0 * h, r1 - r0, h);
    });
  });
  return dx;
}

cpu::DropoutArgs dropout_args(double p, const Tensor& seed, const char* op) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "slipway::", op, ": dropout p must be in [0, 1), got ", p,
              ". Fix: p = 1 drops everything; skip the branch instead.");
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong, "slipway::", op,
              ": seed must be a one-element int64 tensor (drawn with torch's generator), got ", seed.sizes(),
              " ", seed.scalar_type(), ".");
  return {static_cast<uint64_t>(seed.item<int64_t>()), dropout_threshold(p), static_cast<float>(1.0 / (1.0 - p))};
}

template <typename TX, typename TO>
void bias_dropout_add_launch(const Tensor& x, const Tensor& b, const Tensor& res, const Tensor& out,
                             const cpu::DropoutArgs& d) {
  using A = at::opmath_type<TO>;
  const TX* xp = x.data_ptr<TX>();
  const TO* rp = res.data_ptr<TO>();
  TO* op = out.data_ptr<TO>();
  const A* bp = b.data_ptr<A>();
  const int64_t h = x.dim() == 0 ? 1 : x.size(-1), rows = h == 0 ? 0 : x.numel() / h;
  at::parallel_for(0, rows, grain_rows(h), [&](int64_t r0, int64_t r1) {
    if (d.threshold == 0)
      cpu::bias_add_add_fwd<TX, TO, A>(xp, bp, rp, op, r0, r1 - r0, h);
    else
      cpu::bias_dropout_add_fwd<TX, TO, A>(xp, bp, rp, op, r0, r1 - r0, h, d);
  });
}

// out = residual + dropout(x + bias) in the promoted dtype of x and the residual; the bias (a parameter,
// fp32 under autocast) is read in the compute precision and never promotes the output: under autocast
// x and the residual stream are bf16/fp16 and so is the result. An fp32 residual with a low-precision x
// gives fp32 straight from x, without a separate cast pass.
Tensor bias_dropout_add_cpu(const Tensor& x, const std::optional<Tensor>& bias, const Tensor& residual, double p,
                            const Tensor& seed) {
  TORCH_CHECK(x.sizes() == residual.sizes(), "slipway::bias_dropout_add: residual must have x's shape ",
              x.sizes(), ", got ", residual.sizes(), ".");
  const at::ScalarType out_t = at::promote_types(x.scalar_type(), residual.scalar_type());
  if (bias.has_value()) check_vec(x, *bias, "bias_dropout_add", "bias");
  const int64_t h = x.dim() == 0 ? 1 : x.size(-1);
  Tensor b = bias.has_value() ? bias->to(opmath_of(out_t)).contiguous()
                              : at::zeros({h}, x.options().dtype(opmath_of(out_t)));
  cpu::DropoutArgs d = dropout_args(p, seed, "bias_dropout_add");
  const bool mixed = x.scalar_type() != out_t && out_t == at::kFloat &&
                     (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
  Tensor xc = mixed ? x.contiguous() : x.to(out_t).contiguous();
  Tensor rc = residual.to(out_t).contiguous();
  Tensor out = at::empty_like(rc);
  if (mixed && x.scalar_type() == at::kBFloat16) {
    bias_dropout_add_launch<at::BFloat16, float>(xc, b, rc, out, d);
  } else if (mixed) {
    bias_dropout_add_launch<at::Half, float>(xc, b, rc, out, d);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_t, "bias_dropout_add", [&] {
      bias_dropout_add_launch<scalar_t, scalar_t>(xc, b, rc, out, d);
    });
  }
  return out;
}

Tensor dropout_backward_cpu(const Tensor& grad, double p, const Tensor& seed) {
  cpu::DropoutArgs d = dropout_args(p, seed, "dropout_backward");
  Tensor gc = grad.contiguous();
  if (d.threshold == 0) return gc.clone();
  Tensor dx = at::empty_like(gc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "dropout_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* gp = gc.data_ptr<scalar_t>();
    scalar_t* dp = dx.data_ptr<scalar_t>();
    at::parallel_for(0, gc.numel(), 32768, [&](int64_t i0, int64_t i1) {
      cpu::dropout_bwd<scalar_t, A>(gp, dp, i0, i1, d);
    });
  });
  return dx;
}

// Flat work list over all tensors of one AdamW call, so many small parameters still fill the threads.
struct AdamWChunk {
  int64_t tensor, start, n;
};

template <typename G>
void adamw_dispatch_model(float* p, const G* g, float* m, float* v, const at::Tensor* model, int64_t off,
                          int64_t n, const AdamWScalars& s) {
  if (model == nullptr) return cpu::adamw_chunk<G, float>(p, g, m, v, nullptr, n, s);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, model->scalar_type(), "adamw_model", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>)
      cpu::adamw_chunk<G, scalar_t>(p, g, m, v, model->data_ptr<scalar_t>() + off, n, s);
    else
      TORCH_CHECK(false, "slipway::adamw_step_: float64 model params are not supported");
  });
}

void adamw_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList model_params, double lr, double beta1, double beta2,
                    double eps, double weight_decay, int64_t step, double grad_scale) {
  check_adamw(params, grads, exp_avgs, exp_avg_sqs, model_params);
  TORCH_CHECK(step >= 1, "slipway::adamw_step_: step counts from 1 (bias correction), got ", step, ".");
  const AdamWScalars s = make_adamw_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  std::vector<at::Tensor> gc(grads.size());
  std::vector<AdamWChunk> chunks;
  constexpr int64_t kChunk = 1 << 15;
  for (size_t i = 0; i < params.size(); ++i) {
    gc[i] = grads[i].contiguous();
    for (int64_t st = 0; st < params[i].numel(); st += kChunk)
      chunks.push_back({static_cast<int64_t>(i), st, std::min(kChunk, params[i].numel() - st)});
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const AdamWChunk& k = chunks[c];
      const at::Tensor* model = model_params.empty() ? nullptr : &model_params[k.tensor];
      float* p = params[k.tensor].data_ptr<float>() + k.start;
      float* m = exp_avgs[k.tensor].data_ptr<float>() + k.start;
      float* v = exp_avg_sqs[k.tensor].data_ptr<float>() + k.start;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gc[k.tensor].scalar_type(), "adamw_grad", [&] {
        if constexpr (!std::is_same_v<scalar_t, double>)
          adamw_dispatch_model<scalar_t>(p, gc[k.tensor].data_ptr<scalar_t>() + k.start, m, v, model, k.start,
                                         k.n, s);
        else
          TORCH_CHECK(false, "slipway::adamw_step_: float64 grads are not supported");
      });
    }
  });
}


}  // namespace

TORCH_LIBRARY_FRAGMENT(slipway, m) {
  m.set_python_module("trainer.ops.fused");
  m.def("bias_gelu(Tensor x, Tensor bias) -> Tensor");
  m.def("bias_gelu_backward(Tensor grad, Tensor x, Tensor bias) -> Tensor");
  m.def("bias_dropout_add(Tensor x, Tensor? bias, Tensor residual, float p, Tensor seed) -> Tensor");
  m.def("dropout_backward(Tensor grad, float p, Tensor seed) -> Tensor");
  m.def("scaled_causal_softmax(Tensor scores, float scale) -> Tensor");
  m.def("scaled_causal_softmax_backward(Tensor grad, Tensor probs, float scale) -> Tensor");
  m.def("layer_norm(Tensor x, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_backward(Tensor grad, Tensor x, Tensor weight, Tensor mean, Tensor rstd)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("ce_local_stats(Tensor logits, Tensor target, int vocab_start) -> (Tensor, Tensor, Tensor)");
  m.def("ce_local_grad(Tensor logits, Tensor target, int vocab_start, Tensor lse, Tensor grad_loss) -> Tensor");
  m.def("ce_local_grad_(Tensor(a!) logits, Tensor target, int vocab_start, Tensor lse, Tensor grad_loss) -> ()");
  m.def("adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs,"
        " Tensor(d!)[] model_params, float lr, float beta1, float beta2, float eps, float weight_decay,"
        " int step, float grad_scale) -> ()");
}

TORCH_LIBRARY_IMPL(slipway, CPU, m) {
  m.impl("bias_gelu", &bias_gelu_cpu);
  m.impl("bias_gelu_backward", &bias_gelu_backward_cpu);
  m.impl("bias_dropout_add", &bias_dropout_add_cpu);
  m.impl("dropout_backward", &dropout_backward_cpu);
  m.impl("adamw_step_", &adamw_step_cpu);
}

}  // namespace slipway
