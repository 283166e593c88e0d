// The split-KV paged decode kernel: wiring of the producer
// (decode_load.cuh), the consumer mainloop (decode_mainloop.cuh), the
// epilogue (decode_epilogue.cuh) and the merge of split units
// (combine.cuh), over the CTA's work items (decode_work.cuh).
//
// Persistent CTAs walk the plan (decode_plan.h): each takes a contiguous
// run of granules and turns it into work items, one per (unit, tile
// range). A unit is one KV head of one sequence; its rows are the query
// heads of that KV head times the query tokens (up to 64). The products
// run swap-AB on wgmma: the 64 keys of a KV tile are the M side and the
// unit's rows the N side (decode_config.cuh). A unit that is not split
// writes its output directly; a piece of a split unit writes fp32 O and
// LSE rows, which the CTAs whose last item is one of the unit's pieces
// merge together once every piece is in (or the CTA that finishes the
// last piece alone; combine.cuh).
//
// One persistent CTA per SM of three warpgroups: the producer warpgroup
// gives up registers (warp 0 copies; warps 1..3 zero the outputs of empty
// units, then for FP8 caches transpose V); the two consumer warpgroups
// take them and compute
// (decode_config.cuh). The unit's queries are loaded into shared
// memory by the consumers at the start of each work item.
#pragma once

#include <cuda.h>

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/tensor.hpp>

#include "attention/common/named_barriers.h"
#include "attention/decode/combine.cuh"
#include "attention/decode/decode_config.cuh"
#include "attention/decode/decode_epilogue.cuh"
#include "attention/decode/decode_load.cuh"
#include "attention/decode/decode_mainloop.cuh"
#include "attention/decode/decode_params.h"
#include "attention/decode/decode_work.cuh"
#include "common/pdl.cuh"
#include "common/shared_memory.cuh"
#include "common/sync.cuh"

namespace hpc {
namespace decode {

// Persistent CTAs per SM: one, whose warpgroups' register budgets after
// reallocation (DecodeConfig::kProducerRegs, kConsumerRegs) take the SM's
// register file.
constexpr int kDecodeCtasPerSm = 1;

template <class Config>
__global__ void __launch_bounds__(kWgmmaThreads, kDecodeCtasPerSm)
    decode_kernel(const __grid_constant__ DecodeParams p,
                  const __grid_constant__ CUtensorMap k_map,
                  const __grid_constant__ CUtensorMap v_map) {
  using namespace cute;
  extern __shared__ uint8_t decode_smem_raw[];
  uint8_t* smem = align_shared<1024>(decode_smem_raw);
  __shared__ DecodeBarriers<Config> bar;
  // The item's mergers (WorkItem::mergers), which only its merge reads: kept
  // here through the mainloop rather than in a register there (with it in a
  // register, the 16-bit 8-row tile loop compiles to 748 instructions
  // instead of 709).
  __shared__ int item_mergers;
  constexpr int kConsumers =
      static_cast<int>(attention::DecodeBarrier::kConsumers);

  const bool producer = threadIdx.x < kWgmmaProducerThreads;
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(&k_map);
    prefetch_tma_descriptor(&v_map);
    bar.init(Config::kStageReaders, Config::kFp8 ? kWgmmaTransposeWarps : 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  pdl_launch_dependents();
  // The plan, the queries and the cache are written by earlier kernels.
  pdl_wait_for_producer();
  const CtaStart start = CtaStart::load(p, blockIdx.x);
  // The kernel's row layout comes from the launch; a plan made for another
  // query count would be walked wrongly, so fail loudly instead.
  if (start.query_tokens != p.query_tokens) __trap();
  const int thread = threadIdx.x - kWgmmaProducerThreads;
  if (blockIdx.x >= start.num_ctas) {
    if (!producer) {
      zero_empty_units(p, Config::kHeadDim, thread, kWgmmaConsumerThreads);
    }
    return;
  }

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
    if (threadIdx.x < 32) {
      load_kv_tiles<Config>(p, start, &k_map, &v_map, smem, bar);
      return;
    }
    // Warps 1..3 zero the outputs of units without work (zero-length
    // sequences) while the first tiles are on their way: off the consumers'
    // path, and not at the CTA's end, where its loads would lengthen the
    // kernel's tail.
    zero_empty_units(p, Config::kHeadDim, threadIdx.x - 32,
                     kWgmmaProducerThreads - 32);
    if constexpr (Config::kFp8) transpose_v_tiles<Config>(p, start, smem, bar);
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
  // The warpgroup index broadcast from lane 0, so that the compiler knows
  // it is the same across the warp: branches on it (the tiles a warpgroup
  // takes in turn) are then not divergent paths for wgmma in flight.
  const int wg = __shfl_sync(0xffffffffu, thread / 128, 0);
  const ConsumerGroup g{wg, thread % 128,
                        Config::kSplitRows ? wg * Config::kWgRows : 0};
  typename Config::TiledMmaO mma_o;
  Tensor acc_o = partition_fragment_C(
      mma_o, Shape<Int<Config::kHeadDim>, Int<Config::kWgRows>>{});
  typename Config::Softmax softmax;
  int parity = 0;
  WorkCursor cursor(p, blockIdx.x);
  WorkItem item;
  int it = 0;
  for (bool more = cursor.first(start, item); more; more = cursor.next(item)) {
    // Both warpgroups are done with the previous item's queries.
    named_barrier_sync(kConsumers, kWgmmaConsumerThreads);
    if (thread == 0) item_mergers = item.mergers;
    load_queries<Config>(p, item, smem, thread);
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(kConsumers, kWgmmaConsumerThreads);
    clear(acc_o);
    softmax.reset();
    mma_item<Config>(p, item, cursor.window(), it, g, smem, bar, acc_o, softmax,
                     parity);
    store_item<Config>(p, item, g, smem, acc_o, softmax, parity);
    if (item.pieces > 1) {
      combine_pieces<kWgmmaConsumerThreads>(
          p, item, item_mergers, Config::kHeadDim, kConsumers, thread);
    }
    it += item.tile_end - item.tile_begin;
  }
}

}  // namespace decode
}  // namespace hpc
