// Route stage of the fused FP8 MoE pipeline: the expert-sorted row list
// (sorted row -> slot), its inverse, the per-expert row and token-tile
// offsets and the GEMMs' tile table, by two kernels over the routed slots
// (token * topk + j), each CTA taking kRouteSlotsPerCta consecutive ones:
//
//   count  a CTA counts its slots per local expert in shared memory, numbers
//          each slot within its (CTA, expert) and writes its counts
//   place  a CTA sums every CTA's counts into the experts' offsets, adds
//          the counts of the CTAs before it and writes its slots' sorted
//          rows; CTA 0 writes the offsets and the tile table
//
// Slots that one CTA takes need no count kernel: the place kernel's one CTA
// counts them itself and keeps the numbers in registers.
//
// Spread over CTAs because one CTA for a whole prefill batch is bound by
// its SM's shared atomics and scattered stores. Rows of one expert are listed
// CTA by CTA, within a CTA in arrival order: the order does not change any
// result (each row is computed on its own and the reduction sums a token's
// experts in top-k order).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/pdl.cuh"
#include "moe/moe_params.h"

namespace hpc {
namespace moe {

// A slot's expert and its number within its (CTA, expert), as the count
// kernel leaves them in the slot -> row array for the place kernel.
constexpr int kRouteRankBits = 11;
static_assert(kRouteSlotsPerCta <= (1 << kRouteRankBits));

// Slot `b` of this thread's kRouteSlotBatch (it may lie past the slots).
__device__ __forceinline__ int route_slot(int b) {
  return blockIdx.x * kRouteSlotsPerCta + b * kRouteThreads + threadIdx.x;
}

// Counts this CTA's slots per local expert into `count` (shared, [E]) and
// numbers each within its expert: numbered[b] = expert << kRouteRankBits |
// number, or -1 (no local expert, or past the slots). A thread takes
// kRouteSlotBatch slots and loads all their experts first: the loads (the
// router's id, then the expert map's entry) overlap instead of each waiting
// a round trip.
__device__ __forceinline__ void count_cta_slots(
    const MoeParams& p, int* count, int (&numbered)[kRouteSlotBatch]) {
  for (int e = threadIdx.x; e < p.num_experts; e += kRouteThreads) {
    count[e] = 0;
  }
  __syncthreads();
  const int slots = p.num_tokens * p.topk;
  int expert[kRouteSlotBatch];
#pragma unroll
  for (int b = 0; b < kRouteSlotBatch; ++b) {
    const int s = route_slot(b);
    expert[b] = s < slots ? local_expert(p, s) : -1;
  }
#pragma unroll
  for (int b = 0; b < kRouteSlotBatch; ++b) {
    const int e = expert[b];
    numbered[b] = e >= 0 ? (e << kRouteRankBits) | atomicAdd(&count[e], 1) : -1;
  }
  __syncthreads();
}

// Launched only when the slots take more than one CTA (moe.cu).
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_count_kernel(const MoeParams p) {
  extern __shared__ int route_smem[];
  int* count = route_smem;  // [E]
  // The previous call's stages read the tables this stage writes: wait for
  // them. Dependents launch only after the wait (see moe_gemm_kernel.cuh).
  pdl_wait_for_producer();
  pdl_launch_dependents();

  int numbered[kRouteSlotBatch];
  count_cta_slots(p, count, numbered);
  int32_t* slot_row =
      reinterpret_cast<int32_t*>(p.workspace + p.layout.slot_row());
  const int slots = p.num_tokens * p.topk;
#pragma unroll
  for (int b = 0; b < kRouteSlotBatch; ++b) {
    const int s = route_slot(b);
    if (s < slots) slot_row[s] = numbered[b];
  }
  int32_t* counts = reinterpret_cast<int32_t*>(
      p.workspace + p.layout.route_counts() +
      sizeof(int32_t) * int64_t(blockIdx.x) * p.num_experts);
  for (int e = threadIdx.x; e < p.num_experts; e += kRouteThreads) {
    counts[e] = count[e];
  }
}

__global__ void __launch_bounds__(kRouteThreads)
    moe_route_place_kernel(const MoeParams p) {
  extern __shared__ int route_smem[];
  const int num_experts = p.num_experts;
  int* total = route_smem;                         // [E]: rows, all CTAs
  int* base = route_smem + num_experts;            // [E]: this CTA's first
  int* first_tile = route_smem + 2 * num_experts;  // [E]
  // The count kernel's counts and numbers, or with one CTA (no count
  // kernel) the previous call's readers of the tables.
  pdl_wait_for_producer();
  pdl_launch_dependents();

  const int tile_rows = p.tiling.token_tile;
  int32_t* slot_row =
      reinterpret_cast<int32_t*>(p.workspace + p.layout.slot_row());
  const int slots = p.num_tokens * p.topk;
  int numbered[kRouteSlotBatch];
  if (gridDim.x == 1) {
    count_cta_slots(p, total, numbered);
    for (int e = threadIdx.x; e < num_experts; e += kRouteThreads) base[e] = 0;
  } else {
    const int32_t* counts =
        reinterpret_cast<const int32_t*>(p.workspace + p.layout.route_counts());
    // Written by the count kernel, maybe on another SM: read through L2.
    for (int e = threadIdx.x; e < num_experts; e += kRouteThreads) {
      int all = 0, before = 0;
      for (int g = 0; g < static_cast<int>(gridDim.x); ++g) {
        const int c = __ldcg(counts + int64_t(g) * num_experts + e);
        all += c;
        if (g < static_cast<int>(blockIdx.x)) before += c;
      }
      total[e] = all;
      base[e] = before;
    }
#pragma unroll
    for (int b = 0; b < kRouteSlotBatch; ++b) {
      const int s = route_slot(b);
      numbered[b] = s < slots ? __ldcg(slot_row + s) : -1;
    }
  }
  __syncthreads();

  // Exclusive prefix sums of rows and of token tiles over the experts, by
  // warp 0 (each lane takes a contiguous run of experts).
  const bool writes_tables = blockIdx.x == 0;
  int32_t* expert_offset =
      reinterpret_cast<int32_t*>(p.workspace + p.layout.expert_offset());
  int32_t* tile_offset =
      reinterpret_cast<int32_t*>(p.workspace + p.layout.tile_offset());
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int per = (num_experts + 31) / 32;
    const int e0 = min(num_experts, lane * per);
    const int e1 = min(num_experts, e0 + per);
    int rows = 0, tiles = 0;
    for (int e = e0; e < e1; ++e) {
      rows += total[e];
      tiles += (total[e] + tile_rows - 1) / tile_rows;
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
      if (writes_tables) {
        expert_offset[e] = row;
        tile_offset[e] = tile;
      }
      base[e] += row;
      first_tile[e] = tile;
      row += total[e];
      tile += (total[e] + tile_rows - 1) / tile_rows;
    }
    if (writes_tables && lane == 31) {
      expert_offset[num_experts] = rows_incl;
      tile_offset[num_experts] = tiles_incl;
    }
  }
  __syncthreads();

  if (writes_tables) {
    // The GEMMs' tile table, one entry per token tile. No CTA comes before
    // this one: base[] is each expert's first row.
    TileInfo* infos =
        reinterpret_cast<TileInfo*>(p.workspace + p.layout.tile_info());
    for (int e = threadIdx.x; e < num_experts; e += kRouteThreads) {
      const int end = base[e] + total[e];
      for (int t = 0, row = base[e]; row < end; ++t, row += tile_rows) {
        infos[first_tile[e] + t] =
            TileInfo{e, row, min(tile_rows, end - row), 0};
      }
    }
  }

  int32_t* row_slot =
      reinterpret_cast<int32_t*>(p.workspace + p.layout.row_slot());
#pragma unroll
  for (int b = 0; b < kRouteSlotBatch; ++b) {
    const int s = route_slot(b);
    if (s >= slots) continue;
    int row = -1;
    if (numbered[b] >= 0) {
      row = base[numbered[b] >> kRouteRankBits] +
            (numbered[b] & ((1 << kRouteRankBits) - 1));
      row_slot[row] = s;
    }
    slot_row[s] = row;
  }
}

}  // namespace moe
}  // namespace hpc
