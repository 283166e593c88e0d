// Device code of the split-KV combine: merges the fp32 pieces of every split
// unit into the output, in piece order (so the result does not depend on
// scheduling). Units that were not split were written by the decode kernel
// and are skipped; units with no KV at all get zeros.
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

__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const __grid_constant__ DecodeParams p, int head_dim) {
  pdl_launch_dependents();
  pdl_wait_for_producer();  // the decode kernel's partials
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
    for (int e = threadIdx.x; e < p.rows * quads; e += blockDim.x) {
      const int row = e / quads;
      const int d = (e % quads) * 4;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      if (pieces > 1) {
        float lse_max = -INFINITY;
        for (int i = 0; i < pieces; ++i) {
          lse_max = fmaxf(lse_max, p.partial_lse[(first + i) * p.rows + row]);
        }
        const float ref = lse_max == -INFINITY ? 0.f : lse_max;
        float sum = 0.f;
        for (int i = 0; i < pieces; ++i) {
          const int64_t prow = static_cast<int64_t>(first + i) * p.rows + row;
          const float w = exp2f(p.partial_lse[prow] - ref);
          const float4 v = *reinterpret_cast<const float4*>(
              p.partial_out + prow * head_dim + d);
          sum += w;
          acc.x += w * v.x;
          acc.y += w * v.y;
          acc.z += w * v.z;
          acc.w += w * v.w;
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        acc = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
      }
      const int t = row / p.group;
      const int head = h * p.group + row % p.group;
      const int64_t offset =
          static_cast<int64_t>(b * p.query_tokens + t) * p.out_token_stride +
          static_cast<int64_t>(head) * p.out_head_stride + d;
      store4(static_cast<uint16_t*>(p.out) + offset, p.out_type, acc);
    }
  }
}

}  // namespace decode
}  // namespace hpc
