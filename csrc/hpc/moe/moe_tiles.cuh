// How a grouped-GEMM CTA finds its token tile: the expert and the rows it
// takes. A row is an index into the intermediate and the down rows (and,
// for the gate-up GEMM, names the token it reads).
//
//   route table   the route stage sorted the routed slots by expert and cut
//                 each expert's rows into tiles (moe_route.cuh); a tile's
//                 rows are consecutive sorted rows
//   slot tiles    a small batch has no route stage (moe_tiling.h): every CTA
//                 reads the router's ids and numbers the tiles itself, in
//                 the order of their first slot; a row is a slot
//                 (token * topk + j), and a tile's rows are its expert's
//                 slots in slot order
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moe/moe_params.h"

namespace hpc {
namespace moe {

// Tile `index` from the route's table; false when the launch's tile bound
// exceeds the tiles this call needs. Both loads go out together.
__device__ __forceinline__ bool find_routed_tile(const MoeParams& p, int index,
                                                 TileInfo& tile) {
  const int32_t* tile_offset =
      reinterpret_cast<const int32_t*>(p.workspace + p.layout.tile_offset());
  const TileInfo* infos =
      reinterpret_cast<const TileInfo*>(p.workspace + p.layout.tile_info());
  // Through L2 only: the table may be read before the kernel's PDL wait
  // (moe_gemm_kernel.cuh), and an SM's L1 may hold the previous call's.
  const int tiles = __ldcg(tile_offset + p.num_experts);
  const int4 raw = __ldcg(reinterpret_cast<const int4*>(infos + index));
  tile = TileInfo{raw.x, raw.y, raw.z, raw.w};  // in the buffer past `tiles`
  return index < tiles;
}

// Tile `index` of a slot-tiled call, by the whole CTA (CTA barriers; every
// thread calls it, with blockDim.x >= kSlotTilesMaxSlots). A slot's rank is
// its place among its expert's slots; ranks 0, width, 2 width, ... open a
// tile. The tiles are numbered by their opening slot.
__device__ __forceinline__ bool find_slot_tile(const MoeParams& p, int index,
                                               int width, TileInfo& tile,
                                               int* rows) {
  __shared__ int expert_of[kSlotTilesMaxSlots];
  __shared__ int warp_tiles[32];
  __shared__ TileInfo found;  // row0: -1, a slot tile's rows are `rows`
  __shared__ int found_rank;  // the rank of the tile's first slot
  const int slots = p.num_tokens * p.topk;  // <= kSlotTilesMaxSlots
  const int t = threadIdx.x;
  const int lane = t % 32;
  if (t < slots) expert_of[t] = local_expert(p, t);
  if (t == 0) found = TileInfo{-1, -1, 0, 0};
  __syncthreads();
  const int expert = t < slots ? expert_of[t] : -1;
  int rank = 0;
  if (expert >= 0) {
#pragma unroll 8
    for (int s = 0; s < t; ++s) rank += expert_of[s] == expert;
  }
  const bool opens = expert >= 0 && rank % width == 0;
  const unsigned ballot = __ballot_sync(0xffffffffu, opens);
  if (lane == 0) warp_tiles[t / 32] = __popc(ballot);
  __syncthreads();
  int number = __popc(ballot & ((1u << lane) - 1));
  for (int w = 0; w < t / 32; ++w) number += warp_tiles[w];
  if (opens && number == index) {
    found.expert = expert;
    found_rank = rank;
  }
  __syncthreads();
  if (found.expert < 0) return false;  // uniform over the CTA
  const int first_rank = found_rank;
  if (expert == found.expert && rank >= first_rank &&
      rank < first_rank + width) {
    rows[rank - first_rank] = t;
    atomicAdd(&found.rows, 1);
  }
  __syncthreads();
  tile = found;
  return true;
}

// The CTA's tile (grid y) and its rows [kTokens], either way; false when
// the launch's tile bound exceeds this call's tiles. Every thread calls it.
template <int kTokens>
__device__ __forceinline__ bool find_tile(const MoeParams& p, TileInfo& tile,
                                          int* rows) {
  if (p.tiling.slot_tiles) {
    return find_slot_tile(p, blockIdx.y, kTokens, tile, rows);
  }
  const bool found = find_routed_tile(p, blockIdx.y, tile);
  // Each thread below kTokens writes the row it reads first.
  if (threadIdx.x < kTokens) rows[threadIdx.x] = tile.row0 + threadIdx.x;
  return found;
}

}  // namespace moe
}  // namespace hpc
