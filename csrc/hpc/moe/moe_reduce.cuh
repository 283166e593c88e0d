// Reduce stage of the fused FP8 MoE pipeline: each token's top-k weighted
// sum of its experts' down-projection rows, plus the shared-expert output.
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

constexpr int kReduceThreads = 256;
// Channels of a token per CTA: 8 per thread, one pass.
constexpr int kReduceChannels = kReduceThreads * 8;
// Expert rows whose loads a thread has in flight together (top-k 8: all).
constexpr int kReduceBatch = 8;

// out[t] = sum_j w[t, j] * down_row(t, j) (+ shared[t]), in top-k order.
// CTA (x: token, y: kReduceChannels channels): a few CTAs per token, so that
// a small batch's sum is one round of loads per thread, not one per chunk of
// the row. The token's rows and weights are read once into shared memory; a
// thread then loads kReduceBatch rows' channels before it adds any.
__global__ void __launch_bounds__(kReduceThreads)
    moe_reduce_kernel(const MoeParams p) {
  __shared__ int expert_row[kMaxTopk];  // -1: expert not on this rank
  __shared__ float weight[kMaxTopk];
  const int token = blockIdx.x;
  // The route's table (or, with slot tiles, the router's ids) is complete
  // before the wait (see moe_gemm_kernel.cuh); read through L2, past any
  // stale L1 line of the previous call. A slot tile's row is its slot.
  if (threadIdx.x < p.topk) {
    const int slot = token * p.topk + threadIdx.x;
    const int32_t* slot_row =
        reinterpret_cast<const int32_t*>(p.workspace + p.layout.slot_row());
    expert_row[threadIdx.x] = p.tiling.slot_tiles
                                  ? (local_expert(p, slot) >= 0 ? slot : -1)
                                  : __ldcg(slot_row + slot);
    weight[threadIdx.x] = p.router_weight_on_input ? 1.f : p.topk_weights[slot];
  }
  pdl_wait_for_producer();  // the down GEMM's rows
  pdl_launch_dependents();
  __syncthreads();
  const __nv_bfloat16* rows = reinterpret_cast<const __nv_bfloat16*>(
      p.workspace + p.layout.down_rows());
  const int c = (blockIdx.y * kReduceThreads + threadIdx.x) * 8;
  if (c < p.hidden) {
    float acc[8];
    if (p.shared_output) {
      if (p.out_type == ElemType::kBf16) {
        load8(static_cast<const __nv_bfloat16*>(p.shared_output) +
                  int64_t(token) * p.shared_stride + c,
              acc);
      } else {
        load8(static_cast<const __half*>(p.shared_output) +
                  int64_t(token) * p.shared_stride + c,
              acc);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    }
    for (int j0 = 0; j0 < p.topk; j0 += kReduceBatch) {
      float v[kReduceBatch][8];
#pragma unroll
      for (int b = 0; b < kReduceBatch; ++b) {
        const int j = j0 + b;
        const int r = j < p.topk ? expert_row[j] : -1;
        if (r >= 0) {
          load8(rows + int64_t(r) * p.hidden + c, v[b]);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) v[b][i] = 0.f;
        }
      }
#pragma unroll
      for (int b = 0; b < kReduceBatch; ++b) {
        const int j = j0 + b;
        if (j < p.topk && expert_row[j] >= 0) {
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += weight[j] * v[b][i];
        }
      }
    }
    const int64_t offset = int64_t(token) * p.out_stride + c;
    if (p.out_type == ElemType::kBf16) {
      store8(static_cast<__nv_bfloat16*>(p.out) + offset, acc);
    } else {
      store8(static_cast<__half*>(p.out) + offset, acc);
    }
  }
}

}  // namespace moe
}  // namespace hpc
