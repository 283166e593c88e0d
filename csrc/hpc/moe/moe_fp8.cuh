// FP8 rounding and dynamic scales of the pipeline's activations, shared by
// the quantize stage, the grouped GEMM's epilogue and the decode path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/vec.cuh"
#include "moe/moe_params.h"

namespace hpc {
namespace moe {

// The dynamic scale of values whose largest magnitude is `amax`; an
// all-zero row or group keeps scale 1.
__device__ __forceinline__ float dynamic_scale(float amax) {
  return amax > 0.f ? amax / kFp8E4m3Max : 1.f;
}

// The 1 x 128 group scale when 16 lanes hold 8 channels each of one group
// (lanes 16 apart: another group). Every lane of the warp must call it.
__device__ __forceinline__ float group_scale16(const float (&v)[8]) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int o = 8; o > 0; o /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  }
  return dynamic_scale(amax);
}

// x / d rounded to nearest, for a normal d and r = 1 / d rounded to nearest:
// x * r corrected by one FMA (Markstein), which is exact wherever the
// quotient is normal; subnormal quotients round to FP8 zero either way.
// __fdiv_rn branches to a slow path for zero and tiny dividends, which the
// padded token columns of a GEMM tile are full of.
__device__ __forceinline__ float divide_rn(float x, float d, float r) {
  const float q = x * r;
  return fmaf(fmaf(-q, d, x), r, q);
}

// Rounds x / scale to E4M3 (saturating), 8 values to 8 bytes. The quotient
// is correctly rounded (divide_rn), not a bare product with 1 / scale: bf16
// inputs often divide to an exact rounding tie, which the reciprocal's
// rounding error would tip.
__device__ __forceinline__ void store8_fp8_divided(uint8_t* dst, float (&v)[8],
                                                   float scale) {
  const float rcp = __frcp_rn(scale);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = divide_rn(v[i], scale, rcp);
  store8_fp8(dst, v, 1.f);
}

template <typename T>
__device__ __forceinline__ const T* input_row(const MoeParams& p, int token) {
  return static_cast<const T*>(p.input) + int64_t(token) * p.input_stride;
}

}  // namespace moe
}  // namespace hpc
