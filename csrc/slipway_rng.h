// Counter-based dropout RNG shared by the CPU (C++) and CUDA kernels, so both devices draw the same mask
// for the same (seed, element index). Plain C++ with no torch or CUDA includes: nvcc compiles it for the
// device and g++ for the host.
//
// Why counter-based (a hash of seed and index) and not a stored mask: the backward pass regenerates the
// mask from the 8-byte seed instead of keeping a byte per activation alive between forward and backward,
// and the hash costs a few integer ops per element in a kernel that is bound by memory traffic anyway.
// The seed itself is drawn with torch's generator of the tensor's device (trainer/ops/fused.py), so the
// model-parallel RNG tracker, which forks torch's CPU/CUDA RNG state, controls the masks.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define SLIPWAY_HD __host__ __device__ __forceinline__
#else
#define SLIPWAY_HD inline
#endif

namespace slipway {

// "lowbias32" (C. Wellons' hash-prospector): a 32-bit bijection with low avalanche bias, two multiplies.
SLIPWAY_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// 32 random bits for element `idx` of a call with `seed`. Distinct indices below 2^32 map to distinct
// outputs (a composition of bijections for a fixed seed), so no two elements of a call share a draw.
SLIPWAY_HD uint32_t dropout_bits(uint64_t seed, uint64_t idx) {
  uint32_t h = mix32(static_cast<uint32_t>(idx) ^ static_cast<uint32_t>(seed));
  return mix32(h ^ static_cast<uint32_t>(seed >> 32) ^ (static_cast<uint32_t>(idx >> 32) * 0x9E3779B9U));
}

// Elements whose bits fall below the threshold are dropped: P(drop) = threshold / 2^32 = p (to 2^-32).
inline uint32_t dropout_threshold(double p) {
  double t = p * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFU : static_cast<uint32_t>(t);
}

}  // namespace slipway
