// Route stage of the fused FP8 MoE pipeline: one CTA builds the per-expert
// row counts, row offsets and token-tile offsets in shared memory, then the
// expert-sorted row list (sorted row -> slot) and its inverse.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/pdl.cuh"
#include "moe/moe_params.h"

namespace hpc {
namespace moe {

constexpr int kRouteThreads = 1024;
// Slots a route thread looks up before it uses any: their loads (the
// router's id, then the expert map's entry) overlap instead of each
// iteration waiting a memory round trip. 4096 tokens at top-8 are 32 slots
// a thread.
constexpr int kRouteSlotBatch = 8;

// f(slot, local expert or -1) for every slot, the slots of a thread in
// batches of kRouteSlotBatch whose experts are all loaded first.
template <class F>
__device__ __forceinline__ void for_each_slot(const MoeParams& p, int slots,
                                              F&& f) {
  constexpr int kStride = kRouteSlotBatch * kRouteThreads;
  for (int base = threadIdx.x; base < slots; base += kStride) {
    int e[kRouteSlotBatch];
#pragma unroll
    for (int b = 0; b < kRouteSlotBatch; ++b) {
      const int s = base + b * kRouteThreads;
      e[b] = s < slots ? local_expert(p, s) : -1;
    }
#pragma unroll
    for (int b = 0; b < kRouteSlotBatch; ++b) {
      const int s = base + b * kRouteThreads;
      if (s < slots) f(s, e[b]);
    }
  }
}

// Counts and offsets live in shared memory; rows of one expert are listed
// in arrival order (the order does not change any result: each row is
// computed on its own and the reduction sums a token's experts in top-k
// order).
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_kernel(const MoeParams p) {
  extern __shared__ int route_smem[];
  int* count = route_smem;                           // [E]
  int* cursor = route_smem + p.num_experts;          // [E]: next sorted row
  int* first_tile = route_smem + 2 * p.num_experts;  // [E]
  // The previous call's stages read these tables: wait for them. Dependents
  // launch only after the wait (see moe_gemm_kernel.cuh).
  pdl_wait_for_producer();
  pdl_launch_dependents();

  const int num_experts = p.num_experts;
  const int tile_rows = p.tiling.token_tile;
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
  for_each_slot(p, slots, [&](int, int e) {
    if (e >= 0) atomicAdd(&count[e], 1);
  });
  __syncthreads();

  // Exclusive prefix sums of rows and of token tiles, by warp 0 (each lane
  // takes a contiguous run of experts).
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int per = (num_experts + 31) / 32;
    const int e0 = min(num_experts, lane * per);
    const int e1 = min(num_experts, e0 + per);
    int rows = 0, tiles = 0;
    for (int e = e0; e < e1; ++e) {
      rows += count[e];
      tiles += (count[e] + tile_rows - 1) / tile_rows;
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
      first_tile[e] = tile;
      row += count[e];
      tile += (count[e] + tile_rows - 1) / tile_rows;
    }
    if (lane == 31) {
      expert_offset[num_experts] = rows_incl;
      tile_offset[num_experts] = tiles_incl;
    }
  }
  __syncthreads();

  // The GEMMs' tile table: one entry per token tile.
  TileInfo* infos =
      reinterpret_cast<TileInfo*>(p.workspace + p.layout.tile_info());
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    const int end = cursor[e] + count[e];
    for (int t = 0, row = cursor[e]; row < end; ++t, row += tile_rows) {
      infos[first_tile[e] + t] = TileInfo{e, row, min(tile_rows, end - row), 0};
    }
  }
  __syncthreads();  // cursor[] is advanced below

  for_each_slot(p, slots, [&](int s, int e) {
    int row = -1;
    if (e >= 0) {
      row = atomicAdd(&cursor[e], 1);
      row_slot[row] = s;
    }
    slot_row[s] = row;
  });
}

}  // namespace moe
}  // namespace hpc
