// Decode path of the fused FP8 MoE, gate-up stage: for a few tokens on a
// few experts (moe_tiling.h), h = SiLU(x W_gate^T) * (x W_up^T) for
// every routed (token, expert) slot, quantized to FP8, without routing
// tables.
//
// CTA (x: 8 intermediate columns, y: a slot). The CTA of the first slot
// routed to an expert owns it; the others exit. The owner copies its 16
// weight rows whole (the 8 gate rows and the 8 up rows of its columns) into
// shared memory with the bulk-copy engine as soon as it knows the expert,
// takes every slot routed to the expert as a B column (the slot's token as
// FP8) and runs warp MMAs
// (moe_warp_mma.cuh), each warp a contiguous K range. The warps' partial
// sums meet in shared memory and warp 0 computes SiLU(gate) * up: a lane
// holds a gate value and the up value of the same column and token.
//
// B columns: a 16-bit input is quantized here, per column and group, as
// the grouped path's quantize stage does it; the decode path has no such
// stage, whose completion (a grid flush behind the weight traffic) would
// hold the whole chain up. An FP8 input is read as it is.
//
// The intermediate's scale: per tensor it is static, so warp 0 writes FP8
// at once. Block-wise, a 1 x 128 group spans 16 CTAs: they store h in fp32
// and count their arrivals per (expert, group); the last one quantizes the
// group for every slot (threadfence reduction), so the down stage copies
// FP8 rows either way.
//
// PDL: the first stage of the chain; once its wait has passed, the down
// stage may launch, and its CTAs copy their own weights while these run.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/pdl.cuh"
#include "moe/moe_activation.cuh"
#include "moe/moe_fp8.cuh"
#include "moe/moe_params.h"
#include "moe/moe_token_source.cuh"
#include "moe/moe_warp_mma.cuh"

namespace hpc {
namespace moe {

constexpr int kDecodeThreads = 256;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kMaxDecodeSlots = kDecodeMaxTokens * kMaxTopk;
static_assert(kMaxDecodeSlots <= kDecodeThreads);

// The warp's K range in 128-channel groups: [first, end).
struct GroupRange {
  int first;
  int end;
};

__device__ __forceinline__ GroupRange warp_groups(int groups, int warp) {
  const int per = (groups + kDecodeWarps - 1) / kDecodeWarps;
  const int first = min(groups, warp * per);
  return {first, min(groups, first + per)};
}

// This warp's groups of each B column from an FP8 input: the token's bytes
// and their scales ([column][group]). Each warp reads only its own groups
// of B, so a warp barrier suffices after.
__device__ __forceinline__ void stage_columns(const MoeParams& p,
                                              const int* column_slot,
                                              int columns, GroupRange range,
                                              uint8_t* b, int stride,
                                              float* scales) {
  const TokenSource<true> src = TokenSource<true>::make(p);
  const int lane = threadIdx.x % 32;
  const int groups = p.hidden / kScaleBlock;
  const int offset = (lane % 16) * 8;
  for (int c = 0; c < columns; ++c) {
    const int64_t token = column_slot[c] / p.topk;
    const uint8_t* row = src.base + token * src.stride;
    for (int group = range.first + lane / 16; group < range.end; group += 2) {
      const int channel = group * kScaleBlock + offset;
      *reinterpret_cast<uint2*>(b + c * stride + channel) =
          __ldcg(reinterpret_cast<const uint2*>(row + channel));
      if (offset == 0) {
        scales[c * groups + group] =
            __ldcg(src.scale.ptr + token * src.scale.s0 + group * src.scale.s1);
      }
    }
  }
}

// This warp's groups of each B column, quantized from the 16-bit input
// exactly as the quantize stage stores them (moe_quantize.cuh): a 1 x 128
// group is 16 lanes of 8 channels. A per-token dynamic scale takes a first
// pass for the row's amax, whose parts from every warp meet in `row_amax`
// ([warp][column]; a CTA barrier, so every warp must call it).
template <typename T>
__device__ void quantize_columns(const MoeParams& p, const int* column_slot,
                                 int columns, GroupRange range, uint8_t* b,
                                 int stride, float* scales,
                                 float (*row_amax)[kDecodeMaxTokens]) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int groups = p.hidden / kScaleBlock;
  const int offset = (lane % 16) * 8;
  const bool per_token = !p.block_wise && p.a1_scale == nullptr;
  if (per_token) {
    for (int c = 0; c < columns; ++c) {
      const T* row = input_row<T>(p, column_slot[c] / p.topk);
      float amax = 0.f;
      for (int group = range.first + lane / 16; group < range.end; group += 2) {
        float v[8];
        load8(row + group * kScaleBlock + offset, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      }
      if (lane == 0) row_amax[warp][c] = amax;
    }
    __syncthreads();
  }
  const float static_scale = p.block_wise || per_token ? 1.f : *p.a1_scale;
  for (int c = 0; c < columns; ++c) {
    const T* row = input_row<T>(p, column_slot[c] / p.topk);
    float token_scale = static_scale;
    if (per_token) {
      float amax = 0.f;
      for (int w = 0; w < kDecodeWarps; ++w) amax = fmaxf(amax, row_amax[w][c]);
      token_scale = dynamic_scale(amax);
    }
    // Both half-warps run every round: the group scale's shuffles span them.
    for (int base = range.first; base < range.end; base += 2) {
      const int group = base + lane / 16;
      const bool active = group < range.end;
      const int channel = group * kScaleBlock + offset;
      float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (active) load8(row + channel, v);
      const float scale = p.block_wise ? group_scale16(v) : token_scale;
      if (active) {
        store8_fp8_divided(b + c * stride + channel, v, scale);
        if (offset == 0) scales[c * groups + group] = scale;
      }
    }
  }
}

// Block-wise: called by warp 0 of every gate-up CTA once its h values are
// stored. The last of the 16 CTAs of the expert's 128-column group reads
// the group's h for every slot and stores it as FP8 with a 1 x 128 scale.
__device__ __forceinline__ void finish_group(const MoeParams& p, int expert,
                                             int n0, const int* column_slot,
                                             int columns) {
  const int lane = threadIdx.x % 32;
  const int group = n0 / kScaleBlock;
  const int groups = p.inter / kScaleBlock;  // block-wise: I % 128 == 0
  int* counter =
      reinterpret_cast<int*>(p.workspace + p.layout.group_counters()) +
      expert * groups + group;
  __threadfence();  // this CTA's h, before its arrival is counted
  __syncwarp();
  int last = 0;
  if (lane == 0) {
    last = atomicAdd(counter, 1) == kScaleBlock / kDecodeColumns - 1;
  }
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  __threadfence();  // the other CTAs' h, after their arrivals
  const float* h =
      reinterpret_cast<const float*>(p.workspace + p.layout.decode_inter());
  uint8_t* q = p.workspace + p.layout.inter_q();
  float* q_scale =
      reinterpret_cast<float*>(p.workspace + p.layout.inter_scale());
  // Two columns at a time, a half-warp each: 8 channels per lane, as the
  // quantize stage holds a 1 x 128 group.
  for (int c0 = 0; c0 < columns; c0 += 2) {
    const int c = c0 + lane / 16;
    const int64_t at = c < columns ? int64_t(column_slot[c]) * p.inter +
                                         group * kScaleBlock + (lane % 16) * 8
                                   : 0;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (c < columns) {
      const float4 v0 = __ldcg(reinterpret_cast<const float4*>(h + at));
      const float4 v1 = __ldcg(reinterpret_cast<const float4*>(h + at + 4));
      v[0] = v0.x, v[1] = v0.y, v[2] = v0.z, v[3] = v0.w;
      v[4] = v1.x, v[5] = v1.y, v[6] = v1.z, v[7] = v1.w;
    }
    const float s = group_scale16(v);
    if (c < columns) {
      store8_fp8_divided(q + at, v, s);
      if (lane % 16 == 0) q_scale[column_slot[c] * groups + group] = s;
    }
  }
  if (lane == 0) *counter = 0;  // ready for the next call
}

// At most 104 registers, so that two down CTAs fit beside one gate-up CTA
// (moe_decode_down.cuh).
__global__ void __maxnreg__(104) moe_decode_gate_up_kernel(const MoeParams p) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ __align__(128) uint8_t decode_smem[];
  __shared__ uint64_t weights_ready;
  __shared__ int slot_expert[kMaxDecodeSlots];
  __shared__ int column_slot[kMaxDecodeSlots];
  __shared__ int num_columns;
  __shared__ float partial[kDecodeWarps][2][4][32];
  __shared__ float row_amax[kDecodeWarps][kDecodeMaxTokens];

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int g = lane / 4;
  const int q = lane % 4;
  if (tid == 0) {
    Barrier::init(&weights_ready, 1);
    cutlass::arch::fence_barrier_init();
  }
  pdl_wait_for_producer();  // the ids and the input
  pdl_launch_dependents();

  const int slots = p.num_tokens * p.topk;
  const int slot = blockIdx.y;
  if (tid < slots) slot_expert[tid] = local_expert(p, tid);
  __syncthreads();
  const int expert = slot_expert[slot];
  // Exit unless this is the expert's first slot (uniform over the CTA).
  if (expert < 0 ||
      __syncthreads_or(tid < slot && slot_expert[tid] == expert)) {
    return;
  }

  const int H = p.hidden;
  const int I = p.inter;
  const int n0 = blockIdx.x * kDecodeColumns;
  const GateUpSmemLayout layout = gate_up_smem_layout(p.num_tokens, p.hidden);
  const int stride = layout.stride();
  const uint8_t* a = decode_smem;
  uint8_t* b = decode_smem + layout.b_offset();
  float* scales =
      reinterpret_cast<float*>(decode_smem + layout.scales_offset());
  if (warp == 0) {
    // Tile row r < 8: gate row n0 + r; r >= 8: up row n0 + r - 8.
    const uint8_t* rows = p.w13 + (int64_t(expert) * 2 * I + n0) * H;
    copy_tile_rows(
        [&](int r) { return rows + (int64_t(r / 8) * I + r % 8) * H; }, H,
        decode_smem, stride, &weights_ready);
    // The expert's slots, in slot order.
    int count = 0;
    for (int base = 0; base < slots; base += 32) {
      const bool mine =
          base + lane < slots && slot_expert[base + lane] == expert;
      const unsigned ballot = __ballot_sync(0xffffffffu, mine);
      if (mine) {
        column_slot[count + __popc(ballot & ((1u << lane) - 1))] = base + lane;
      }
      count += __popc(ballot);
    }
    if (lane == 0) num_columns = count;
  }
  // The weight scales of this warp's K groups, lane i holding group
  // range.first + i (a warp has at most 32 groups: launch_decode()), and
  // the intermediate's static scale, read while the weights are in flight.
  const int groups = H / kScaleBlock;
  const GroupRange range = warp_groups(groups, warp);
  const int gate_block = n0 / kScaleBlock;
  const int up_block = (I + n0) / kScaleBlock;
  const bool holds_group = lane < range.end - range.first;
  const float lane_gate_scale =
      holds_group ? p.w13_scale.at(expert, gate_block, range.first + lane)
                  : 0.f;
  const float lane_up_scale =
      holds_group ? p.w13_scale.at(expert, up_block, range.first + lane) : 0.f;
  const float inter_scale = p.block_wise ? 1.f : *p.a2_scale;
  const float inter_rcp = __frcp_rn(inter_scale);
  __syncthreads();  // the column list

  for (int first = 0; first < num_columns; first += layout.b_rows) {
    const int columns = min(layout.b_rows, num_columns - first);
    const int tiles = (columns + 7) / 8;
    if (p.input_type == ElemType::kBf16) {
      quantize_columns<__nv_bfloat16>(p, column_slot + first, columns, range, b,
                                      stride, scales, row_amax);
    } else if (p.input_type == ElemType::kFp16) {
      quantize_columns<__half>(p, column_slot + first, columns, range, b,
                               stride, scales, row_amax);
    } else {
      stage_columns(p, column_slot + first, columns, range, b, stride, scales);
    }
    __syncwarp();  // a warp reads only the groups it staged
    if (first == 0) Barrier::wait(&weights_ready, 0);

    // Each 128-channel group (two steps) is summed apart and folded in
    // with its weight and activation scales.
    float acc[2][4] = {};
    for (int group = range.first; group < range.end; ++group) {
      const unsigned all = 0xffffffffu;
      const float gate_scale =
          __shfl_sync(all, lane_gate_scale, group - range.first);
      const float up_scale =
          __shfl_sync(all, lane_up_scale, group - range.first);
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        if (t >= tiles) break;
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int k = (2 * group + half) * kStepBytes + q * 16;
          const uint4 lo = *reinterpret_cast<const uint4*>(a + g * stride + k);
          const uint4 hi =
              *reinterpret_cast<const uint4*>(a + (g + 8) * stride + k);
          const uint4 x =
              *reinterpret_cast<const uint4*>(b + (t * 8 + g) * stride + k);
          mma_fp8_step(part, lo, hi, x);
        }
        const float s0 = scales[(t * 8 + 2 * q) * groups + group];
        const float s1 = scales[(t * 8 + 2 * q + 1) * groups + group];
        acc[t][0] += part[0] * gate_scale * s0;
        acc[t][1] += part[1] * gate_scale * s1;
        acc[t][2] += part[2] * up_scale * s0;
        acc[t][3] += part[3] * up_scale * s1;
      }
    }

#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int j = 0; j < 4; ++j) partial[warp][t][j][lane] = acc[t][j];
    }
    __syncthreads();
    if (warp == 0) {
      for (int t = 0; t < tiles; ++t) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        for (int w = 0; w < kDecodeWarps; ++w) {
#pragma unroll
          for (int j = 0; j < 4; ++j) v[j] += partial[w][t][j][lane];
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int column = t * 8 + 2 * q + j;
          if (column >= columns) continue;
          const int64_t at = int64_t(column_slot[first + column]) * I + n0 + g;
          const float h = silu(v[j]) * v[2 + j];
          if (p.block_wise) {
            reinterpret_cast<float*>(p.workspace +
                                     p.layout.decode_inter())[at] = h;
          } else {  // divided, as the quantize stage does
            p.workspace[p.layout.inter_q() + at] =
                __nv_cvt_float_to_fp8(divide_rn(h, inter_scale, inter_rcp),
                                      __NV_SATFINITE, __NV_E4M3);
          }
        }
      }
    }
    __syncthreads();  // warp 0 has read `partial`
  }
  if (p.block_wise && warp == 0) {
    finish_group(p, expert, n0, column_slot, num_columns);
  }
}

}  // namespace moe
}  // namespace hpc
