// Quantize stage of the fused FP8 MoE pipeline (16-bit inputs only): FP8
// with a static per-tensor scale, a dynamic per-token scale, or dynamic
// 1 x 128 group scales (block-wise).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/pdl.cuh"
#include "common/vec.cuh"
#include "moe/moe_params.h"

namespace hpc {
namespace moe {

constexpr int kQuantWarps = 8;

// One warp quantizes one token's row; a lane holds 8 channels of each
// 256-channel chunk, so a 1 x 128 group is 16 lanes.
template <typename T>
__device__ void quantize_token(const MoeParams& p, int token, int lane) {
  const T* row = static_cast<const T*>(p.input) + token * p.input_stride;
  uint8_t* q = p.workspace + p.layout.input_q() + int64_t(token) * p.hidden;
  float* scale =
      reinterpret_cast<float*>(p.workspace + p.layout.input_scale()) +
      int64_t(token) * (p.hidden / kScaleBlock);
  const bool per_token = !p.block_wise && p.a1_scale == nullptr;
  float inv_static = 1.f;
  if (!p.block_wise && p.a1_scale) inv_static = 1.f / *p.a1_scale;
  float inv_token = 1.f;
  if (per_token) {
    float amax = 0.f;
    for (int c = lane * 8; c < p.hidden; c += 256) {
      float v[8];
      load8(row + c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    }
    const float s = amax > 0.f ? amax / kFp8E4m3Max : 1.f;
    if (lane == 0) scale[0] = s;
    inv_token = 1.f / s;
  }
  // Whole chunks per iteration so that every lane takes part in the group
  // shuffles (H % 128 == 0: a 16-lane group is all in or all out).
  for (int base = 0; base < p.hidden; base += 256) {
    const int c = base + lane * 8;
    const bool active = c < p.hidden;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (active) load8(row + c, v);
    float inv = per_token ? inv_token : inv_static;
    if (p.block_wise) {
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
      for (int o = 8; o > 0; o /= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      }
      const float s = amax > 0.f ? amax / kFp8E4m3Max : 1.f;
      if (active && lane % 16 == 0) scale[c / kScaleBlock] = s;
      inv = 1.f / s;
    }
    if (active) store8_fp8(q + c, v, inv);
  }
}

// The warps of a CTA quantize tokens [first, end) (16-bit inputs only).
__device__ __forceinline__ void quantize_tokens(const MoeParams& p, int first,
                                                int end) {
  const int lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  for (int token = first + threadIdx.x / 32; token < end; token += warps) {
    if (p.input_type == ElemType::kBf16) {
      quantize_token<__nv_bfloat16>(p, token, lane);
    } else {
      quantize_token<__half>(p, token, lane);
    }
  }
}

__global__ void __launch_bounds__(kQuantWarps * 32)
    moe_quantize_kernel(const MoeParams p) {
  pdl_launch_dependents();
  pdl_wait_for_producer();
  const int first = blockIdx.x * kQuantWarps;
  quantize_tokens(p, first, min(first + kQuantWarps, p.num_tokens));
}

}  // namespace moe
}  // namespace hpc
