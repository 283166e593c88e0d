// Decode path of the fused FP8 MoE, gate-up stage: for a few tokens
// (moe_tiling.h: kDecodeMaxTokens), h = SiLU(x W_gate^T) * (x W_up^T) for
// every routed (token, expert) slot, in fp32, without routing tables.
//
// CTA (x: 8 intermediate columns, y: a slot). The CTA of the first slot
// routed to an expert owns it; the others exit. The owner gathers every
// slot routed to its expert as a B column (the slot's token, quantized to
// FP8 into shared memory as the contract says) and streams 16 weight rows
// (the 8 gate rows and the 8 up rows of its columns) through warp MMAs
// (moe_warp_mma.cuh), each warp a contiguous K range with its loads issued
// kGateUpStepsInFlight steps ahead. The warps' partial sums meet in shared
// memory and warp 0 writes SiLU(gate) * up: a lane holds a gate value and the
// up value of the same column and token. The down stage quantizes h, so a 1 x
// 128 group spanning 16 CTAs needs no cross-CTA amax here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/pdl.cuh"
#include "common/vec.cuh"
#include "moe/moe_activation.cuh"
#include "moe/moe_fp8.cuh"
#include "moe/moe_params.h"
#include "moe/moe_route.cuh"
#include "moe/moe_warp_mma.cuh"

namespace hpc {
namespace moe {

constexpr int kDecodeThreads = 256;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kDecodeColumns = 8;  // intermediate columns per gate-up CTA
// Weight steps a warp has loading at once: 4 KB per warp, 64 KB per SM at
// two CTAs. More would not fit the 128 registers of two CTAs per SM.
constexpr int kGateUpStepsInFlight = 4;
// B columns per pass: two 8-column MMA tiles. A token routes to an expert at
// most once, so one pass holds every column unless the ids repeat.
constexpr int kDecodeBatch = 2 * 8;
static_assert(kDecodeBatch >= kDecodeMaxTokens);
constexpr int kMaxDecodeSlots = kDecodeMaxTokens * kMaxTopk;
static_assert(kMaxDecodeSlots <= kDecodeThreads);
// Bytes between B columns in shared memory beyond H: H % 128 == 0, so the
// 64 puts the two columns of a quarter-warp's 16-byte loads on other banks.
constexpr int kColumnPad = 64;

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

struct GateUpSmemLayout {
  int columns;  // B columns per pass
  int hidden;
  __host__ __device__ int column_stride() const { return hidden + kColumnPad; }
  __host__ __device__ int scales_offset() const {
    return columns * column_stride();
  }
  __host__ __device__ int bytes() const {
    return scales_offset() + columns * (hidden / kScaleBlock) * 4;
  }
};

// Whole 8-column tiles: the MMA reads B columns past the pass's last
// (their results are dropped).
__host__ __device__ inline GateUpSmemLayout gate_up_smem_layout(
    const MoeParams& p) {
  const int slots = p.num_tokens * p.topk;
  return {slots <= 8 ? 8 : kDecodeBatch, p.hidden};
}

// Quantizes this warp's groups of each B column's token into `b` (FP8, the
// layout's column stride) and `scales` ([column][group]), by the contract's
// rule for 16-bit inputs: static per-tensor, per-token dynamic (a CTA-wide
// amax first: every warp calls this) or 1 x 128 groups. A half-warp takes a
// group, 8 channels per lane.
template <typename T>
__device__ __forceinline__ void stage_columns_16bit(
    const MoeParams& p, const int* column_slot, int columns, GroupRange range,
    uint8_t* b, int stride, float* scales, float (*amax_part)[kDecodeBatch]) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int groups = p.hidden / kScaleBlock;
  const int half = lane / 16;
  const int offset = (lane % 16) * 8;
  const bool per_token = !p.block_wise && p.a1_scale == nullptr;
  auto load = [&](int column, int group, float (&v)[8]) {
    if (group < range.end) {
      load8(input_row<T>(p, column_slot[column] / p.topk) +
                group * kScaleBlock + offset,
            v);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.f;
    }
  };
  if (per_token) {
    for (int c = 0; c < columns; ++c) {
      float amax = 0.f;
      for (int g = range.first; g < range.end; g += 2) {
        float v[8];
        load(c, g + half, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      }
      if (lane == 0) amax_part[warp][c] = amax;
    }
    __syncthreads();
  }
  const float static_scale = per_token || p.block_wise ? 1.f : *p.a1_scale;
  for (int c = 0; c < columns; ++c) {
    float token_scale = static_scale;
    if (per_token) {
      float amax = 0.f;
      for (int w = 0; w < kDecodeWarps; ++w) {
        amax = fmaxf(amax, amax_part[w][c]);
      }
      token_scale = dynamic_scale(amax);
    }
    for (int g = range.first; g < range.end; g += 2) {
      const int group = g + half;
      float v[8];
      load(c, group, v);
      const float s = p.block_wise ? group_scale16(v) : token_scale;
      if (group < range.end) {
        store8_fp8_divided(b + c * stride + group * kScaleBlock + offset, v, s);
        if (offset == 0) scales[c * groups + group] = s;
      }
    }
  }
}

// FP8 inputs: this warp's groups of each column copied as they are, with
// the caller's scales (per tensor or per token, or per 1 x 128 group).
__device__ __forceinline__ void stage_columns_fp8(const MoeParams& p,
                                                  const int* column_slot,
                                                  int columns, GroupRange range,
                                                  uint8_t* b, int stride,
                                                  float* scales) {
  const int lane = threadIdx.x % 32;
  const int groups = p.hidden / kScaleBlock;
  const int offset = (lane % 16) * 8;
  for (int c = 0; c < columns; ++c) {
    const int token = column_slot[c] / p.topk;
    const uint8_t* row =
        static_cast<const uint8_t*>(p.input) + int64_t(token) * p.input_stride;
    for (int group = range.first + lane / 16; group < range.end; group += 2) {
      *reinterpret_cast<uint2*>(b + c * stride + group * kScaleBlock + offset) =
          *reinterpret_cast<const uint2*>(row + group * kScaleBlock + offset);
      if (offset == 0) {
        scales[c * groups + group] =
            p.a1_scale[int64_t(token) * p.a1_scale_stride +
                       (p.block_wise ? group : 0)];
      }
    }
  }
}

__global__ void __launch_bounds__(kDecodeThreads, 2)
    moe_decode_gate_up_kernel(const MoeParams p) {
  extern __shared__ __align__(16) uint8_t decode_smem[];
  __shared__ int slot_expert[kMaxDecodeSlots];
  __shared__ int column_slot[kMaxDecodeSlots];
  __shared__ int num_columns;
  __shared__ float amax_part[kDecodeWarps][kDecodeBatch];
  __shared__ float partial[kDecodeWarps][2][4][32];

  // The ids and the input come from the stages before the chain. The next
  // stage reads only the chain's inputs before its own wait.
  pdl_wait_for_producer();
  pdl_launch_dependents();

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int g = lane / 4;
  const int q = lane % 4;
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
  if (warp == 0) {  // the expert's slots, in slot order
    int count = 0;
    for (int base = 0; base < slots; base += 32) {
      const bool mine =
          base + lane < slots && slot_expert[base + lane] == expert;
      const unsigned ballot = __ballot_sync(0xffffffffu, mine);
      if (mine)
        column_slot[count + __popc(ballot & ((1u << lane) - 1))] = base + lane;
      count += __popc(ballot);
    }
    if (lane == 0) num_columns = count;
  }
  __syncthreads();

  const int H = p.hidden;
  const int I = p.inter;
  const int n0 = blockIdx.x * kDecodeColumns;
  const GateUpSmemLayout smem = gate_up_smem_layout(p);
  const int stride = smem.column_stride();
  uint8_t* b = decode_smem;
  float* scales = reinterpret_cast<float*>(decode_smem + smem.scales_offset());
  const int groups = H / kScaleBlock;
  const GroupRange range = warp_groups(groups, warp);
  const int step_end = 2 * range.end;
  // A rows g (gate) and g + 8 (up) of this lane; bytes [16q, 16q + 16) of
  // each 64-byte step.
  const uint8_t* gate = p.w13 + (int64_t(expert) * 2 * I + n0 + g) * H + q * 16;
  const uint8_t* up = gate + int64_t(I) * H;
  const int gate_block = n0 / kScaleBlock;
  const int up_block = (I + n0) / kScaleBlock;
  float* h = reinterpret_cast<float*>(p.workspace + p.layout.decode_inter());

  for (int first = 0; first < num_columns; first += kDecodeBatch) {
    const int columns = min(kDecodeBatch, num_columns - first);
    const int tiles = (columns + 7) / 8;
    __syncthreads();  // the previous pass has read amax_part and partial
    uint4 lo[kGateUpStepsInFlight], hi[kGateUpStepsInFlight];
#pragma unroll
    for (int i = 0; i < kGateUpStepsInFlight; ++i) {
      const int step = 2 * range.first + i;
      if (step < step_end) {
        lo[i] = load_weights16(gate + step * kStepBytes);
        hi[i] = load_weights16(up + step * kStepBytes);
      }
    }
    // The weights are on their way; stage the tokens meanwhile. A warp
    // reads only its own groups of B, so no CTA barrier is needed after.
    if (p.input_type == ElemType::kFp8E4m3) {
      stage_columns_fp8(p, column_slot + first, columns, range, b, stride,
                        scales);
    } else if (p.input_type == ElemType::kBf16) {
      stage_columns_16bit<__nv_bfloat16>(p, column_slot + first, columns, range,
                                         b, stride, scales, amax_part);
    } else {
      stage_columns_16bit<__half>(p, column_slot + first, columns, range, b,
                                  stride, scales, amax_part);
    }
    __syncwarp();

    float acc[2][4] = {};
    for (int base = 2 * range.first; base < step_end;
         base += kGateUpStepsInFlight) {
#pragma unroll
      for (int i = 0; i < kGateUpStepsInFlight; ++i) {
        const int step = base + i;
        if (step >= step_end) break;
        const int group = step / 2;
        const float gate_scale = p.w13_scale.at(expert, gate_block, group);
        const float up_scale = p.w13_scale.at(expert, up_block, group);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          if (t >= tiles) break;
          const uint4 x = *reinterpret_cast<const uint4*>(
              b + (t * 8 + g) * stride + step * kStepBytes + q * 16);
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          mma_fp8_step(d, lo[i], hi[i], x);
          const float s0 = scales[(t * 8 + 2 * q) * groups + group];
          const float s1 = scales[(t * 8 + 2 * q + 1) * groups + group];
          acc[t][0] += d[0] * gate_scale * s0;
          acc[t][1] += d[1] * gate_scale * s1;
          acc[t][2] += d[2] * up_scale * s0;
          acc[t][3] += d[3] * up_scale * s1;
        }
        if (step + kGateUpStepsInFlight < step_end) {
          lo[i] =
              load_weights16(gate + (step + kGateUpStepsInFlight) * kStepBytes);
          hi[i] =
              load_weights16(up + (step + kGateUpStepsInFlight) * kStepBytes);
        }
      }
    }

#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][t][i][lane] = acc[t][i];
    }
    __syncthreads();
    if (warp == 0) {
      for (int t = 0; t < tiles; ++t) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        for (int w = 0; w < kDecodeWarps; ++w) {
#pragma unroll
          for (int i = 0; i < 4; ++i) v[i] += partial[w][t][i][lane];
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int column = t * 8 + 2 * q + j;
          if (column < columns) {
            h[int64_t(column_slot[first + column]) * I + n0 + g] =
                silu(v[j]) * v[2 + j];
          }
        }
      }
    }
  }
}

}  // namespace moe
}  // namespace hpc
