// Producer of the swap-AB decode kernel: warp 0 streams every K and V tile
// of the CTA's work items (decode_work.cuh) into two rings, one per matrix,
// each stage guarded by a full barrier (its bytes landed) and an empty
// barrier (its readers are done). K and V are separate so that a K stage
// frees as soon as S^T = K Q^T has read it, before the V of its tile.
// The rings never drain between work items.
#pragma once

#include <cuda.h>

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cute/arch/copy_sm90_tma.hpp>

#include "attention/common/paged_kv_tma.cuh"
#include "attention/decode/decode_config.cuh"
#include "attention/decode/decode_params.h"
#include "attention/decode/decode_work.cuh"

namespace hpc {
namespace decode {

using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

template <int kStages>
struct KvRingBarriers {
  uint64_t k_full[kStages];
  uint64_t k_empty[kStages];
  uint64_t v_full[kStages];
  uint64_t v_empty[kStages];

  __device__ void init(int readers) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&k_full[s], 1);
      FullBarrier::init(&v_full[s], 1);
      EmptyBarrier::init(&k_empty[s], readers);
      EmptyBarrier::init(&v_empty[s], readers);
    }
  }
};

// The stage and phase of the `it`-th tile of the CTA's sequence.
template <int kStages>
struct RingSlot {
  int stage;
  uint32_t phase;

  __device__ static RingSlot of(int it) {
    return {it % kStages, static_cast<uint32_t>((it / kStages) & 1)};
  }
};

// K and V are streamed once: keep them from displacing reused data in L2.
constexpr uint64_t kKvStreamHint =
    static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);

// Producer warp: every copy of every tile, in the consumers' order.
template <class Config>
__device__ void load_kv_tiles(const DecodeParams& p, const CUtensorMap* k_map,
                              const CUtensorMap* v_map, uint8_t* smem,
                              KvRingBarriers<Config::kStages>& bar) {
  using KvTile = attention::PagedKvTile<Config::kTileKeys, Config::kChunks,
                                        Config::kRowBytes>;
  const int lane = threadIdx.x % 32;
  const int bs = p.block_size;
  const int blocks_per_tile = Config::kTileKeys / bs;
  WorkCursor cursor(p, blockIdx.x);
  WorkItem item;
  int it = 0;
  while (cursor.next(item)) {
    const int b = item.unit % p.batch;
    const int h = item.unit / p.batch;
    const int seq_blocks = (item.kv_len + bs - 1) / bs;
    const int32_t* ids = p.block_table + b * p.block_table_stride;
    for (int tile = item.tile_begin; tile < item.tile_end; ++tile, ++it) {
      const int first = tile * blocks_per_tile;
      const int blocks = min(blocks_per_tile, seq_blocks - first);
      const uint32_t bytes = KvTile::bytes(blocks, bs);
      const RingSlot<Config::kStages> slot = RingSlot<Config::kStages>::of(it);
      EmptyBarrier::wait(&bar.k_empty[slot.stage], slot.phase ^ 1);
      if (lane == 0) {
        FullBarrier::arrive_and_expect_tx(&bar.k_full[slot.stage], bytes);
      }
      __syncwarp();
      KvTile::issue(k_map, &bar.k_full[slot.stage],
                    smem + Config::kKOffset + slot.stage * Config::kStageBytes,
                    ids + first, blocks, bs, h, Config::kElemBytes,
                    kKvStreamHint, lane);
      EmptyBarrier::wait(&bar.v_empty[slot.stage], slot.phase ^ 1);
      if (lane == 0) {
        FullBarrier::arrive_and_expect_tx(&bar.v_full[slot.stage], bytes);
      }
      __syncwarp();
      KvTile::issue(v_map, &bar.v_full[slot.stage],
                    smem + Config::kVOffset + slot.stage * Config::kStageBytes,
                    ids + first, blocks, bs, h, Config::kElemBytes,
                    kKvStreamHint, lane);
    }
  }
}

}  // namespace decode
}  // namespace hpc
