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
#include "moe/moe_fp8.cuh"
#include "moe/moe_params.h"

namespace hpc {
namespace moe {

constexpr int kQuantWarps = 8;
constexpr int kQuantTokensPerCta = 2;
constexpr int kChunkChannels = 256;  // 32 lanes x 8 channels
// Chunks a warp loads before it converts any: the loads of one item are in
// flight together (one memory latency per item, not per chunk).
constexpr int kChunksPerItem = 4;

__device__ __forceinline__ float* input_scales(const MoeParams& p, int token) {
  return reinterpret_cast<float*>(p.workspace + p.layout.input_scale()) +
         int64_t(token) * (p.hidden / kScaleBlock);
}

// This lane's 8 channels of chunks [chunk0, chunk0 + kChunksPerItem) of a
// row (zeros past H), all loads issued before any is used.
template <typename T>
__device__ __forceinline__ void load_item(const MoeParams& p, int token,
                                          int chunk0, int lane,
                                          float (&v)[kChunksPerItem][8]) {
  const T* row = input_row<T>(p, token);
#pragma unroll
  for (int j = 0; j < kChunksPerItem; ++j) {
    const int c = (chunk0 + j) * kChunkChannels + lane * 8;
    if (c < p.hidden) {
      load8(row + c, v[j]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[j][i] = 0.f;
    }
  }
}

// Per-token dynamic scale (amax / 448) of one row, by one warp; stored for
// the GEMM and returned.
template <typename T>
__device__ float quantize_token_scale(const MoeParams& p, int token, int lane) {
  float amax = 0.f;
  for (int chunk0 = 0; chunk0 * kChunkChannels < p.hidden;
       chunk0 += kChunksPerItem) {
    float v[kChunksPerItem][8];
    load_item<T>(p, token, chunk0, lane, v);
#pragma unroll
    for (int j = 0; j < kChunksPerItem; ++j) {
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[j][i]));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  }
  const float s = dynamic_scale(amax);
  if (lane == 0) input_scales(p, token)[0] = s;
  return s;
}

// kChunksPerItem chunks of one token's row, by one warp. A lane holds 8
// channels of a chunk, so a 1 x 128 group (block-wise) is 16 lanes; `scale`
// is the scale of the per-tensor modes.
template <typename T>
__device__ void quantize_item(const MoeParams& p, int token, int chunk0,
                              float scale, int lane) {
  float v[kChunksPerItem][8];
  load_item<T>(p, token, chunk0, lane, v);
  uint8_t* q = p.workspace + p.layout.input_q() + int64_t(token) * p.hidden;
#pragma unroll
  for (int j = 0; j < kChunksPerItem; ++j) {
    const int c = (chunk0 + j) * kChunkChannels + lane * 8;
    // H % 128 == 0: a 16-lane group is all in or all out, and every lane
    // takes part in the shuffles.
    const bool active = c < p.hidden;
    float scale_j = scale;
    if (p.block_wise) {
      scale_j = group_scale16(v[j]);
      if (active && lane % 16 == 0) {
        input_scales(p, token)[c / kScaleBlock] = scale_j;
      }
    }
    if (active) store8_fp8_divided(q + c, v[j], scale_j);
  }
}

// The whole CTA quantizes tokens [first, end), end - first <=
// kQuantTokensPerCta (16-bit inputs only). Work is split into items of
// kChunksPerItem x 256 channels, so one token spreads over several warps;
// per-token dynamic scales take a pass over the rows first.
__device__ void quantize_tokens(const MoeParams& p, int first, int end) {
  __shared__ float token_scale[kQuantTokensPerCta];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  const bool bf16 = p.input_type == ElemType::kBf16;
  const bool per_token = !p.block_wise && p.a1_scale == nullptr;
  if (per_token) {
    for (int token = first + warp; token < end; token += warps) {
      const float s = bf16 ? quantize_token_scale<__nv_bfloat16>(p, token, lane)
                           : quantize_token_scale<__half>(p, token, lane);
      if (lane == 0) token_scale[token - first] = s;
    }
    __syncthreads();
  }
  const float static_scale =
      !p.block_wise && p.a1_scale != nullptr ? *p.a1_scale : 1.f;
  const int chunks = (p.hidden + kChunkChannels - 1) / kChunkChannels;
  const int items = (chunks + kChunksPerItem - 1) / kChunksPerItem;
  for (int i = warp; i < (end - first) * items; i += warps) {
    const int token = first + i / items;
    const int chunk0 = (i % items) * kChunksPerItem;
    const float s = per_token ? token_scale[token - first] : static_scale;
    if (bf16) {
      quantize_item<__nv_bfloat16>(p, token, chunk0, s, lane);
    } else {
      quantize_item<__half>(p, token, chunk0, s, lane);
    }
  }
}

// After the route, this kernel runs second in the chain: the input's
// producer (the kernel before the route) is complete when it starts, and
// the previous call's gate-up GEMM, the last reader of the quantized input,
// is long done. So the whole quantization runs before the PDL wait, beside
// the route, and is finished before the gate-up GEMM's weights flood the
// memory system behind it. With slot tiles there is no route: it runs
// first, waits first, and lets the gate-up GEMM launch at once (its CTAs
// find their tiles from the ids before their first weight copies, by when
// these loads of the input are out). Either way the trigger follows the
// wait, the chain's rule (moe_gemm_kernel.cuh).
__global__ void __launch_bounds__(kQuantWarps * 32)
    moe_quantize_kernel(const MoeParams p) {
  const bool first_stage = p.tiling.slot_tiles;
  if (first_stage) {
    pdl_wait_for_producer();
    pdl_launch_dependents();
  }
  // The grid is sized to be resident at once (launch_quantize()): a CTA
  // holds its slot until its PDL wait, after the route, so a second wave
  // would start only then.
  for (int first = blockIdx.x * kQuantTokensPerCta; first < p.num_tokens;
       first += gridDim.x * kQuantTokensPerCta) {
    quantize_tokens(p, first, min(first + kQuantTokensPerCta, p.num_tokens));
    __syncthreads();  // token_scale read before the next tokens' pass
  }
  if (!first_stage) {
    pdl_wait_for_producer();
    pdl_launch_dependents();
  }
}

}  // namespace moe
}  // namespace hpc
