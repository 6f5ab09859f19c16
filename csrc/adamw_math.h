// Scalars of one AdamW step, shared by the CPU loop, the CUDA kernel and its binding (plain C++: no torch,
// no CUDA includes). Computed in double exactly as torch.optim.AdamW's single-tensor path does, then
// rounded to float where torch rounds a Python scalar to the fp32 tensor's dtype.
#pragma once
#include <cmath>
#include <cstdint>

namespace slipway {

struct AdamWScalars {
  float decay;          // 1 − lr·weight_decay   (decoupled weight decay, applied to the weight first)
  float one_minus_b1;   // lerp weight of exp_avg towards the gradient
  float beta2;
  float one_minus_b2;
  float bc2_sqrt;       // sqrt(1 − beta2^step)
  float eps;
  float neg_step_size;  // −lr / (1 − beta1^step)
  float grad_scale;     // multiplies gradients first (1 unless the caller unscales fp16 grads here)
};

inline AdamWScalars make_adamw_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                                       int64_t step, double grad_scale) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.one_minus_b1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_b2 = static_cast<float>(1.0 - beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bc1));
  s.grad_scale = static_cast<float>(grad_scale);
  return s;
}

}  // namespace slipway
