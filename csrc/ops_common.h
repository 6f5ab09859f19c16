// Argument checks and small helpers shared by the CPU op wrappers (ops.cpp, ops_rows.cpp).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>

namespace slipway {

// Rows per parallel task: about 32K elements, so small tensors run on one thread without overhead.
inline int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

// Compute (and statistics) dtype: fp32 for fp32/bf16/fp16 inputs, fp64 for fp64 (gradcheck).
inline at::ScalarType opmath_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_vec(const at::Tensor& x, const at::Tensor& v, const char* op, const char* what) {
  TORCH_CHECK(x.dim() >= 1 && v.dim() == 1 && v.numel() == x.size(-1), "slipway::", op, ": ", what,
              " must be 1-D with x.size(-1) = ", x.dim() >= 1 ? x.size(-1) : -1, " elements, got shape ",
              v.sizes(), ". Fix: pass a [hidden] vector matching the last dim of x.");
}

// The in-place loss gradient overwrites the logits row by row: they need unit stride along the vocabulary
// and one row stride (contiguous logits, or a [..., :V] slice of vocabulary-padded ones).
inline void check_rows_in_place(const at::Tensor& logits, const char* op) {
  bool ok = logits.dim() >= 1 && (logits.size(-1) <= 1 || logits.stride(-1) == 1);
  for (int64_t d = 0; ok && d + 2 < logits.dim(); ++d)
    ok = logits.size(d + 1) <= 1 || logits.stride(d) == logits.stride(d + 1) * logits.size(d + 1);
  TORCH_CHECK(ok, "slipway::", op, ": logits must have unit stride along the vocabulary and one row stride to "
              "be overwritten in place (contiguous, or a [..., :V] slice of padded logits); got strides ",
              logits.strides(), ". Fix: call .contiguous() first or use ce_local_grad.");
}

inline void check_same(const at::Tensor& a, const at::Tensor& b, const char* op, const char* what) {
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(), "slipway::", op, ": ", what,
              " must match the input in shape and dtype; got ", b.sizes(), " ", b.scalar_type(), " vs ",
              a.sizes(), " ", a.scalar_type(), ".");
}

inline void check_scores(const at::Tensor& s, const char* op) {
  TORCH_CHECK(s.dim() >= 2, "slipway::", op, ": scores must be [..., sq, sk], got shape ", s.sizes(), ".");
}

// Number of visible keys of row r of [..., sq, sk] scores: query i = r mod sq sees keys j <= i + sk − sq.
inline int64_t causal_len(int64_t r, int64_t sq, int64_t sk) {
  return std::min<int64_t>(sk, std::max<int64_t>(0, r % sq + (sk - sq) + 1));
}

// Cross-entropy arguments: logits [..., v], target [...] (int64), per-row fp32 tensors shaped like target.
inline void check_ce(const at::Tensor& logits, const at::Tensor& target, const char* op) {
  TORCH_CHECK(logits.dim() >= 1 && target.sizes() == logits.sizes().slice(0, logits.dim() - 1), "slipway::", op,
              ": target must have the shape of logits without its last (vocab) dim; got logits ", logits.sizes(),
              " and target ", target.sizes(), ".");
  TORCH_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt, "slipway::", op,
              ": target must be int64 or int32, got ", target.scalar_type(), ".");
}

inline void check_rowvec(const at::Tensor& target, const at::Tensor& v, const char* op, const char* what) {
  TORCH_CHECK(v.sizes() == target.sizes(), "slipway::", op, ": ", what, " must have target's shape ",
              target.sizes(), ", got ", v.sizes(), ".");
}

inline void check_adamw(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList model_params) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                  (model_params.empty() || model_params.size() == n),
              "slipway::adamw_step_: params, grads, exp_avgs, exp_avg_sqs (and model_params when given) must be "
              "lists of the same length; got ", n, ", ", grads.size(), ", ", exp_avgs.size(), ", ",
              exp_avg_sqs.size(), ", ", model_params.size(), ".");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    bool ok = p.scalar_type() == at::kFloat && p.is_contiguous() && exp_avgs[i].scalar_type() == at::kFloat &&
              exp_avgs[i].is_contiguous() && exp_avg_sqs[i].scalar_type() == at::kFloat &&
              exp_avg_sqs[i].is_contiguous() && exp_avgs[i].numel() == p.numel() &&
              exp_avg_sqs[i].numel() == p.numel() && grads[i].numel() == p.numel();
    TORCH_CHECK(ok, "slipway::adamw_step_: tensor ", i, " (shape ", p.sizes(), "): the fp32 master weight and its "
                "exp_avg/exp_avg_sq must be contiguous float32 of the same size as its grad. Fix: keep optimizer "
                "state in fp32 (trainer.ops.adamw.FusedAdamW does).");
    TORCH_CHECK(model_params.empty() || (model_params[i].numel() == p.numel() && model_params[i].is_contiguous()),
                "slipway::adamw_step_: model_params[", i, "] must be contiguous with ", p.numel(), " elements.");
  }
}

// RMSNorm's output dtype is eager's promotion of x and weight; the kernels store it either in x's dtype or
// in fp32 from a bf16/fp16 x (an fp32 weight under autocast). True for the second ("mixed") case.
inline bool mixed_low_to_f32(at::ScalarType x, at::ScalarType out) {
  return x != out && out == at::kFloat && (x == at::kBFloat16 || x == at::kHalf);
}

inline at::ScalarType rms_out_dtype(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  const at::ScalarType out = at::promote_types(x.scalar_type(), weight.scalar_type());
  TORCH_CHECK(out == x.scalar_type() || mixed_low_to_f32(x.scalar_type(), out), "slipway::", op, ": x ",
              x.scalar_type(), " with weight ", weight.scalar_type(), " promotes to ", out, ", which the kernel "
              "does not produce. Fix: pass a weight of x's dtype or fp32 (x bf16/fp16).");
  return out;
}

// SwiGLU input: [..., 2f], gate then up along the last dim.
inline void check_swiglu(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "slipway::", op, ": x must be [..., 2·ffn] (gate | up), got "
              "shape ", x.sizes(), ". Fix: the first MLP matmul must produce both halves.");
}

// Rotary arguments: x [..., s, d]; cos, sin [s, d_rot] (leading size-1 dims allowed), d_rot even and ≤ d.
// Returns d_rot.
inline int64_t check_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const char* op) {
  TORCH_CHECK(x.dim() >= 2, "slipway::", op, ": x must be [..., s, d], got shape ", x.sizes(), ".");
  bool ok = cos.dim() >= 2 && cos.sizes() == sin.sizes() && cos.size(-2) == x.size(-2) &&
            cos.size(-1) % 2 == 0 && cos.size(-1) <= x.size(-1) && cos.numel() == cos.size(-2) * cos.size(-1);
  TORCH_CHECK(ok, "slipway::", op, ": cos and sin must both be [s, d_rot] with s = x.size(-2) = ", x.size(-2),
              " and an even d_rot <= x.size(-1) = ", x.size(-1), "; got ", cos.sizes(), " and ", sin.sizes(),
              ". Fix: slice the tables to the sequence (cos[:s]).");
  return cos.size(-1);
}

}  // namespace slipway
