// Multi-tensor AdamW: one launch updates every tensor of a parameter group. Block b handles chunk b of a
// chunk table built by the host binding (tensor index, start); per-tensor pointers live in the same
// device buffer. The math is torch.optim.AdamW's, with IEEE intrinsics so --use_fast_math does not
// approximate the division and square root.
#include "common.cuh"

namespace slipway::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kChunk = 1 << 16;
constexpr int kFields = 6;  // params, grads, exp_avgs, exp_avg_sqs, model_params, numel

template <typename G, typename M, bool kModel>
__global__ void adamw_kernel(const int64_t* __restrict__ meta, int64_t n_tensors, AdamWScalars s) {
  const int64_t* chunks = meta + kFields * n_tensors;
  const int64_t tensor = chunks[2 * blockIdx.x], start = chunks[2 * blockIdx.x + 1];
  const int64_t* f = meta + kFields * tensor;
  float* p = reinterpret_cast<float*>(f[0]);
  const G* g = reinterpret_cast<const G*>(f[1]);
  float* m = reinterpret_cast<float*>(f[2]);
  float* v = reinterpret_cast<float*>(f[3]);
  M* model = reinterpret_cast<M*>(f[4]);
  const int64_t end = start + kChunk < f[5] ? start + kChunk : f[5];
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    const float gi = __fmul_rn(to_f(g[i]), s.grad_scale);
    float pi = __fmul_rn(p[i], s.decay);
    const float mi = __fmaf_rn(s.one_minus_b1, __fsub_rn(gi, m[i]), m[i]);
    const float vi = __fmaf_rn(__fmul_rn(s.one_minus_b2, gi), gi, __fmul_rn(v[i], s.beta2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
    pi = __fadd_rn(pi, __fdiv_rn(__fmul_rn(s.neg_step_size, mi), denom));
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (kModel) model[i] = from_f<M>(pi);
  }
}

template <typename G>
cudaError_t launch_for_grad(DType model_t, bool has_model, const int64_t* meta, int64_t n_tensors,
                            int64_t n_chunks, AdamWScalars s, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(n_chunks);
  if (!has_model) {
    adamw_kernel<G, float, false><<<grid, kThreads, 0, stream>>>(meta, n_tensors, s);
    return cudaGetLastError();
  }
  return dispatch(model_t, [&](auto* tag) {
    using M = std::remove_pointer_t<decltype(tag)>;
    adamw_kernel<G, M, true><<<grid, kThreads, 0, stream>>>(meta, n_tensors, s);
    return cudaGetLastError();
  });
}

}  // namespace

int64_t adamw_chunk_size() { return kChunk; }

cudaError_t adamw_step(DType grad_t, DType model_t, bool has_model, const int64_t* meta, int64_t n_tensors,
                       int64_t n_chunks, AdamWScalars s, cudaStream_t stream) {
  if (n_chunks == 0) return cudaSuccess;
  if (n_chunks > 0x7fffffffLL) return cudaErrorInvalidValue;
  return dispatch(grad_t, [&](auto* tag) {
    using G = std::remove_pointer_t<decltype(tag)>;
    return launch_for_grad<G>(model_t, has_model, meta, n_tensors, n_chunks, s, stream);
  });
}

}  // namespace slipway::cuda
