// The grouped FP8 GEMM kernel of the fused MoE pipeline: tile lookup, the
// producer / consumer split of moe_gemm.cuh and the epilogues of
// moe_gemm_epilogue.cuh. Grid: x = group of column blocks x split index
// (gate-up) or group of row blocks (down), y = token tile; CTAs past the
// tiles of this call return. Config: GemmConfig (token tile, CTAs per SM).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>

#include "common/cluster.cuh"
#include "common/pdl.cuh"
#include "common/shared_memory.cuh"
#include "moe/moe_gemm.cuh"
#include "moe/moe_gemm_epilogue.cuh"
#include "moe/moe_params.h"
#include "moe/moe_tiles.cuh"

namespace hpc {
namespace moe {

// Whether the tile may be found before this kernel's PDL wait. Every stage
// lets its dependents launch only after its own wait, so when a kernel
// starts, the stage two before it is complete: the route (or, with slot
// tiles, the router that wrote the ids), for the down GEMM always, for the
// gate-up GEMM when the quantize stage ran between.
template <bool kGateUp>
__device__ __forceinline__ bool tile_source_complete(const MoeParams& p) {
  return !kGateUp || quantize_stage_runs(p);
}

// kGateUp: the gate-up GEMM (weights: the 4-D map of w13 as
// [E][gate|up][I][H]); otherwise the down GEMM (w2 as [E][1][H][I]).
template <bool kGateUp, class Config>
__global__ void __launch_bounds__(Config::kThreads, Config::kCtasPerSm)
    moe_gemm_kernel(const __grid_constant__ MoeParams p,
                    const __grid_constant__ CUtensorMap weights,
                    const __grid_constant__ CUtensorMap token_rows) {
  using namespace cute;
  constexpr int kTokens = Config::kTokens;
  static_assert(Config::kThreads >= kSlotTilesMaxSlots);  // find_slot_tile()
  extern __shared__ uint8_t gemm_smem_raw[];
  uint8_t* smem = align_shared<1024>(gemm_smem_raw);
  __shared__ uint64_t full[Config::kStages];
  __shared__ uint64_t empty[Config::kStages];
  __shared__ int64_t token_src[kTokens];
  __shared__ int tile_rows[kTokens];
  __shared__ float tile_scale[kTokens];
  __shared__ SplitBarriers split_barriers;

  const int warp = threadIdx.x / 32;
  const bool tma_thread = threadIdx.x == kConsumerThreads;
  // Gate-up with split K: the split CTAs of a tile are one cluster.
  const int split = kGateUp ? p.tiling.gate_up_split : 1;
  // The down GEMM's routed tiles are consecutive rows of the intermediate:
  // their token rows come by TMA with the weights.
  const CUtensorMap* tma_tokens =
      !kGateUp && !p.tiling.slot_tiles ? &token_rows : nullptr;
  if (tma_thread) {
    prefetch_tma_descriptor(&weights);
    if (tma_tokens) prefetch_tma_descriptor(tma_tokens);
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < Config::kStages; ++s) {
      // The weights' expect_tx, the TMA token rows' one more, and the
      // producer's cp.async arrivals (threads_copy_stages()).
      FullBarrier::init(&full[s],
                        (tma_tokens ? 2 : 1) +
                            (threads_copy_stages<Config>(tma_tokens != nullptr)
                                 ? Config::kCopyThreads
                                 : 0));
      EmptyBarrier::init(&empty[s], kConsumerThreads / 32);
    }
    if (split > 1) {
      EmptyBarrier::init(&split_barriers.stages_free, 1);
      EmptyBarrier::init(&split_barriers.partials_ready,
                         (split - 1) * kConsumerThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // barriers initialized before the producer's first copy
  if (split > 1) cluster_sync();  // ... and before any remote arrival

  // Gate-up: x = group of column blocks x K split (one of them is 1).
  // Down: x = group of row blocks.
  WorkRange range;
  if constexpr (kGateUp) {
    const int k_blocks = ceil_div(p.hidden, kTileK);
    const int split_index = blockIdx.x % split;
    range.block_begin = blockIdx.x / split * p.tiling.gate_up_group;
    range.block_end = min(range.block_begin + p.tiling.gate_up_group,
                          p.tiling.gate_up_blocks);
    range.kb_begin = split_index * k_blocks / split;
    range.kb_end = (split_index + 1) * k_blocks / split;
  } else {
    range.block_begin = blockIdx.x * p.tiling.down_group;
    range.block_end =
        min(range.block_begin + p.tiling.down_group, p.tiling.down_blocks);
    range.kb_begin = 0;
    range.kb_end = ceil_div(p.inter, kTileK);
  }

  // The weights need only the tile: their first stages go out as soon as it
  // is known, before the PDL wait where the route's tables allow.
  TileInfo tile;
  bool has_tile = false;
  auto find_tile_and_load_weights = [&] {
    has_tile = find_tile<kTokens>(p, tile, tile_rows);
    if (has_tile && tma_thread) {
      for (int i = 0; i < min(range.size(), Config::kStages); ++i) {
        load_weights<kGateUp, Config>(
            p, &weights, tile, block_row<kGateUp, Config>(range.block(i)),
            range.kb(i), i, full, smem);
      }
    }
  };
  const bool early = tile_source_complete<kGateUp>(p);
  if (early) find_tile_and_load_weights();
  // Every CTA waits, even one without a tile: a grid whose CTAs all left
  // before waiting would let its dependents run ahead of its producer.
  pdl_wait_for_producer();
  pdl_launch_dependents();
  if (!early) find_tile_and_load_weights();
  if (!has_tile) return;

  for (int t = threadIdx.x; t < kTokens; t += Config::kThreads) {
    token_src[t] =
        t < tile.rows ? TokenSource<kGateUp>::row_of(p, tile_rows[t]) : 0;
  }
  __syncthreads();

  // The producer: a warp, or a warpgroup that hands its registers over to
  // the consumers; all of it copies (GemmConfig::kCopyThreads).
  if (warp >= kConsumerThreads / 32) {
    if constexpr (Config::kProducerWarpgroup) {
      cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
    }
    load_stages<kGateUp, Config>(p, &weights, tma_tokens, tile, token_src,
                                 range, smem, full, empty);
    if (kTokens == kMinTokenTile && split > 1) {
      leave_split_cluster();  // beside merge_split_k()'s threads
    }
    return;
  }
  if constexpr (Config::kProducerWarpgroup) {
    cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
  }

  typename Config::TiledMma mma;
  auto thr = mma.get_thread_slice(threadIdx.x % 128);
  const auto tile_shape = make_shape(Int<Config::kWgRows>{}, Int<kTokens>{});
  Tensor acc = partition_fragment_C(mma, tile_shape);
  const Tensor coord = thr.partition_C(make_identity_tensor(tile_shape));
  int stage = 0;
  uint32_t phase = 0;
  // Read now, behind this CTA's first weight copies: in the epilogue the
  // load would wait for all the copies its SM then has in flight.
  const float inter_scale = kGateUp && !p.block_wise ? *p.a2_scale : 1.f;
  if (scales_once<Config>(p)) {
    load_tile_scales<kGateUp, kTokens>(p, tile, token_src, tile_scale);
  }
  for (int block = range.block_begin; block < range.block_end; ++block) {
    const int n0 = block_row<kGateUp, Config>(block);
    mma_stages<kGateUp, Config>(p, tile, n0, token_src, tile_scale,
                                range.kb_begin, range.kb_end, smem, full, empty,
                                acc, coord, stage, phase);
    if constexpr (kGateUp) {
      if constexpr (kTokens == kMinTokenTile) {
        // The leader's stage buffers hold the others' partial sums.
        static_assert((kMaxSplit - 1) * kCtaRows * kMinTokenTile *
                          sizeof(float) <=
                      Config::kWeightBytes);
        if (split > 1 && !merge_split_k(split, blockIdx.x % split, acc, smem,
                                        &split_barriers)) {
          return;
        }
      }
      if constexpr (Config::kWide) {
        gate_up_epilogue_wide<kTokens, Config::kWgRows>(
            p, tile, tile_rows, n0, inter_scale, acc, coord, smem);
      } else {
        gate_up_epilogue<kTokens, Config::kScaling>(
            p, tile, tile_rows, n0, inter_scale, acc, coord,
            smem + Config::kStagingOffset);
      }
    } else {
      down_epilogue<kTokens>(p, tile, tile_rows, n0, acc, coord,
                             smem + Config::kStagingOffset);
    }
  }
}

}  // namespace moe
}  // namespace hpc
