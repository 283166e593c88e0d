// Decode path of the fused FP8 MoE, down stage: out[token] = sum over the
// token's local experts j of w_j * (W2[e_j] q_j) (+ shared output), where
// q_j is the slot's FP8 intermediate (moe_decode_gate_up.cuh).
//
// CTA (x: a token, y: 16 rows of H). Its work items are (slot j, 64-byte K
// step) pairs, each warp a contiguous run of them; the A side is 16 rows of
// W2[e_j] and the B side q_j in all 8 columns (one token: the columns agree
// and column 0 is kept). Each item is folded into the warp's sum with its
// router weight and scales, so the warps' sums added in shared memory are
// the top-k reduction: no per-slot rows, no reduce stage.
//
// Before its PDL wait the CTA reads only the chain's inputs (ids, router
// weights, expert map: complete, as the gate-up stage waited for their
// producer before this grid could launch) and issues its first weight
// loads; h is read after the wait.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/pdl.cuh"
#include "common/vec.cuh"
#include "moe/moe_decode_gate_up.cuh"
#include "moe/moe_params.h"
#include "moe/moe_token_source.cuh"
#include "moe/moe_warp_mma.cuh"

namespace hpc {
namespace moe {

constexpr int kDecodeDownRows = 16;  // H rows per down CTA (one MMA tile)
// Weight steps a warp has loading at once (8 KB): the down CTA stages no
// tokens while they load, so 8 fit in its registers.
constexpr int kDownStepsInFlight = 8;

struct DownSmemLayout {
  int topk;
  int inter;
  __host__ __device__ int scale_groups() const {
    return (inter + kScaleBlock - 1) / kScaleBlock;
  }
  __host__ __device__ int scales_offset() const { return topk * inter; }
  __host__ __device__ int bytes() const {
    return scales_offset() + topk * scale_groups() * 4;
  }
};

__host__ __device__ inline DownSmemLayout down_smem_layout(const MoeParams& p) {
  return {p.topk, p.inter};
}

// The token's local slots of the FP8 intermediate (moe_decode_gate_up.cuh)
// and their scales, copied to `b` ([j][I]) and `scales` ([j][group]).
// Through L2: the gate-up stage wrote them.
__device__ __forceinline__ void stage_intermediate(const MoeParams& p,
                                                   int token,
                                                   const int* slot_expert,
                                                   uint8_t* b, float* scales) {
  const TokenSource<false> src = TokenSource<false>::make(p);
  const int I = p.inter;
  const int chunks = I / 16;
  for (int i = threadIdx.x; i < p.topk * chunks; i += kDecodeThreads) {
    const int j = i / chunks;
    if (slot_expert[j] < 0) continue;
    const int64_t offset = (int64_t(token) * p.topk + j) * src.stride;
    *reinterpret_cast<uint4*>(b + j * I + (i % chunks) * 16) = __ldcg(
        reinterpret_cast<const uint4*>(src.base + offset + (i % chunks) * 16));
  }
  const int groups = (I + kScaleBlock - 1) / kScaleBlock;
  for (int i = threadIdx.x; i < p.topk * groups; i += kDecodeThreads) {
    const int j = i / groups;
    if (slot_expert[j] < 0) continue;
    scales[i] =
        __ldcg(src.scale.ptr + (int64_t(token) * p.topk + j) * src.scale.s0 +
               (i % groups) * src.scale.s1);
  }
}

__global__ void __launch_bounds__(kDecodeThreads, 2)
    moe_decode_down_kernel(const MoeParams p) {
  extern __shared__ __align__(16) uint8_t decode_smem[];
  __shared__ int slot_expert[kMaxTopk];
  __shared__ float slot_weight[kMaxTopk];
  __shared__ float partial[kDecodeWarps][2][32];

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int g = lane / 4;
  const int q = lane % 4;
  const int token = blockIdx.x;
  const int row0 = blockIdx.y * kDecodeDownRows;
  const int H = p.hidden;
  const int I = p.inter;
  if (tid < p.topk) {
    const int slot = token * p.topk + tid;
    slot_expert[tid] = local_expert(p, slot);
    slot_weight[tid] = p.router_weight_on_input ? 1.f : p.topk_weights[slot];
  }
  __syncthreads();

  const int steps = I / kStepBytes;
  const int items = p.topk * steps;
  const int per_warp = (items + kDecodeWarps - 1) / kDecodeWarps;
  const int item_first = min(items, warp * per_warp);
  const int item_end = min(items, item_first + per_warp);
  // Lane's bytes of A row g of the item's expert; row g + 8 is 8 I further.
  auto rows = [&](int item) -> const uint8_t* {
    const int e = slot_expert[item / steps];
    if (e < 0) return nullptr;
    return p.w2 + (int64_t(e) * H + row0 + g) * I +
           (item % steps) * kStepBytes + q * 16;
  };
  uint4 lo[kDownStepsInFlight], hi[kDownStepsInFlight];
#pragma unroll
  for (int i = 0; i < kDownStepsInFlight; ++i) {
    const uint8_t* a =
        item_first + i < item_end ? rows(item_first + i) : nullptr;
    if (a != nullptr) {
      lo[i] = load_weights16(a);
      hi[i] = load_weights16(a + 8 * I);
    }
  }

  pdl_wait_for_producer();  // the intermediate of every slot
  pdl_launch_dependents();

  const DownSmemLayout smem = down_smem_layout(p);
  uint8_t* b = decode_smem;
  float* scales = reinterpret_cast<float*>(decode_smem + smem.scales_offset());
  stage_intermediate(p, token, slot_expert, b, scales);
  __syncthreads();

  const int groups = smem.scale_groups();
  const int block = row0 / kScaleBlock;
  float acc[2] = {0.f, 0.f};  // rows g and g + 8, column 0
  for (int base = item_first; base < item_end; base += kDownStepsInFlight) {
#pragma unroll
    for (int i = 0; i < kDownStepsInFlight; ++i) {
      const int item = base + i;
      if (item >= item_end) break;
      const int j = item / steps;
      const int e = slot_expert[j];
      if (e >= 0) {
        const int step = item % steps;
        const int group = step * kStepBytes / kScaleBlock;
        const uint4 x = *reinterpret_cast<const uint4*>(
            b + j * I + step * kStepBytes + q * 16);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        mma_fp8_step(d, lo[i], hi[i], x);
        const float s = slot_weight[j] * scales[j * groups + group] *
                        p.w2_scale.at(e, block, group);
        acc[0] += d[0] * s;
        acc[1] += d[2] * s;
      }
      const int next = item + kDownStepsInFlight;
      const uint8_t* a = next < item_end ? rows(next) : nullptr;
      if (a != nullptr) {
        lo[i] = load_weights16(a);
        hi[i] = load_weights16(a + 8 * I);
      }
    }
  }

  partial[warp][0][lane] = acc[0];
  partial[warp][1][lane] = acc[1];
  __syncthreads();
  // Lanes q = 0 and 1 of group g write rows g and g + 8.
  if (warp == 0 && q < 2) {
    float v = 0.f;
    for (int w = 0; w < kDecodeWarps; ++w) v += partial[w][q][lane];
    const int row = row0 + g + 8 * q;
    if (p.out_type == ElemType::kBf16) {
      if (p.shared_output) {
        v += __bfloat162float(static_cast<const __nv_bfloat16*>(
            p.shared_output)[int64_t(token) * p.shared_stride + row]);
      }
      static_cast<__nv_bfloat16*>(p.out)[int64_t(token) * p.out_stride + row] =
          __float2bfloat16(v);
    } else {
      if (p.shared_output) {
        v += __half2float(static_cast<const __half*>(
            p.shared_output)[int64_t(token) * p.shared_stride + row]);
      }
      static_cast<__half*>(p.out)[int64_t(token) * p.out_stride + row] =
          __float2half(v);
    }
  }
}

}  // namespace moe
}  // namespace hpc
