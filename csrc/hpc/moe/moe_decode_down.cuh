// Decode path of the fused FP8 MoE, down stage: out[token] = sum over the
// token's local experts j of w_j * (W2[e_j] q_j) (+ shared output), where
// q_j is the slot's FP8 intermediate (moe_decode_gate_up.cuh).
//
// CTA (x: a token, y: 32 rows of H, two MMA row tiles). Its items are the
// token's local slots; an item's A tile is 32 rows of W2[e_j], contiguous
// in memory, which one bulk copy moves whole into a ring of shared-memory
// stages. The warps take the stages of a round in contiguous (item, 64-byte
// step) runs; the B side is q_j in all 8 columns (one token: the columns
// agree, column 0 is kept). Each step is folded into the warp's sums with
// its router weight and scales, so the warps' sums added in shared memory
// are the top-k reduction: no per-slot rows, no reduce stage.
//
// PDL: the gate-up stage lets this grid launch as soon as the ids are
// complete, and a CTA then does all it can before its wait: the first
// ring's copies, the router weights times the weight scales, the shared
// output. After the wait only the intermediate is left to read (one batch
// of loads from L2), so the stage ends soon after the gate-up does. 32 rows
// per CTA keep the grid small enough to fit beside the gate-up CTAs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/pdl.cuh"
#include "moe/moe_decode_gate_up.cuh"
#include "moe/moe_params.h"
#include "moe/moe_token_source.cuh"
#include "moe/moe_warp_mma.cuh"

namespace hpc {
namespace moe {

constexpr int kDecodeDownTiles = 2;  // 16-row MMA tiles per down CTA
constexpr int kDecodeDownRows = 16 * kDecodeDownTiles;  // H rows per CTA
// Ring bytes at most, so that two CTAs share an SM with their B side.
constexpr int kDownRingBytes = 96 * 1024;

// Dynamic shared memory of a down CTA: the ring of A stages, then B
// ([j][I] FP8), its scales and the slots' router weight times weight scale
// (both [j][group]).
struct DownSmemLayout {
  int topk;
  int inter;
  // The rows stay as they are in W2 (one copy per tile): where I % 128 ==
  // 0 a fragment load meets 2-way bank conflicts, which cost less than 32
  // small copies per tile.
  __host__ __device__ int stride() const { return inter; }
  __host__ __device__ int stage_bytes() const {
    return kDecodeDownRows * stride();
  }
  __host__ __device__ int stages() const {
    const int fit = kDownRingBytes / stage_bytes();
    return fit < 1 ? 1 : (fit < topk ? fit : topk);
  }
  __host__ __device__ int scale_groups() const {
    return (inter + kScaleBlock - 1) / kScaleBlock;
  }
  __host__ __device__ int b_offset() const { return stages() * stage_bytes(); }
  __host__ __device__ int scales_offset() const {
    return b_offset() + topk * inter;  // I % 64 == 0
  }
  __host__ __device__ int weight_scales_offset() const {
    return scales_offset() + topk * scale_groups() * 4;
  }
  __host__ __device__ int bytes() const {
    return weight_scales_offset() + topk * scale_groups() * 4;
  }
};

// The token's local slots of the FP8 intermediate and their scales, copied
// to `b` ([j][I]) and `scales` ([j][group]). Through L2: the gate-up stage
// wrote them. One loop for both, so that a thread's loads go out together.
__device__ __forceinline__ void stage_intermediate(const MoeParams& p,
                                                   int token,
                                                   const int* slot_expert,
                                                   uint8_t* b, float* scales) {
  const TokenSource<false> src = TokenSource<false>::make(p);
  const int I = p.inter;
  const int chunks = I / 16;
  const int groups = (I + kScaleBlock - 1) / kScaleBlock;
  const int byte_items = p.topk * chunks;
  for (int i = threadIdx.x; i < byte_items + p.topk * groups;
       i += kDecodeThreads) {
    if (i < byte_items) {
      const int j = i / chunks;
      if (slot_expert[j] < 0) continue;
      const int64_t offset =
          (int64_t(token) * p.topk + j) * src.stride + (i % chunks) * 16;
      *reinterpret_cast<uint4*>(b + j * I + (i % chunks) * 16) =
          __ldcg(reinterpret_cast<const uint4*>(src.base + offset));
    } else {
      const int at = i - byte_items;
      const int j = at / groups;
      if (slot_expert[j] < 0) continue;
      scales[at] =
          __ldcg(src.scale.ptr + (int64_t(token) * p.topk + j) * src.scale.s0 +
                 (at % groups) * src.scale.s1);
    }
  }
}

// The token's shared-expert output at `row`, or 0 without one.
__device__ __forceinline__ float shared_output_at(const MoeParams& p, int token,
                                                  int row) {
  if (!p.shared_output) return 0.f;
  const int64_t at = int64_t(token) * p.shared_stride + row;
  return p.out_type == ElemType::kBf16
             ? __bfloat162float(
                   static_cast<const __nv_bfloat16*>(p.shared_output)[at])
             : __half2float(static_cast<const __half*>(p.shared_output)[at]);
}

// At most 72 registers, so that two CTAs fit beside a gate-up CTA (104).
__global__ void __maxnreg__(72) moe_decode_down_kernel(const MoeParams p) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ __align__(128) uint8_t decode_smem[];
  __shared__ uint64_t full[kMaxTopk];
  __shared__ uint64_t empty[kMaxTopk];
  __shared__ int slot_expert[kMaxTopk];  // by slot j; -1: not local
  __shared__ int item_slot[kMaxTopk];    // the local slots, in slot order
  __shared__ int num_items;
  __shared__ float partial[kDecodeWarps][kDecodeDownTiles][2][32];
  __shared__ float shared_rows[kDecodeDownRows];  // the shared output's

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int g = lane / 4;
  const int q = lane % 4;
  const int token = blockIdx.x;
  const int row0 = blockIdx.y * kDecodeDownRows;
  const int H = p.hidden;
  const int I = p.inter;
  const DownSmemLayout layout{p.topk, I};
  const int stages = layout.stages();
  const int stride = layout.stride();
  const int groups = layout.scale_groups();
  uint8_t* ring = decode_smem;
  uint8_t* b = decode_smem + layout.b_offset();
  float* scales =
      reinterpret_cast<float*>(decode_smem + layout.scales_offset());
  float* weight_scales =
      reinterpret_cast<float*>(decode_smem + layout.weight_scales_offset());

  // The chain's inputs (ids, router weights, expert map, weights and their
  // scales, shared output) are complete: the gate-up grid launched this one
  // only once its own producer had finished them (moe_decode_gate_up.cuh).
  if (warp == 0) {
    const int e = lane < p.topk ? local_expert(p, token * p.topk + lane) : -1;
    if (lane < p.topk) slot_expert[lane] = e;
    const unsigned local = __ballot_sync(0xffffffffu, e >= 0);
    if (e >= 0) item_slot[__popc(local & ((1u << lane) - 1))] = lane;
    if (lane == 0) {
      num_items = __popc(local);
      for (int s = 0; s < stages; ++s) {
        Barrier::init(&full[s], 1);
        Barrier::init(&empty[s], kDecodeWarps);
      }
      cutlass::arch::fence_barrier_init();
    }
  }
  __syncthreads();
  const int items = tid == 0 ? num_items : 0;  // thread 0 issues the copies
  auto issue = [&](int item) {
    const int stage = item % stages;
    copy_tile(p.w2 + (int64_t(slot_expert[item_slot[item]]) * H + row0) * I,
              layout.stage_bytes(), ring + stage * layout.stage_bytes(),
              &full[stage]);
  };
  for (int item = 0; item < min(stages, items); ++item) issue(item);
  const int block = row0 / kScaleBlock;
  for (int i = tid; i < p.topk * groups; i += kDecodeThreads) {
    const int j = i / groups;
    const int e = slot_expert[j];
    if (e < 0) continue;
    const float w =
        p.router_weight_on_input ? 1.f : p.topk_weights[token * p.topk + j];
    weight_scales[i] = w * p.w2_scale.at(e, block, i % groups);
  }
  if (tid < kDecodeDownRows) {
    shared_rows[tid] = shared_output_at(p, token, row0 + tid);
  }

  pdl_wait_for_producer();  // the intermediate of every slot
  pdl_launch_dependents();
  stage_intermediate(p, token, slot_expert, b, scales);
  __syncthreads();

  const int n = num_items;
  const int steps = I / kStepBytes;
  float acc[kDecodeDownTiles][2] = {};  // rows g and g + 8, column 0
  for (int first = 0; first < n; first += stages) {
    const int round_items = min(stages, n - first);
    const int units = round_items * steps;
    const int per_warp = (units + kDecodeWarps - 1) / kDecodeWarps;
    const int u0 = min(units, warp * per_warp);
    const int u1 = min(units, u0 + per_warp);
    // This warp reads items [first + u0 / steps, first + (u1 - 1) / steps];
    // it releases the round's other stages at once.
    const int touched0 = u0 < u1 ? u0 / steps : round_items;
    const int touched1 = u0 < u1 ? (u1 - 1) / steps : -1;
    if (lane == 0) {
      for (int i = 0; i < round_items; ++i) {
        if (i < touched0 || i > touched1) {
          Barrier::arrive(&empty[(first + i) % stages]);
        }
      }
    }
    int current = -1;
    for (int u = u0; u < u1; ++u) {
      const int item = first + u / steps;
      const int stage = item % stages;
      if (item != current) {
        if (current >= 0) {
          __syncwarp();
          if (lane == 0) Barrier::arrive(&empty[current % stages]);
        }
        Barrier::wait(&full[stage], (item / stages) & 1);
        current = item;
      }
      const int j = item_slot[item];
      const int step = u % steps;
      const int k = step * kStepBytes + q * 16;
      const uint8_t* tile = ring + stage * layout.stage_bytes();
      const uint4 x = *reinterpret_cast<const uint4*>(b + j * I + k);
      const int group = step * kStepBytes / kScaleBlock;
      const float s =
          weight_scales[j * groups + group] * scales[j * groups + group];
#pragma unroll
      for (int t = 0; t < kDecodeDownTiles; ++t) {
        const uint8_t* rows = tile + t * 16 * stride;
        const uint4 lo = *reinterpret_cast<const uint4*>(rows + g * stride + k);
        const uint4 hi =
            *reinterpret_cast<const uint4*>(rows + (g + 8) * stride + k);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        mma_fp8_step(d, lo, hi, x);
        acc[t][0] += d[0] * s;
        acc[t][1] += d[2] * s;
      }
    }
    if (current >= 0) {
      __syncwarp();
      if (lane == 0) Barrier::arrive(&empty[current % stages]);
    }
    // Thread 0 refills the ring with the next round as its stages free up.
    for (int item = first + stages; item < min(items, first + 2 * stages);
         ++item) {
      Barrier::wait(&empty[item % stages], (item / stages - 1) & 1);
      issue(item);
    }
  }

#pragma unroll
  for (int t = 0; t < kDecodeDownTiles; ++t) {
    partial[warp][t][0][lane] = acc[t][0];
    partial[warp][t][1][lane] = acc[t][1];
  }
  __syncthreads();
  // Warps 0 and 1 write row tiles 0 and 1: lanes q = 0 and 1 of group g
  // rows g and g + 8 of their tile.
  if (warp < kDecodeDownTiles && q < 2) {
    const int r = warp * 16 + g + 8 * q;
    float v = shared_rows[r];
    for (int w = 0; w < kDecodeWarps; ++w) v += partial[w][warp][q][lane];
    const int64_t at = int64_t(token) * p.out_stride + row0 + r;
    if (p.out_type == ElemType::kBf16) {
      static_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16(v);
    } else {
      static_cast<__half*>(p.out)[at] = __float2half(v);
    }
  }
}

}  // namespace moe
}  // namespace hpc
