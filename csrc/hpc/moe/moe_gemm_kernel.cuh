// The grouped FP8 GEMM kernel of the fused MoE pipeline: tile lookup, the
// producer / consumer split of moe_gemm.cuh and the epilogues of
// moe_gemm_epilogue.cuh. Grid: x = token tile, y = column block (x split
// index for the gate-up GEMM); CTAs past the tiles of this call return.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cutlass/arch/barrier.h>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>

#include "common/pdl.cuh"
#include "moe/moe_gemm.cuh"
#include "moe/moe_gemm_epilogue.cuh"
#include "moe/moe_params.h"

namespace hpc {
namespace moe {

// kGateUp: the gate-up GEMM (weights: the 4-D map of w13 as
// [E][gate|up][I][H]); otherwise the down GEMM (w2 as [E][1][H][I]).
template <bool kGateUp, int kTokens>
__global__ void __launch_bounds__(kGemmThreads, GemmConfig<kTokens>::kCtasPerSm)
    moe_gemm_kernel(const __grid_constant__ MoeParams p,
                    const __grid_constant__ CUtensorMap weights) {
  using namespace cute;
  using Config = GemmConfig<kTokens>;
  extern __shared__ uint8_t gemm_smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(gemm_smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ uint64_t full[Config::kStages];
  __shared__ uint64_t empty[Config::kStages];
  __shared__ int64_t token_src[kTokens];
  __shared__ int last_split;

  const int warp = threadIdx.x / 32;
  if (threadIdx.x == kConsumerThreads) prefetch_tma_descriptor(&weights);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < Config::kStages; ++s) {
      FullBarrier::init(&full[s], 1 + 32);  // expect_tx + producer lanes
      EmptyBarrier::init(&empty[s], kConsumerThreads / 32);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // barriers initialized before the producer's first copy
  pdl_launch_dependents();
  // The route tables and the quantized operands come from earlier stages.
  pdl_wait_for_producer();
  TileInfo tile;
  if (!find_tile(p, blockIdx.x, tile)) return;

  const int split = kGateUp ? p.tiling.gate_up_split : 1;
  const int block = blockIdx.y / split;
  const int split_index = blockIdx.y % split;
  const int n0 = block * (kGateUp ? kWgRows : kCtaRows);
  const int k_blocks = ceil_div(kGateUp ? p.hidden : p.inter, kTileK);
  const int kb_begin = split_index * k_blocks / split;
  const int kb_end = (split_index + 1) * k_blocks / split;
  if (threadIdx.x == kConsumerThreads) {
    // The weights need only the tile: their first stages go out now, while
    // the token rows are looked up.
    for (int kb = kb_begin; kb < min(kb_end, kb_begin + Config::kStages);
         ++kb) {
      load_weights<kGateUp, kTokens>(p, &weights, tile, n0, kb, kb - kb_begin,
                                     full, smem);
    }
  }
  for (int t = threadIdx.x; t < kTokens; t += kGemmThreads) {
    token_src[t] =
        t < tile.rows ? TokenSource<kGateUp>::row_of(p, tile.row0 + t) : 0;
  }
  __syncthreads();

  if (warp == kConsumerThreads / 32) {
    load_stages<kGateUp, kTokens>(p, &weights, tile, n0, token_src, kb_begin,
                                  kb_end, smem, full, empty);
    return;
  }

  typename Config::TiledMma mma;
  auto thr = mma.get_thread_slice(threadIdx.x % 128);
  const auto tile_shape = make_shape(Int<kWgRows>{}, Int<kTokens>{});
  Tensor acc = partition_fragment_C(mma, tile_shape);
  const Tensor coord = thr.partition_C(make_identity_tensor(tile_shape));
  mma_stages<kGateUp, kTokens>(p, tile, n0, token_src, kb_begin, kb_end, smem,
                               full, empty, acc, coord);

  if constexpr (kGateUp) {
    if constexpr (kTokens == kMinTokenTile) {
      if (split > 1) {
        const int out_tile = blockIdx.x * p.tiling.gate_up_blocks + block;
        if (!merge_split_k(p, out_tile, split_index, acc, &last_split)) return;
      }
    }
    gate_up_epilogue<kTokens>(p, tile, n0, acc, coord, smem);
  } else {
    down_epilogue<kTokens>(p, tile, n0, acc, coord, smem);
  }
}

}  // namespace moe
}  // namespace hpc
