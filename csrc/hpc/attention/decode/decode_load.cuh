// Producer of the swap-AB decode kernel: warp 0 streams every K and V tile
// of the CTA's work items (decode_work.cuh) into two rings, one per matrix,
// each stage guarded by a full barrier (its bytes landed) and an empty
// barrier (its readers are done). K and V are separate so that a K stage
// frees as soon as S^T = K Q^T has read it, before the V of its tile.
// FP8 caches: V lands in a ring of raw tiles, and warps 1..3 write V^T from
// it into the V stages. The rings never drain between work items.
#pragma once

#include <cuda.h>

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cute/arch/copy_sm90_tma.hpp>

#include "attention/common/fp8_operands.cuh"
#include "attention/common/paged_kv_tma.cuh"
#include "attention/common/ring_state.cuh"
#include "attention/decode/decode_config.cuh"
#include "attention/decode/decode_params.h"
#include "attention/decode/decode_work.cuh"

namespace hpc {
namespace decode {

using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

// K ring (kStages), V ring (kVStages) and, for FP8 caches, the raw V ring
// (kRawSlots) the transposing warps read.
template <int kStages, int kVStages, int kRawSlots>
struct KvRingBarriers {
  uint64_t k_full[kStages];
  uint64_t k_empty[kStages];
  uint64_t v_full[kVStages];
  uint64_t v_empty[kVStages];
  uint64_t raw_full[kRawSlots > 0 ? kRawSlots : 1];
  uint64_t raw_empty[kRawSlots > 0 ? kRawSlots : 1];

  // readers: warps that release a K or V stage; v_writers: 1 where TMA
  // fills the V stages (one expect_tx arrival), else the transposing warps
  // (who also release the raw slots).
  __device__ void init(int readers, int v_writers) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&k_full[s], 1);
      EmptyBarrier::init(&k_empty[s], readers);
    }
#pragma unroll
    for (int s = 0; s < kVStages; ++s) {
      FullBarrier::init(&v_full[s], v_writers);
      EmptyBarrier::init(&v_empty[s], readers);
    }
#pragma unroll
    for (int s = 0; s < kRawSlots; ++s) {
      FullBarrier::init(&raw_full[s], 1);
      EmptyBarrier::init(&raw_empty[s], v_writers);
    }
  }
};

using attention::RingState;

// K and V are streamed once: keep them from displacing reused data in L2.
constexpr uint64_t kKvStreamHint =
    static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);

template <class Config>
using DecodeBarriers =
    KvRingBarriers<Config::kStages, Config::kVStages, Config::kRawSlots>;

// Producer warp 0: every copy of every tile, in the consumers' order; V
// into its stage, or (FP8) into the raw ring.
template <class Config>
__device__ void load_kv_tiles(const DecodeParams& p, const CtaStart& start,
                              const CUtensorMap* k_map,
                              const CUtensorMap* v_map, uint8_t* smem,
                              DecodeBarriers<Config>& bar) {
  using KvTile = attention::PagedKvTile<Config::kTileKeys, Config::kChunks,
                                        Config::kRowBytes>;
  static_assert(Config::kTileKeys == kTileTokens);
  const int lane = threadIdx.x % 32;
  WorkCursor cursor(p, blockIdx.x);
  WorkItem item;
  int it = 0;
  for (bool more = cursor.first(start, item); more; more = cursor.next(item)) {
    ItemBlocks blocks_of(p, item, lane);
    const int h = blocks_of.kv_head;
    const int bs = blocks_of.block_size;
    for (int tile = item.tile_begin; tile < item.tile_end; ++tile, ++it) {
      const int blocks = blocks_of.count(tile);
      const uint32_t bytes = KvTile::bytes(blocks, bs);
      // This lane's block of the tile (its K and V copies).
      const int block_id =
          blocks_of.id(tile, min(KvTile::lane_block(lane), blocks - 1));
      const auto slot = RingState<Config::kStages>::of(it);
      EmptyBarrier::wait(&bar.k_empty[slot.stage], slot.phase ^ 1);
      if (lane == 0) {
        FullBarrier::arrive_and_expect_tx(&bar.k_full[slot.stage], bytes);
      }
      __syncwarp();
      KvTile::issue_block(
          k_map, &bar.k_full[slot.stage],
          smem + Config::kKOffset + slot.stage * Config::kStageBytes, block_id,
          blocks, bs, h, Config::kElemBytes, kKvStreamHint, lane);
      uint64_t* v_full;
      uint8_t* v_dst;
      if constexpr (Config::kFp8) {
        const auto raw = RingState<Config::kRawSlots>::of(it);
        EmptyBarrier::wait(&bar.raw_empty[raw.stage], raw.phase ^ 1);
        v_full = &bar.raw_full[raw.stage];
        v_dst = smem + Config::kRawOffset + raw.stage * Config::kStageBytes;
      } else {
        const auto v = RingState<Config::kVStages>::of(it);
        EmptyBarrier::wait(&bar.v_empty[v.stage], v.phase ^ 1);
        v_full = &bar.v_full[v.stage];
        v_dst = smem + Config::kVOffset + v.stage * Config::kStageBytes;
      }
      if (lane == 0) FullBarrier::arrive_and_expect_tx(v_full, bytes);
      __syncwarp();
      KvTile::issue_block(v_map, v_full, v_dst, block_id, blocks, bs, h,
                          Config::kElemBytes, kKvStreamHint, lane);
    }
  }
}

// FP8 caches, producer warps 1..3: every raw V tile transposed into its V^T
// stage (keys past the sequence zeroed).
template <class Config>
__device__ void transpose_v_tiles(const DecodeParams& p, const CtaStart& start,
                                  uint8_t* smem, DecodeBarriers<Config>& bar) {
  static_assert(Config::kFp8);
  const int warp = threadIdx.x / 32 - 1;
  const attention::VTransposer<Config::kTileKeys, Config::kHeadDim,
                               Config::kRowBytes, kWgmmaTransposeWarps>
      transpose;
  WorkCursor cursor(p, blockIdx.x);
  WorkItem item;
  int it = 0;
  for (bool more = cursor.first(start, item); more; more = cursor.next(item)) {
    for (int tile = item.tile_begin; tile < item.tile_end; ++tile, ++it) {
      const auto raw = RingState<Config::kRawSlots>::of(it);
      const auto v = RingState<Config::kVStages>::of(it);
      FullBarrier::wait(&bar.raw_full[raw.stage], raw.phase);
      EmptyBarrier::wait(&bar.v_empty[v.stage], v.phase ^ 1);
      transpose(smem + Config::kRawOffset + raw.stage * Config::kStageBytes,
                smem + Config::kVOffset + v.stage * Config::kStageBytes,
                item.kv_len - tile * Config::kTileKeys, warp);
      // Generic-proxy writes, read by wgmma through the async proxy.
      cutlass::arch::fence_view_async_shared();
      __syncwarp();
      if (threadIdx.x % 32 == 0) {
        FullBarrier::arrive(&bar.v_full[v.stage]);
        // This warp has read the raw tile (its lanes' loads fed the stores).
        EmptyBarrier::arrive(&bar.raw_empty[raw.stage]);
      }
    }
  }
}

}  // namespace decode
}  // namespace hpc
