// Device code of the fused FP8 MoE pipeline. Every stage is its own kernel,
// chained with programmatic dependent launch:
//
//   route        one CTA: per-expert counts, offsets and tile offsets in
//                shared memory, then the expert-sorted row list
//   quantize     16-bit inputs only: FP8 with a static, per-token or 1x128
//                scale
//   gate-up GEMM rows gathered straight from the input through the row list
//                (no permuted copy); epilogue SiLU(gate) * up and FP8
//                quantization of the intermediate
//   down GEMM    one 16-bit row per (token, expert)
//   reduce       top-k weighted sum per token (+ shared expert output)
//
// The GEMMs are grouped: a CTA takes one 64-row tile of one expert and one
// column block, found from the tile offsets by binary search. FP8 MMA
// (m16n8k32, fp32 accumulation) over cp.async-fed shared memory; scales are
// folded in per 128-deep k-block, so per-tensor and block-wise scaling share
// one code path (per-tensor scales are broadcast through zero strides).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/pdl.cuh"
#include "common/vec.cuh"
#include "moe/moe_params.h"

namespace hpc {
namespace moe {

__device__ __forceinline__ int local_expert(const MoeParams& p, int slot) {
  const int64_t id = p.topk_ids_int64
                         ? static_cast<const int64_t*>(p.topk_ids)[slot]
                         : static_cast<const int32_t*>(p.topk_ids)[slot];
  const int e =
      p.expert_map ? p.expert_map[id] : static_cast<int>(id) - p.expert_offset;
  return e >= 0 && e < p.num_experts ? e : -1;
}

// ---------------------------------------------------------------------------
// Route
// ---------------------------------------------------------------------------

constexpr int kRouteThreads = 1024;

// Counts and offsets live in shared memory; rows of one expert are listed
// in arrival order (the order does not change any result: each row is
// computed on its own and the reduction sums a token's experts in top-k
// order).
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_kernel(const MoeParams p) {
  extern __shared__ int route_smem[];
  int* count = route_smem;                   // [E]
  int* cursor = route_smem + p.num_experts;  // [E]
  pdl_launch_dependents();
  pdl_wait_for_producer();

  const int num_experts = p.num_experts;
  const int slots = p.num_tokens * p.topk;
  int32_t* expert_offset =
      reinterpret_cast<int32_t*>(p.workspace + p.layout.expert_offset());
  int32_t* tile_offset =
      reinterpret_cast<int32_t*>(p.workspace + p.layout.tile_offset());
  int32_t* row_slot =
      reinterpret_cast<int32_t*>(p.workspace + p.layout.row_slot());
  int32_t* slot_row =
      reinterpret_cast<int32_t*>(p.workspace + p.layout.slot_row());

  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    const int e = local_expert(p, s);
    if (e >= 0) atomicAdd(&count[e], 1);
  }
  __syncthreads();

  // Exclusive prefix sums of rows and of 64-row tiles, by warp 0 (each lane
  // takes a contiguous run of experts).
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int per = (num_experts + 31) / 32;
    const int e0 = min(num_experts, lane * per);
    const int e1 = min(num_experts, e0 + per);
    int rows = 0, tiles = 0;
    for (int e = e0; e < e1; ++e) {
      rows += count[e];
      tiles += (count[e] + kTileM - 1) / kTileM;
    }
    int rows_incl = rows, tiles_incl = tiles;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int r = __shfl_up_sync(0xffffffffu, rows_incl, offset);
      const int t = __shfl_up_sync(0xffffffffu, tiles_incl, offset);
      if (lane >= offset) {
        rows_incl += r;
        tiles_incl += t;
      }
    }
    int row = rows_incl - rows, tile = tiles_incl - tiles;
    for (int e = e0; e < e1; ++e) {
      expert_offset[e] = row;
      tile_offset[e] = tile;
      cursor[e] = row;
      row += count[e];
      tile += (count[e] + kTileM - 1) / kTileM;
    }
    if (lane == 31) {
      expert_offset[num_experts] = rows_incl;
      tile_offset[num_experts] = tiles_incl;
    }
  }
  __syncthreads();

  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    const int e = local_expert(p, s);
    int row = -1;
    if (e >= 0) {
      row = atomicAdd(&cursor[e], 1);
      row_slot[row] = s;
    }
    slot_row[s] = row;
  }
}

// ---------------------------------------------------------------------------
// Quantize (16-bit inputs)
// ---------------------------------------------------------------------------

constexpr int kQuantWarps = 8;

// One warp per token; a lane holds 8 channels of each 256-channel chunk, so
// a 1 x 128 group is 16 lanes.
template <typename T>
__global__ void __launch_bounds__(kQuantWarps * 32)
    moe_quantize_kernel(const MoeParams p) {
  pdl_launch_dependents();
  pdl_wait_for_producer();
  const int lane = threadIdx.x % 32;
  const int token = blockIdx.x * kQuantWarps + threadIdx.x / 32;
  if (token >= p.num_tokens) return;
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

// ---------------------------------------------------------------------------
// Grouped FP8 GEMM
// ---------------------------------------------------------------------------

constexpr int kGemmThreads = 256;       // 8 warps: 2 along M x 4 along N
constexpr int kTileK = 64;              // bytes of K per stage
constexpr int kRowPitch = kTileK + 16;  // padded smem rows: conflict-free
constexpr int kGemmStages = 3;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem,
                                           bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;  // 0: zero-fill
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst),
               "l"(gmem), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void mma_fp8(float (&c)[4], const uint32_t (&a)[4],
                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ int find_expert(const int32_t* tile_offset,
                                           int num_experts, int tile) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_offset[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ __forceinline__ float silu(float x) {
  return x / (1.f + __expf(-x));
}

// kGateUp: the gate-up GEMM, whose CTA computes kCols columns of the
// intermediate (kCols gate rows and the matching kCols up rows of w13).
// Otherwise the down GEMM over kCols output channels.
template <bool kGateUp, int kCols>
__global__ void __launch_bounds__(kGemmThreads)
    moe_gemm_kernel(const MoeParams p) {
  constexpr int kRowsB = kGateUp ? 2 * kCols : kCols;  // B rows per CTA
  constexpr int kWarpCols = kCols / 4;  // columns (per half) of one warp
  constexpr int kHalfTiles = kWarpCols / 8;
  constexpr int kNt = kGateUp ? 2 * kHalfTiles : kHalfTiles;
  constexpr int kStageA = kTileM * kRowPitch;
  constexpr int kStageB = kRowsB * kRowPitch;
  extern __shared__ __align__(16) uint8_t gemm_smem[];
  __shared__ int row_amax[kTileM];

  pdl_launch_dependents();
  pdl_wait_for_producer();
  const int32_t* tile_offset =
      reinterpret_cast<const int32_t*>(p.workspace + p.layout.tile_offset());
  const int tile = blockIdx.x;
  if (tile >= tile_offset[p.num_experts]) return;
  const int expert = find_expert(tile_offset, p.num_experts, tile);
  const int32_t* expert_offset =
      reinterpret_cast<const int32_t*>(p.workspace + p.layout.expert_offset());
  const int32_t* row_slot =
      reinterpret_cast<const int32_t*>(p.workspace + p.layout.row_slot());
  const int row0 =
      expert_offset[expert] + (tile - tile_offset[expert]) * kTileM;
  const int row_end = expert_offset[expert + 1];
  const int n0 = blockIdx.y * kCols;
  const int K = kGateUp ? p.hidden : p.inter;

  // Operand sources.
  const bool fp8_input = p.input_type == ElemType::kFp8E4m3;
  const uint8_t* a_base;
  int64_t a_stride;
  if (kGateUp) {
    a_base = fp8_input ? static_cast<const uint8_t*>(p.input)
                       : p.workspace + p.layout.input_q();
    a_stride = fp8_input ? p.input_stride : p.hidden;
  } else {
    a_base = p.workspace + p.layout.inter_q();
    a_stride = p.inter;
  }
  const uint8_t* b_base = kGateUp
                              ? p.w13 + int64_t(expert) * 2 * p.inter * p.hidden
                              : p.w2 + int64_t(expert) * p.hidden * p.inter;

  // This thread's A row (one 16-byte chunk per stage) and B rows.
  const int a_row = threadIdx.x / 4;
  const int a_chunk = threadIdx.x % 4;
  const bool a_valid = row0 + a_row < row_end;
  int64_t a_src_row = 0;
  if (a_valid) {
    a_src_row = kGateUp ? row_slot[row0 + a_row] / p.topk : row0 + a_row;
  }
  const uint8_t* a_src = a_base + a_src_row * a_stride + a_chunk * 16;
  auto b_row_of = [&](int i) -> int64_t {
    if (!kGateUp) return n0 + i;
    return i < kCols ? n0 + i : p.inter + n0 + (i - kCols);
  };

  auto load_stage = [&](int stage, int k0) {
    uint8_t* sa = gemm_smem + stage * (kStageA + kStageB);
    uint8_t* sb = sa + kStageA;
    cp_async16(sa + a_row * kRowPitch + a_chunk * 16, a_src + k0, a_valid);
#pragma unroll
    for (int c = threadIdx.x; c < kRowsB * 4; c += kGemmThreads) {
      const int i = c / 4;
      cp_async16(sb + i * kRowPitch + (c % 4) * 16,
                 b_base + b_row_of(i) * K + k0 + (c % 4) * 16, true);
    }
  };

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int q4 = lane % 4;
  const int wm = warp / 4;  // 32-row half of the tile
  const int wn = warp % 4;
  // smem B row of n-tile j for this lane's column g.
  auto b_smem_row = [&](int j) {
    if (!kGateUp) return wn * kWarpCols + j * 8 + g;
    const int half = j / kHalfTiles;
    return half * kCols + wn * kWarpCols + (j % kHalfTiles) * 8 + g;
  };
  // Global B row (w13 / w2 row) of n-tile j, column 2q4 + c.
  auto b_global_row = [&](int j, int c) -> int64_t {
    if (!kGateUp) return n0 + wn * kWarpCols + j * 8 + 2 * q4 + c;
    const int half = j / kHalfTiles;
    return half * int64_t(p.inter) + n0 + wn * kWarpCols +
           (j % kHalfTiles) * 8 + 2 * q4 + c;
  };

  // Scale rows of this lane's four output rows (m-tile x {g, g + 8}).
  int64_t scale_row[2][2];
  bool row_live[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + wm * 32 + mt * 16 + h * 8 + g;
      row_live[mt][h] = r < row_end;
      scale_row[mt][h] = 0;
      if (row_live[mt][h]) {
        scale_row[mt][h] = kGateUp ? row_slot[r] / p.topk : r;
      }
    }
  }
  ScaleView a_scale;
  if (kGateUp) {
    if (p.block_wise) {
      a_scale = fp8_input ? ScaleView{p.a1_scale, p.a1_scale_stride, 1, 0}
                          : ScaleView{reinterpret_cast<const float*>(
                                          p.workspace + p.layout.input_scale()),
                                      p.hidden / kScaleBlock, 1, 0};
    } else if (p.a1_scale) {
      a_scale = ScaleView{p.a1_scale, 0, 0, 0};
    } else {
      a_scale = ScaleView{
          reinterpret_cast<const float*>(p.workspace + p.layout.input_scale()),
          p.hidden / kScaleBlock, 0, 0};
    }
  } else {
    a_scale = p.block_wise
                  ? ScaleView{reinterpret_cast<const float*>(
                                  p.workspace + p.layout.inter_scale()),
                              (p.inter + kScaleBlock - 1) / kScaleBlock, 1, 0}
                  : ScaleView{p.a2_scale, 0, 0, 0};
  }
  const ScaleView& w_scale = kGateUp ? p.w13_scale : p.w2_scale;

  float acc[2][kNt][4];
  float blk[2][kNt][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int j = 0; j < kNt; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = blk[mt][j][e] = 0.f;
    }
  }

  const int k_steps = K / kTileK;
#pragma unroll
  for (int s = 0; s < kGemmStages - 1; ++s) {
    if (s < k_steps) load_stage(s, s * kTileK);
    cp_async_commit();
  }
  for (int ks = 0; ks < k_steps; ++ks) {
    cp_async_wait<kGemmStages - 2>();
    __syncthreads();
    const int next = ks + kGemmStages - 1;
    if (next < k_steps) load_stage(next % kGemmStages, next * kTileK);
    cp_async_commit();

    const uint8_t* sa = gemm_smem + (ks % kGemmStages) * (kStageA + kStageB);
    const uint8_t* sb = sa + kStageA;
#pragma unroll
    for (int kk = 0; kk < kTileK / 32; ++kk) {
      uint32_t a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const uint8_t* base =
            sa + (wm * 32 + mt * 16 + g) * kRowPitch + kk * 32 + 4 * q4;
        a[mt][0] = *reinterpret_cast<const uint32_t*>(base);
        a[mt][1] = *reinterpret_cast<const uint32_t*>(base + 8 * kRowPitch);
        a[mt][2] = *reinterpret_cast<const uint32_t*>(base + 16);
        a[mt][3] =
            *reinterpret_cast<const uint32_t*>(base + 8 * kRowPitch + 16);
      }
#pragma unroll
      for (int j = 0; j < kNt; ++j) {
        const uint8_t* bp = sb + b_smem_row(j) * kRowPitch + kk * 32 + 4 * q4;
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(bp);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(bp + 16);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) mma_fp8(blk[mt][j], a[mt], b0, b1);
      }
    }

    // Fold the finished 128-deep k-block in with its scales.
    const int k_end = (ks + 1) * kTileK;
    if (k_end % kScaleBlock == 0 || k_end == K) {
      const int kb = (k_end - 1) / kScaleBlock;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int j = 0; j < kNt; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int h = e / 2;
            const float sa_v = a_scale.at(scale_row[mt][h], kb);
            const float sw =
                w_scale.at(expert, b_global_row(j, e % 2) / kScaleBlock, kb);
            acc[mt][j][e] += blk[mt][j][e] * sa_v * sw;
            blk[mt][j][e] = 0.f;
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  if constexpr (kGateUp) {
    // h = SiLU(gate) * up, quantized to FP8 for the down GEMM.
    float h[2][kHalfTiles][4];
    float amax[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int j = 0; j < kHalfTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          h[mt][j][e] = silu(acc[mt][j][e]) * acc[mt][j + kHalfTiles][e];
          amax[mt][e / 2] = fmaxf(amax[mt][e / 2], fabsf(h[mt][j][e]));
        }
      }
    }
    float inv[2][2];
    if (p.block_wise) {
      // kCols == 128: this CTA holds whole 1 x 128 groups of its rows.
      for (int i = threadIdx.x; i < kTileM; i += kGemmThreads) row_amax[i] = 0;
      __syncthreads();
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float m = amax[mt][hh];
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
          if (q4 == 0) {
            atomicMax(&row_amax[wm * 32 + mt * 16 + hh * 8 + g],
                      __float_as_int(m));
          }
        }
      }
      __syncthreads();
      float* inter_scale =
          reinterpret_cast<float*>(p.workspace + p.layout.inter_scale());
      const int groups = (p.inter + kScaleBlock - 1) / kScaleBlock;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int local = wm * 32 + mt * 16 + hh * 8 + g;
          const float m = __int_as_float(row_amax[local]);
          const float s = m > 0.f ? m / kFp8E4m3Max : 1.f;
          inv[mt][hh] = 1.f / s;
          if (wn == 0 && q4 == 0 && row_live[mt][hh]) {
            inter_scale[int64_t(row0 + local) * groups + n0 / kScaleBlock] = s;
          }
        }
      }
    } else {
      const float s = 1.f / *p.a2_scale;
      inv[0][0] = inv[0][1] = inv[1][0] = inv[1][1] = s;
    }
    uint8_t* inter = p.workspace + p.layout.inter_q();
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        if (!row_live[mt][hh]) continue;
        const int64_t r = row0 + wm * 32 + mt * 16 + hh * 8 + g;
#pragma unroll
        for (int j = 0; j < kHalfTiles; ++j) {
          const int col = n0 + wn * kWarpCols + j * 8 + 2 * q4;
          const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(
              make_float2(h[mt][j][2 * hh] * inv[mt][hh],
                          h[mt][j][2 * hh + 1] * inv[mt][hh]),
              __NV_SATFINITE, __NV_E4M3);
          *reinterpret_cast<__nv_fp8x2_storage_t*>(inter + r * p.inter + col) =
              pair;
        }
      }
    }
  } else {
    __nv_bfloat16* rows =
        reinterpret_cast<__nv_bfloat16*>(p.workspace + p.layout.down_rows());
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        if (!row_live[mt][hh]) continue;
        const int64_t r = row0 + wm * 32 + mt * 16 + hh * 8 + g;
#pragma unroll
        for (int j = 0; j < kNt; ++j) {
          const int col = n0 + wn * kWarpCols + j * 8 + 2 * q4;
          *reinterpret_cast<__nv_bfloat162*>(rows + r * p.hidden + col) =
              __floats2bfloat162_rn(acc[mt][j][2 * hh], acc[mt][j][2 * hh + 1]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Reduce
// ---------------------------------------------------------------------------

constexpr int kReduceThreads = 256;

// out[t] = sum_j w[t, j] * down_row(t, j) (+ shared[t]), in top-k order.
__global__ void __launch_bounds__(kReduceThreads)
    moe_reduce_kernel(const MoeParams p) {
  pdl_launch_dependents();
  pdl_wait_for_producer();
  const int token = blockIdx.x;
  const int32_t* slot_row =
      reinterpret_cast<const int32_t*>(p.workspace + p.layout.slot_row());
  const __nv_bfloat16* rows = reinterpret_cast<const __nv_bfloat16*>(
      p.workspace + p.layout.down_rows());
  for (int c = threadIdx.x * 8; c < p.hidden; c += kReduceThreads * 8) {
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
    for (int j = 0; j < p.topk; ++j) {
      const int slot = token * p.topk + j;
      const int r = slot_row[slot];
      if (r < 0) continue;
      const float w = p.router_weight_on_input ? 1.f : p.topk_weights[slot];
      float v[8];
      load8(rows + int64_t(r) * p.hidden + c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += w * v[i];
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
