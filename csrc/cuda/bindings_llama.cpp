// CUDA implementations of the Llama-style ops (rms_norm, swiglu, rotary and their backwards): tensors →
// raw pointers, sizes and the current stream, then the launchers of rms_norm.cu and llama_pointwise.cu.
// Compiled only in CUDA builds (setup.py); schemas and the CPU versions are in csrc/ops_llama.cpp, the
// argument checks shared with them in csrc/ops_common.h.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "../ops_common.h"
#include "bindings_common.h"
#include "kernels.h"

namespace slipway {
namespace {

using at::Tensor;
using cuda::check_launch;
using cuda::dtype_of;
using cuda::f32;
using cuda::rows_of;
using cuda::stream_of;

std::tuple<Tensor, Tensor> rms_norm_cuda(const Tensor& x, const Tensor& weight, double eps) {
  check_vec(x, weight, "rms_norm", "weight");
  const at::ScalarType out_t = rms_out_dtype(x, weight, "rms_norm");
  c10::cuda::CUDAGuard guard(x.device());
  Tensor xc = x.contiguous(), w = f32(weight);
  Tensor y = at::empty(xc.sizes(), xc.options().dtype(out_t));
  const int64_t h = x.size(-1);
  Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  check_launch(cuda::rms_norm_fwd(dtype_of(x.scalar_type(), "rms_norm"), dtype_of(out_t, "rms_norm"), xc.data_ptr(),
                                  w.data_ptr<float>(), y.data_ptr(), rstd.data_ptr<float>(), rows_of(xc, h), h,
                                  static_cast<float>(eps), stream_of(x)), "rms_norm");
  return {y, rstd};
}

std::tuple<Tensor, Tensor> rms_norm_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& weight,
                                                  const Tensor& rstd) {
  check_vec(x, weight, "rms_norm_backward", "weight");
  TORCH_CHECK(grad.sizes() == x.sizes(), "slipway::rms_norm_backward: grad must have x's shape ", x.sizes(),
              ", got ", grad.sizes(), ".");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t h = x.size(-1), rows = rows_of(x, h);
  const bool mixed = mixed_low_to_f32(x.scalar_type(), grad.scalar_type());
  Tensor gc = mixed ? grad.contiguous() : grad.to(x.scalar_type()).contiguous();
  Tensor xc = x.contiguous(), w = f32(weight), rc = f32(rstd);
  TORCH_CHECK(rc.numel() == rows, "slipway::rms_norm_backward: rstd must hold one value per row (", rows, "), got ",
              rc.numel(), ".");
  Tensor dx = at::empty_like(xc), gw = at::empty({h}, x.options().dtype(at::kFloat));
  Tensor ws = at::empty({cuda::rms_norm_bwd_workspace(rows, h)}, x.options().dtype(at::kFloat));
  check_launch(cuda::rms_norm_bwd(dtype_of(x.scalar_type(), "rms_norm_backward"),
                                  dtype_of(gc.scalar_type(), "rms_norm_backward"), gc.data_ptr(), xc.data_ptr(),
                                  w.data_ptr<float>(), rc.data_ptr<float>(), dx.data_ptr(), gw.data_ptr<float>(),
                                  ws.data_ptr<float>(), rows, h, stream_of(x)), "rms_norm_backward");
  return {dx, gw.to(weight.scalar_type())};
}

std::vector<int64_t> halved_last(const Tensor& x) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() /= 2;
  return sizes;
}

Tensor swiglu_cuda(const Tensor& x) {
  check_swiglu(x, "swiglu");
  c10::cuda::CUDAGuard guard(x.device());
  Tensor xc = x.contiguous(), y = at::empty(halved_last(x), xc.options());
  const int64_t f = x.size(-1) / 2;
  check_launch(cuda::swiglu_fwd(dtype_of(x.scalar_type(), "swiglu"), xc.data_ptr(), y.data_ptr(),
                                rows_of(xc, 2 * f), f, stream_of(x)), "swiglu");
  return y;
}

Tensor swiglu_backward_cuda(const Tensor& grad, const Tensor& x) {
  check_swiglu(x, "swiglu_backward");
  TORCH_CHECK(grad.sizes() == at::IntArrayRef(halved_last(x)) && grad.scalar_type() == x.scalar_type(),
              "slipway::swiglu_backward: grad must be x's dtype and shape with the last dim halved; got ",
              grad.sizes(), " ", grad.scalar_type(), " for x ", x.sizes(), " ", x.scalar_type(), ".");
  c10::cuda::CUDAGuard guard(x.device());
  Tensor xc = x.contiguous(), gc = grad.contiguous(), dx = at::empty_like(xc);
  const int64_t f = x.size(-1) / 2;
  check_launch(cuda::swiglu_bwd(dtype_of(x.scalar_type(), "swiglu_backward"), gc.data_ptr(), xc.data_ptr(),
                                dx.data_ptr(), rows_of(xc, 2 * f), f, stream_of(x)), "swiglu_backward");
  return dx;
}

Tensor rotary_apply_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose, const char* op) {
  const int64_t d_rot = check_rotary(x, cos, sin, op);
  c10::cuda::CUDAGuard guard(x.device());
  Tensor xc = x.contiguous(), c = f32(cos), s = f32(sin), out = at::empty_like(xc);
  const int64_t d = x.size(-1);
  check_launch(cuda::rotary_apply(dtype_of(x.scalar_type(), op), xc.data_ptr(), c.data_ptr<float>(),
                                  s.data_ptr<float>(), out.data_ptr(), rows_of(xc, d), x.size(-2), d, d_rot,
                                  transpose, stream_of(x)), op);
  return out;
}

Tensor rotary_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return rotary_apply_cuda(x, cos, sin, false, "rotary");
}

Tensor rotary_backward_cuda(const Tensor& grad, const Tensor& cos, const Tensor& sin) {
  return rotary_apply_cuda(grad, cos, sin, true, "rotary_backward");
}

}  // namespace

TORCH_LIBRARY_IMPL(slipway, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("rms_norm_backward", &rms_norm_backward_cuda);
  m.impl("swiglu", &swiglu_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
  m.impl("rotary", &rotary_cuda);
  m.impl("rotary_backward", &rotary_backward_cuda);
}

}  // namespace slipway
