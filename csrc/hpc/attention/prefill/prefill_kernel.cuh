// The paged prefill kernel: wiring of the producer (prefill_load.cuh), the
// consumer mainloop (prefill_mainloop.cuh), the epilogue
// (prefill_epilogue.cuh) and the tile scheduler (prefill_tile_scheduler.cuh).
//
// Persistent CTAs of three warpgroups: the producer warpgroup gives up
// registers and fills the pipeline (warp 0 copies; for FP8 caches warps
// 1..3 transpose V and quantize 16-bit queries); the two consumer
// warpgroups take the registers and compute 64 rows each of every 128-row
// query tile.
#pragma once

#include <cuda.h>

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cute/arch/copy_sm90_desc.hpp>

#include "attention/prefill/prefill_config.cuh"
#include "attention/prefill/prefill_epilogue.cuh"
#include "attention/prefill/prefill_load.cuh"
#include "attention/prefill/prefill_mainloop.cuh"
#include "attention/prefill/prefill_params.h"
#include "attention/prefill/prefill_pipeline.cuh"
#include "attention/prefill/prefill_tile_scheduler.cuh"
#include "common/paged_cache_view.h"
#include "common/pdl.cuh"
#include "common/shared_memory.cuh"

namespace hpc {
namespace prefill {

template <class Config>
__global__ void __launch_bounds__(kPrefillThreads, 1)
    prefill_kernel(const __grid_constant__ PrefillParams p,
                   const __grid_constant__ PrefillSources src) {
  using namespace cute;
  extern __shared__ uint8_t prefill_smem_raw[];
  uint8_t* smem = align_shared<1024>(prefill_smem_raw);
  __shared__ typename Config::Barriers bar;

  const bool producer = threadIdx.x < kProducerThreads;
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(&src.q_map);
    prefetch_tma_descriptor(&src.k_map);
    prefetch_tma_descriptor(&src.v_map);
    bar.init(Config::quantizes_queries(p) ? kTransposeWarps : 1,
             Config::kFp8 ? kTransposeWarps : 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // The plan, the queries and the cache are written by earlier kernels.
  pdl_wait_for_producer();
  pdl_launch_dependents();
  // The kernel's row packing comes from the launch; a plan made for
  // another group size would be walked wrongly, so fail loudly.
  if (p.plan[kTileTokens] != p.tile_tokens) __trap();

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
    if (threadIdx.x < 32) {
      load_tiles<Config>(p, src, smem, bar);
    } else if constexpr (Config::kFp8) {
      transpose_tiles<Config>(p, smem, bar);
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
  typename Config::TiledMmaPV mma_pv;
  Tensor acc_o = partition_fragment_C(
      mma_pv, Shape<Int<Config::kBlockM>, Int<Config::kHeadDim>>{});
  // This thread's two rows of the tile (row halves 0 and 1) in the wgmma
  // accumulator layout: warpgroup w, warp v, lane l hold rows
  // 64 w + 16 v + l / 4 and that + 8.
  const int tid = threadIdx.x - kProducerThreads;
  const int rows[2] = {(tid / 32) * 16 + (tid % 32) / 4,
                       (tid / 32) * 16 + (tid % 32) / 4 + 8};

  TileScheduler<Config::kBlockN> scheduler(p);
  TileWork w;
  typename Config::Pipeline pos;
  typename Config::Softmax softmax;
  const WarpgroupTurns<Config::kTakeTurns> turns{tid / 128};
  turns.start();
  while (scheduler.next(w)) {
    RowInfo info = row_info(p, w, rows);
    if (w.empty()) {
      clear(acc_o);
      softmax.reset();
    } else {
      mma_tile<Config>(p, w, info, smem, bar, pos, turns, acc_o, softmax);
    }
    store_tile<Config>(p, info, acc_o, softmax);
  }
  turns.finish();
}

}  // namespace prefill
}  // namespace hpc
