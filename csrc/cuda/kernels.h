// Host-callable launchers of Slipway's CUDA kernels. Plain C++ over raw pointers, sizes and a stream:
// no torch headers, so the .cu files compile with nvcc alone (`make cuda-check`, even on CPU-only
// machines); csrc/cuda/bindings.cpp maps tensors onto these calls in CUDA builds.
// Every launcher returns cudaGetLastError() after its launches. Compute is fp32 for every storage type.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../adamw_math.h"

namespace slipway::cuda {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct DropoutParams {
  const int64_t* seed;  // device pointer to one int64 drawn with torch's generator (no host sync)
  uint32_t threshold;   // drop when dropout_bits(seed, index) < threshold (csrc/slipway_rng.h)
  float scale;          // 1 / (1 − p)
};

cudaError_t bias_gelu_fwd(DType t, const void* x, const float* bias, void* y, int64_t rows, int64_t h,
                          cudaStream_t stream);
cudaError_t bias_gelu_bwd(DType t, const void* grad, const void* x, const float* bias, void* dx, int64_t rows,
                          int64_t h, cudaStream_t stream);
// out (type `to`) = residual (type `to`) + dropout(x (type `tx`) + bias); tx == to, or tx = bf16/fp16, to = fp32.
cudaError_t bias_dropout_add_fwd(DType tx, DType to, const void* x, const float* bias, const void* residual,
                                 void* out, int64_t rows, int64_t h, DropoutParams d, cudaStream_t stream);
cudaError_t dropout_bwd(DType t, const void* grad, void* dx, int64_t n, DropoutParams d, cudaStream_t stream);

cudaError_t causal_softmax_fwd(DType t, const void* x, void* y, int64_t rows, int64_t sq, int64_t sk, float scale,
                               cudaStream_t stream);
cudaError_t causal_softmax_bwd(DType t, const void* grad, const void* y, void* dx, int64_t rows, int64_t sq,
                               int64_t sk, float scale, cudaStream_t stream);

cudaError_t layer_norm_fwd(DType t, const void* x, const float* w, const float* b, void* y, float* mean,
                           float* rstd, int64_t rows, int64_t h, float eps, cudaStream_t stream);
// Number of floats of scratch memory layer_norm_bwd needs (per-block dγ/dβ partial sums).
int64_t layer_norm_bwd_workspace(int64_t rows, int64_t h);
cudaError_t layer_norm_bwd(DType t, const void* grad, const void* x, const float* w, const float* mean,
                           const float* rstd, void* dx, float* gw, float* gb, float* workspace, int64_t rows,
                           int64_t h, cudaStream_t stream);

// logits: rows of v entries, row r at logits + r·ld (elements); target: int64 global ids.
cudaError_t ce_stats(DType t, const void* logits, int64_t ld, const int64_t* target, int64_t vocab_start,
                     float* mx, float* se, float* tl, int64_t rows, int64_t v, cudaStream_t stream);
// out (contiguous rows of v, may alias logits when ld == v) = (softmax − onehot) · grad_loss.
// out rows at stride ldo (the logits' ld when writing over them in place, v for a new contiguous tensor).
cudaError_t ce_grad(DType t, const void* logits, int64_t ld, void* out, int64_t ldo, const int64_t* target,
                    int64_t vocab_start, const float* lse, const float* grad_loss, int64_t rows, int64_t v,
                    cudaStream_t stream);

// RMSNorm: x (type tx) → y (type ty: tx, or fp32 from a bf16/fp16 x), rstd fp32, one per row.
cudaError_t rms_norm_fwd(DType tx, DType ty, const void* x, const float* w, void* y, float* rstd, int64_t rows,
                         int64_t h, float eps, cudaStream_t stream);
// Number of floats of scratch memory rms_norm_bwd needs (per-block dw partial sums).
int64_t rms_norm_bwd_workspace(int64_t rows, int64_t h);
// grad in the output's type tg (tx, or fp32 from a bf16/fp16 x), dx in tx, gw fp32 [h].
cudaError_t rms_norm_bwd(DType tx, DType tg, const void* grad, const void* x, const float* w, const float* rstd,
                         void* dx, float* gw, float* workspace, int64_t rows, int64_t h, cudaStream_t stream);

// SwiGLU on rows of 2f (gate | up) → rows of f; backward → rows of 2f.
cudaError_t swiglu_fwd(DType t, const void* x, void* y, int64_t rows, int64_t f, cudaStream_t stream);
cudaError_t swiglu_bwd(DType t, const void* grad, const void* x, void* dx, int64_t rows, int64_t f,
                       cudaStream_t stream);

// Rotary apply (rotate-half layout) on rows of d, row r at sequence position r mod s; cos/sin fp32 [s, d_rot];
// dims past d_rot are copied. transpose: the backward (the transposed rotation applied to the gradient).
cudaError_t rotary_apply(DType t, const void* x, const float* cos, const float* sin, void* out, int64_t rows,
                         int64_t s, int64_t d, int64_t d_rot, bool transpose, cudaStream_t stream);

// Multi-tensor AdamW, one launch. `meta` is a device buffer of int64 laid out as
// [params, grads, exp_avgs, exp_avg_sqs, model_params (or 0), numel] × n_tensors (pointers as int64),
// then [tensor index, start] × n_chunks. Each chunk is at most adamw_chunk_size() elements.
int64_t adamw_chunk_size();
cudaError_t adamw_step(DType grad_t, DType model_t, bool has_model, const int64_t* meta, int64_t n_tensors,
                       int64_t n_chunks, AdamWScalars s, cudaStream_t stream);

}  // namespace slipway::cuda
