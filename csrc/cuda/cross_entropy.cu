// Cross-entropy over a local vocab shard: per-row statistics in one pass (online max / sum-exp: the sum is
// rescaled whenever the running max grows, Milakov & Gimelshein 2018) and the gradient in one pass,
// optionally written over the logits. One block per row (a row is up to the whole vocab shard).
#include "common.cuh"

namespace slipway::cuda {
namespace {

constexpr int kThreads = 256;

struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__device__ __forceinline__ MaxSum block_max_sum(MaxSum v, float* red_m, float* red_s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffU, v.m, o), __shfl_xor_sync(0xffffffffU, v.s, o)};
    v = combine(v, other);
  }
  __syncthreads();
  if (lane == 0) {
    red_m[warp] = v.m;
    red_s[warp] = v.s;
  }
  __syncthreads();
  v = lane < nw ? MaxSum{red_m[lane], red_s[lane]} : MaxSum{-INFINITY, 0.0f};
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffU, v.m, o), __shfl_xor_sync(0xffffffffU, v.s, o)};
    v = combine(v, other);
  }
  return v;
}

template <typename T>
__global__ void ce_stats_kernel(const T* __restrict__ logits, int64_t ld, const int64_t* __restrict__ target,
                                int64_t vocab_start, float* __restrict__ mx, float* __restrict__ se,
                                float* __restrict__ tl, int64_t rows, int64_t v) {
  __shared__ float red_m[32], red_s[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* lr = logits + r * ld;
    MaxSum acc{-INFINITY, 0.0f};
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
      const float x = to_f(lr[j]);
      if (x > acc.m) {
        acc.s = acc.s * __expf(acc.m - x) + 1.0f;
        acc.m = x;
      } else if (acc.m > -INFINITY) {  // x = acc.m = -inf (masked entries so far) adds nothing
        acc.s += __expf(x - acc.m);
      }
    }
    acc = block_max_sum(acc, red_m, red_s);
    if (threadIdx.x == 0) {
      const int64_t t = target[r] - vocab_start;
      mx[r] = acc.m;
      se[r] = acc.s;
      tl[r] = (t >= 0 && t < v) ? to_f(lr[t]) : 0.0f;
    }
  }
}

// Each element is read and then written by the same thread, so `out` may alias `logits` (in place).
template <typename T>
__global__ void ce_grad_kernel(const T* logits, int64_t ld, T* out, int64_t ldo, const int64_t* __restrict__ target,
                               int64_t vocab_start, const float* __restrict__ lse, const float* __restrict__ gl,
                               int64_t rows, int64_t v) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* lr = logits + r * ld;
    T* orow = out + r * ldo;
    const int64_t t = target[r] - vocab_start;
    const float l = lse[r], g = gl[r];
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
      const float p = __expf(to_f(lr[j]) - l);
      orow[j] = from_f<T>((j == t ? p - 1.0f : p) * g);
    }
  }
}

unsigned row_grid(int64_t rows) { return grid_for(rows < (1 << 20) ? rows : (1 << 20)); }

}  // namespace

cudaError_t ce_stats(DType t, const void* logits, int64_t ld, const int64_t* target, int64_t vocab_start,
                     float* mx, float* se, float* tl, int64_t rows, int64_t v, cudaStream_t stream) {
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    ce_stats_kernel<T><<<row_grid(rows), kThreads, 0, stream>>>(static_cast<const T*>(logits), ld, target,
                                                                 vocab_start, mx, se, tl, rows, v);
    return cudaGetLastError();
  });
}

cudaError_t ce_grad(DType t, const void* logits, int64_t ld, void* out, int64_t ldo, const int64_t* target,
                    int64_t vocab_start, const float* lse, const float* grad_loss, int64_t rows, int64_t v,
                    cudaStream_t stream) {
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    ce_grad_kernel<T><<<row_grid(rows), kThreads, 0, stream>>>(static_cast<const T*>(logits), ld,
                                                                static_cast<T*>(out), ldo, target, vocab_start,
                                                                lse, grad_loss, rows, v);
    return cudaGetLastError();
  });
}

}  // namespace slipway::cuda
