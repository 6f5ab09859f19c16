// Autograd kernels of the model's fused ops (bias_gelu, bias_dropout_add, scaled_causal_softmax,
// layer_norm, and the Llama-style rms_norm, swiglu, rotary), registered at the Autograd dispatch key so they serve CPU and CUDA alike.
//
// Why C++ and not torch.library.register_autograd in Python: the Python route costs ~25 us of interpreter
// time per op call (forward + backward), which is a third of a LayerNorm over 1024×768 on a CPU and
// competes with kernel launches on a GPU. Each Function only redispatches to the registered ops (forward
// below autograd, backward through the *_backward ops), which keeps them traceable by torch.compile:
// AOTAutograd runs these kernels on fake tensors and reaches the fake kernels of trainer/ops/fused.py.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace slipway {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// Σ over all rows of the gradient of (x + bias), accumulated in fp32, returned in bias's dtype.
Tensor bias_grad(const Tensor& grad_x, const Tensor& bias) {
  const at::ScalarType acc = grad_x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // Symbolic sizes: torch.compile traces this with dynamic shapes.
  return grad_x.reshape_symint({-1, bias.sym_numel()}).sum(0, /*keepdim=*/false, acc).to(bias.scalar_type());
}

class BiasGelu : public torch::autograd::Function<BiasGelu> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<Tensor(const Tensor&, const Tensor&)>("slipway::bias_gelu");
    ctx->save_for_backward({x, bias});
    return fwd.call(x, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("slipway::bias_gelu_backward");
    const auto saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    Tensor gx = bwd.call(grads[0].to(x.scalar_type()), x, saved[1]);
    Tensor gb = ctx->needs_input_grad(1) ? bias_grad(gx, saved[1]) : Tensor();
    return {gx, gb};
  }
};

class BiasDropoutAdd : public torch::autograd::Function<BiasDropoutAdd> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& bias,
                        const Tensor& residual, double p, const Tensor& seed) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<Tensor(const Tensor&, const std::optional<Tensor>&, const Tensor&, double, const Tensor&)>(
        "slipway::bias_dropout_add");
    ctx->save_for_backward({seed, bias.has_value() ? *bias : Tensor()});
    ctx->saved_data["p"] = p;
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["residual_dtype"] = residual.scalar_type();
    return fwd.call(x, bias, residual, p, seed);
  }
  // The mask is regenerated from the saved seed (csrc/slipway_rng.h), not stored.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<Tensor(const Tensor&, double, const Tensor&)>("slipway::dropout_backward");
    const auto saved = ctx->get_saved_variables();
    const Tensor& bias = saved[1];
    Tensor g_in = bwd.call(grads[0], ctx->saved_data["p"].toDouble(), saved[0]);  // d(x + bias), out dtype
    Tensor gb = bias.defined() && ctx->needs_input_grad(1) ? bias_grad(g_in, bias) : Tensor();
    Tensor gx = ctx->needs_input_grad(0) ? g_in.to(ctx->saved_data["x_dtype"].toScalarType()) : Tensor();
    Tensor gr = ctx->needs_input_grad(2) ? grads[0].to(ctx->saved_data["residual_dtype"].toScalarType()) : Tensor();
    return {gx, gb, gr, Tensor(), Tensor()};
  }
};

class ScaledCausalSoftmax : public torch::autograd::Function<ScaledCausalSoftmax> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& scores, double scale) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<Tensor(const Tensor&, double)>("slipway::scaled_causal_softmax");
    Tensor probs = fwd.call(scores, scale);
    ctx->save_for_backward({probs});
    ctx->saved_data["scale"] = scale;
    return probs;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<Tensor(const Tensor&, const Tensor&, double)>("slipway::scaled_causal_softmax_backward");
    const Tensor probs = ctx->get_saved_variables()[0];
    return {bwd.call(grads[0].to(probs.scalar_type()), probs, ctx->saved_data["scale"].toDouble()), Tensor()};
  }
};

using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;

class LayerNorm : public torch::autograd::Function<LayerNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& bias,
                               double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<Tensor3(const Tensor&, const Tensor&, const Tensor&, double)>("slipway::layer_norm");
    auto [y, mean, rstd] = fwd.call(x, weight, bias, eps);
    ctx->save_for_backward({x, weight, mean, rstd});
    ctx->mark_non_differentiable({mean, rstd});
    return {y, mean, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>(
        "slipway::layer_norm_backward");
    const auto s = ctx->get_saved_variables();
    auto [gx, gw, gb] = bwd.call(grads[0].to(s[0].scalar_type()), s[0], s[1], s[2], s[3]);
    return {gx, gw, gb, Tensor()};
  }
};

using Tensor2 = std::tuple<Tensor, Tensor>;

class RmsNorm : public torch::autograd::Function<RmsNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<Tensor2(const Tensor&, const Tensor&, double)>("slipway::rms_norm");
    auto [y, rstd] = fwd.call(x, weight, eps);
    ctx->save_for_backward({x, weight, rstd});
    ctx->mark_non_differentiable({rstd});
    return {y, rstd};
  }
  // grads[0] arrives in the output's dtype (fp32 for a bf16 x with an fp32 weight); the kernel reads it as is.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<Tensor2(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>(
        "slipway::rms_norm_backward");
    const auto s = ctx->get_saved_variables();
    auto [gx, gw] = bwd.call(grads[0], s[0], s[1], s[2]);
    return {gx, gw, Tensor()};
  }
};

class Swiglu : public torch::autograd::Function<Swiglu> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<Tensor(const Tensor&)>("slipway::swiglu");
    ctx->save_for_backward({x});
    return fwd.call(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<Tensor(const Tensor&, const Tensor&)>("slipway::swiglu_backward");
    const Tensor x = ctx->get_saved_variables()[0];
    return {bwd.call(grads[0].to(x.scalar_type()), x)};
  }
};

// cos and sin are the position tables (buffers, not parameters): no gradient flows to them.
class Rotary : public torch::autograd::Function<Rotary> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("slipway::rotary");
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["x_dtype"] = x.scalar_type();
    return fwd.call(x, cos, sin);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("slipway::rotary_backward");
    const auto s = ctx->get_saved_variables();
    const at::ScalarType xt = ctx->saved_data["x_dtype"].toScalarType();
    return {bwd.call(grads[0].to(xt), s[0], s[1]), Tensor(), Tensor()};
  }
};

Tensor bias_gelu_autograd(const Tensor& x, const Tensor& bias) { return BiasGelu::apply(x, bias); }

Tensor bias_dropout_add_autograd(const Tensor& x, const std::optional<Tensor>& bias, const Tensor& residual,
                                 double p, const Tensor& seed) {
  return BiasDropoutAdd::apply(x, bias, residual, p, seed);
}

Tensor scaled_causal_softmax_autograd(const Tensor& scores, double scale) {
  return ScaledCausalSoftmax::apply(scores, scale);
}

Tensor3 layer_norm_autograd(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  auto out = LayerNorm::apply(x, weight, bias, eps);
  return {out[0], out[1], out[2]};
}

Tensor2 rms_norm_autograd(const Tensor& x, const Tensor& weight, double eps) {
  auto out = RmsNorm::apply(x, weight, eps);
  return {out[0], out[1]};
}

Tensor swiglu_autograd(const Tensor& x) { return Swiglu::apply(x); }

Tensor rotary_autograd(const Tensor& x, const Tensor& cos, const Tensor& sin) { return Rotary::apply(x, cos, sin); }

}  // namespace

TORCH_LIBRARY_IMPL(slipway, Autograd, m) {
  m.impl("bias_gelu", &bias_gelu_autograd);
  m.impl("bias_dropout_add", &bias_dropout_add_autograd);
  m.impl("scaled_causal_softmax", &scaled_causal_softmax_autograd);
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("swiglu", &swiglu_autograd);
  m.impl("rotary", &rotary_autograd);
}

}  // namespace slipway
