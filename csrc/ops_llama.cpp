// The Llama-style ops: RMSNorm, SwiGLU and the rotary-embedding apply. Schemas (shared by every backend)
// and CPU implementations; the CUDA ones register in csrc/cuda/bindings_llama.cpp, autograd in
// csrc/autograd.cpp, fake (meta) kernels in trainer/ops/fused.py. Eager references: trainer/ops/reference.py.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "cpu_llama.h"
#include "ops_common.h"

namespace slipway {
namespace {

using at::Tensor;

// x (storage T) → y (storage O: T, or fp32 for a bf16/fp16 x with an fp32 weight), rstd in the compute type.
template <typename T, typename O>
void rms_norm_launch(const Tensor& xc, const Tensor& w, const Tensor& y, const Tensor& rstd, double eps) {
  using A = at::opmath_type<T>;
  const int64_t h = xc.size(-1), rows = h == 0 ? 0 : xc.numel() / h;
  const T* xp = xc.data_ptr<T>();
  O* yp = y.data_ptr<O>();
  const A* wp = w.data_ptr<A>();
  A* rp = rstd.data_ptr<A>();
  at::parallel_for(0, rows, grain_rows(h), [&](int64_t r0, int64_t r1) {
    std::vector<A> buf(std::is_same_v<T, A> ? 0 : h);
    for (int64_t r = r0; r < r1; ++r)
      cpu::rms_norm_row<T, O, A>(xp + r * h, wp, yp + r * h, h, static_cast<A>(eps), buf.data(), rp + r);
  });
}

std::tuple<Tensor, Tensor> rms_norm_cpu(const Tensor& x, const Tensor& weight, double eps) {
  check_vec(x, weight, "rms_norm", "weight");
  const at::ScalarType out_t = rms_out_dtype(x, weight, "rms_norm"), acc = opmath_of(x.scalar_type());
  Tensor xc = x.contiguous(), w = weight.to(acc).contiguous();
  Tensor y = at::empty(xc.sizes(), xc.options().dtype(out_t));
  Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(acc));
  if (mixed_low_to_f32(x.scalar_type(), out_t) && x.scalar_type() == at::kBFloat16) {
    rms_norm_launch<at::BFloat16, float>(xc, w, y, rstd, eps);
  } else if (mixed_low_to_f32(x.scalar_type(), out_t)) {
    rms_norm_launch<at::Half, float>(xc, w, y, rstd, eps);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
      rms_norm_launch<scalar_t, scalar_t>(xc, w, y, rstd, eps);
    });
  }
  return {y, rstd};
}

// Each of `parts` tasks owns a contiguous block of rows and its own dw partial row (summed in task order:
// deterministic for a given thread count). The gradient's storage type G is the output's (T or fp32).
template <typename T, typename G>
void rms_norm_bwd_launch(const Tensor& gc, const Tensor& xc, const Tensor& w, const Tensor& rc, const Tensor& dx,
                         const Tensor& gw_part) {
  using A = at::opmath_type<T>;
  const int64_t h = xc.size(-1), rows = h == 0 ? 0 : xc.numel() / h, parts = gw_part.size(0);
  const G* gp = gc.data_ptr<G>();
  const T* xp = xc.data_ptr<T>();
  T* dp = dx.data_ptr<T>();
  const A *wp = w.data_ptr<A>(), *rp = rc.data_ptr<A>();
  A* gwp = gw_part.data_ptr<A>();
  at::parallel_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
    std::vector<A> buf(2 * h);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = t * rows / parts; r < (t + 1) * rows / parts; ++r)
        cpu::rms_norm_bwd_row<T, G, A>(gp + r * h, xp + r * h, wp, rp[r], dp + r * h, h, gwp + t * h, buf.data());
  });
}

std::tuple<Tensor, Tensor> rms_norm_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& weight,
                                                 const Tensor& rstd) {
  check_vec(x, weight, "rms_norm_backward", "weight");
  TORCH_CHECK(grad.sizes() == x.sizes(), "slipway::rms_norm_backward: grad must have x's shape ", x.sizes(),
              ", got ", grad.sizes(), ".");
  const at::ScalarType acc = opmath_of(x.scalar_type());
  const bool mixed = mixed_low_to_f32(x.scalar_type(), grad.scalar_type());
  Tensor gc = mixed ? grad.contiguous() : grad.to(x.scalar_type()).contiguous();
  Tensor xc = x.contiguous(), w = weight.to(acc).contiguous(), rc = rstd.to(acc).contiguous();
  const int64_t h = x.size(-1), rows = h == 0 ? 0 : xc.numel() / h;
  TORCH_CHECK(rc.numel() == rows, "slipway::rms_norm_backward: rstd must hold one value per row (", rows,
              "), got ", rc.numel(), ".");
  Tensor dx = at::empty_like(xc);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  Tensor gw_part = at::zeros({parts, h}, x.options().dtype(acc));
  if (mixed && x.scalar_type() == at::kBFloat16) {
    rms_norm_bwd_launch<at::BFloat16, float>(gc, xc, w, rc, dx, gw_part);
  } else if (mixed) {
    rms_norm_bwd_launch<at::Half, float>(gc, xc, w, rc, dx, gw_part);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_backward", [&] {
      rms_norm_bwd_launch<scalar_t, scalar_t>(gc, xc, w, rc, dx, gw_part);
    });
  }
  Tensor gw = (parts == 1 ? gw_part[0] : gw_part.sum(0)).to(weight.scalar_type());
  return {dx, gw};
}

std::vector<int64_t> halved_last(const Tensor& x) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() /= 2;
  return sizes;
}

Tensor swiglu_cpu(const Tensor& x) {
  check_swiglu(x, "swiglu");
  Tensor xc = x.contiguous();
  Tensor y = at::empty(halved_last(x), xc.options());
  const int64_t f = x.size(-1) / 2, rows = f == 0 ? 0 : xc.numel() / (2 * f);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "swiglu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(2 * f), [&](int64_t r0, int64_t r1) {
      cpu::swiglu_fwd<scalar_t, A>(xp + r0 * 2 * f, yp + r0 * f, r1 - r0, f);
    });
  });
  return y;
}

Tensor swiglu_backward_cpu(const Tensor& grad, const Tensor& x) {
  check_swiglu(x, "swiglu_backward");
  TORCH_CHECK(grad.sizes() == at::IntArrayRef(halved_last(x)) && grad.scalar_type() == x.scalar_type(),
              "slipway::swiglu_backward: grad must be x's dtype and shape with the last dim halved; got ",
              grad.sizes(), " ", grad.scalar_type(), " for x ", x.sizes(), " ", x.scalar_type(), ".");
  Tensor xc = x.contiguous(), gc = grad.contiguous();
  Tensor dx = at::empty_like(xc);
  const int64_t f = x.size(-1) / 2, rows = f == 0 ? 0 : xc.numel() / (2 * f);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "swiglu_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t *xp = xc.data_ptr<scalar_t>(), *gp = gc.data_ptr<scalar_t>();
    scalar_t* dp = dx.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(2 * f), [&](int64_t r0, int64_t r1) {
      cpu::swiglu_bwd<scalar_t, A>(gp + r0 * f, xp + r0 * 2 * f, dp + r0 * 2 * f, r1 - r0, f);
    });
  });
  return dx;
}

// Walks rows [r0, ...) of x [..., s, d] (any strides of the leading dims, unit stride along d): an odometer
// over the leading dims gives each row's element offset and sequence position without a division per
// row. Attention hands rotary q/k as [b, s, heads, d].transpose(1, 2), so reading them where they lie saves
// the copy .contiguous() would make (~30 % of the op on CPU).
struct RowWalker {
  static constexpr int kMaxDims = 8;
  int n;  // leading dims, the last of them the sequence
  int64_t size[kMaxDims], stride[kMaxDims], idx[kMaxDims], off = 0;

  RowWalker(const Tensor& x, int64_t r0) : n(static_cast<int>(x.dim()) - 1) {
    for (int k = n - 1; k >= 0; --k) {
      size[k] = x.size(k);
      stride[k] = x.stride(k);
      idx[k] = r0 % size[k];
      r0 /= size[k];
      off += idx[k] * stride[k];
    }
  }
  int64_t position() const { return idx[n - 1]; }
  void next() {
    for (int k = n - 1; k >= 0; --k) {
      off += stride[k];
      if (++idx[k] < size[k]) return;
      off -= size[k] * stride[k];
      idx[k] = 0;
    }
  }
};

// Forward (kTranspose = false) or backward (true: the transposed rotation of grad) of the rotary apply;
// the output is contiguous.
template <bool kTranspose>
Tensor rotary_apply(const Tensor& x, const Tensor& cos, const Tensor& sin, const char* op) {
  const int64_t d_rot = check_rotary(x, cos, sin, op);
  const at::ScalarType acc = opmath_of(x.scalar_type());
  const bool walkable = (x.stride(-1) == 1 || x.size(-1) <= 1) && x.dim() - 1 <= RowWalker::kMaxDims;
  Tensor xs = walkable ? x : x.contiguous(), c = cos.to(acc).contiguous(), s = sin.to(acc).contiguous();
  Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t d = x.size(-1), rows = d == 0 ? 0 : x.numel() / d;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* xp = xs.data_ptr<scalar_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    const A *cp = c.data_ptr<A>(), *sp = s.data_ptr<A>();
    at::parallel_for(0, rows, grain_rows(d), [&](int64_t r0, int64_t r1) {
      RowWalker w(xs, r0);
      for (int64_t r = r0; r < r1; ++r, w.next()) {
        const int64_t p = w.position();
        cpu::rotary_row<scalar_t, A, kTranspose>(xp + w.off, cp + p * d_rot, sp + p * d_rot, op_ + r * d,
                                                 d_rot / 2, d);
      }
    });
  });
  return out;
}

Tensor rotary_cpu(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return rotary_apply<false>(x, cos, sin, "rotary");
}

Tensor rotary_backward_cpu(const Tensor& grad, const Tensor& cos, const Tensor& sin) {
  return rotary_apply<true>(grad, cos, sin, "rotary_backward");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slipway, m) {
  m.set_python_module("trainer.ops.fused");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
  m.def("swiglu(Tensor x) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor x) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rotary_backward(Tensor grad, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(slipway, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
  m.impl("rotary", &rotary_cpu);
  m.impl("rotary_backward", &rotary_backward_cpu);
}

}  // namespace slipway
