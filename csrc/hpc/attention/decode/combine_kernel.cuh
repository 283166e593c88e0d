// Device code of the split-KV combine: merges the fp32 pieces of every split
// unit into the output, each lane summing its columns in piece order (so the
// result does not depend on scheduling). Units that were not split were
// written by the decode kernel and are skipped; units with no KV at all
// (zero pieces) get zeros.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode/decode_params.h"
#include "common/pdl.cuh"

namespace hpc {
namespace decode {

constexpr int kCombineThreads = 256;
constexpr int kPiecesInFlight = 16;

__device__ __forceinline__ void store4(void* out, ElemType type, float4 v) {
  if (type == ElemType::kBf16) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y);
    __nv_bfloat162 hi = __floats2bfloat162_rn(v.z, v.w);
    *reinterpret_cast<uint2*>(out) = make_uint2(
        *reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
  } else {
    __half2 lo = __floats2half2_rn(v.x, v.y);
    __half2 hi = __floats2half2_rn(v.z, v.w);
    *reinterpret_cast<uint2*>(out) = make_uint2(
        *reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
  }
}

// One warp per (split unit, row): lanes read 32 pieces' LSEs at a time and
// broadcast the weights, so each lane keeps 32 independent partial-row
// loads in flight instead of walking the pieces one by one.
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const __grid_constant__ DecodeParams p, int head_dim) {
  pdl_launch_dependents();
  pdl_wait_for_producer();  // the decode kernel's partials
  constexpr int kWarps = kCombineThreads / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int num_units = p.plan[kNumUnits];
  const int32_t* num_pieces = p.plan + p.layout.unit_num_pieces();
  const int32_t* first_partial = p.plan + p.layout.unit_first_partial();
  const int quads = head_dim / 4;
  for (int unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
    const int pieces = num_pieces[unit];
    if (pieces == 1) continue;
    const int b = unit % p.batch;
    const int h = unit / p.batch;
    const int first = first_partial[unit];
    for (int row = warp; row < p.rows; row += kWarps) {
      const float* lse =
          p.partial_lse + static_cast<int64_t>(first) * p.rows + row;
      float lse_max = -INFINITY;
      for (int i = lane; i < pieces; i += 32) {
        lse_max = fmaxf(lse_max, lse[static_cast<int64_t>(i) * p.rows]);
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, offset));
      }
      const float ref = lse_max == -INFINITY ? 0.f : lse_max;
      float sum = 0.f;
      for (int i = lane; i < pieces; i += 32) {
        sum += exp2f(lse[static_cast<int64_t>(i) * p.rows] - ref);
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      }
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int t = row / p.group;
      const int head = h * p.group + row % p.group;
      uint16_t* out =
          static_cast<uint16_t*>(p.out) +
          static_cast<int64_t>(b * p.query_tokens + t) * p.out_token_stride +
          static_cast<int64_t>(head) * p.out_head_stride;
      for (int q0 = 0; q0 < quads; q0 += 32) {
        const int quad = q0 + lane;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int c = 0; c < pieces; c += 32) {
          const float w_lane =
              c + lane < pieces
                  ? exp2f(lse[static_cast<int64_t>(c + lane) * p.rows] - ref) *
                        inv
                  : 0.f;
          const int n = min(32, pieces - c);
          for (int k0 = 0; k0 < n; k0 += kPiecesInFlight) {
            // Issue all loads of the batch before the first use.
            float4 v[kPiecesInFlight];
#pragma unroll
            for (int k = 0; k < kPiecesInFlight; ++k) {
              v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
              if (k0 + k < n && quad < quads) {
                v[k] = *reinterpret_cast<const float4*>(
                    p.partial_out +
                    (static_cast<int64_t>(first + c + k0 + k) * p.rows + row) *
                        head_dim +
                    4 * quad);
              }
            }
#pragma unroll
            for (int k = 0; k < kPiecesInFlight; ++k) {
              const float w = __shfl_sync(0xffffffffu, w_lane, (k0 + k) & 31);
              acc.x += w * v[k].x;
              acc.y += w * v[k].y;
              acc.z += w * v[k].z;
              acc.w += w * v[k].w;
            }
          }
        }
        if (quad < quads) store4(out + 4 * quad, p.out_type, acc);
      }
    }
  }
}

}  // namespace decode
}  // namespace hpc
