// Producer side of the paged prefill kernel: fills the Q buffer and the K/V
// rings (prefill_pipeline.cuh) for every tile the scheduler gives the CTA,
// each tile's key tiles last first (the order the consumers read them).
//
// Warp 0 issues every TMA copy: Q through a 4-D map over [tokens, query
// heads, head size] whose box is (one chunk of channels, the group's query
// heads, tile_tokens tokens), which lands rows in the tile's (token, head)
// order; K and V through the paged maps (paged_kv_tma.cuh).
// FP8 caches: V lands in the raw ring, and warps 1..3 write V^T from it into
// the V stages (attention/common/fp8_operands.cuh), zeros for keys past the
// sequence; 16-bit queries land in a staging tile, which the same warps
// quantize into the Q tile with one scale per row.
#pragma once

#include <cuda.h>

#include <cstdint>

#include <cute/arch/copy_sm90_tma.hpp>

#include "attention/common/fp8_operands.cuh"
#include "attention/common/paged_kv_tma.cuh"
#include "attention/prefill/prefill_config.cuh"
#include "attention/prefill/prefill_params.h"
#include "attention/prefill/prefill_pipeline.cuh"
#include "attention/prefill/prefill_tile_scheduler.cuh"

namespace hpc {
namespace prefill {

// K and V are read by every query tile of their request: keep them in L2.
constexpr uint64_t kKvCacheHint =
    static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);

// Cache blocks of key tile n: [first, first + count).
struct KeyTileBlocks {
  int first;
  int count;
};

template <int kBlockN>
__device__ __forceinline__ KeyTileBlocks key_tile_blocks(int n, int kv_len,
                                                         int block_size) {
  const int seq_blocks = (kv_len + block_size - 1) / block_size;
  const int first = n * (kBlockN / block_size);
  const int count = min(kBlockN / block_size, seq_blocks - first);
  return {first, count};
}

// Where the copies of a tile's queries go: the Q tile in the queries' own
// type, or (16-bit queries over an FP8 cache) the staging tile, 16-bit rows
// of 128 bytes.
template <class Config>
struct QueryCopy {
  uint8_t* dst;
  uint64_t* bar;
  int chunks;
  int row_bytes;
  int elem_bytes;

  __device__ QueryCopy(const PrefillParams& p, uint8_t* smem,
                       typename Config::Barriers& b) {
    const bool staged = Config::quantizes_queries(p);
    dst = smem + (staged ? Config::kQStagingOffset : 0);
    bar = staged ? &b.q_staged : &b.q_full;
    row_bytes = staged ? 128 : Config::kRowBytes;
    elem_bytes = staged ? 2 : Config::kElemBytes;
    chunks = Config::kHeadDim * elem_bytes / row_bytes;
  }

  // By one lane, once the Q tile is free.
  __device__ void issue(const PrefillParams& p, const CUtensorMap* map,
                        const TileWork& w) const {
    FullBarrier::arrive_and_expect_tx(
        bar,
        static_cast<uint32_t>(chunks * row_bytes * p.group * p.tile_tokens));
    for (int c = 0; c < chunks; ++c) {
      cute::SM90_TMA_LOAD_4D::copy(
          map, bar,
          static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST),
          dst + c * Config::kBlockM * row_bytes, c * row_bytes / elem_bytes,
          w.kv_head * p.group, w.q_begin + w.token0, 0);
    }
  }
};

// Producer warp 0: every copy of every tile.
template <class Config>
__device__ void load_tiles(const PrefillParams& p, const PrefillSources& src,
                           uint8_t* smem, typename Config::Barriers& bar) {
  constexpr int kBlockN = Config::kBlockN;
  using KvTile =
      attention::PagedKvTile<kBlockN, Config::kChunks, Config::kRowBytes>;
  const int lane = threadIdx.x % 32;
  const QueryCopy<Config> q_copy(p, smem, bar);
  TileScheduler<kBlockN> scheduler(p);
  TileWork w;
  typename Config::Pipeline pos;
  while (scheduler.next(w)) {
    if (w.empty()) continue;
    if (lane == 0) {
      EmptyBarrier::wait(&bar.q_empty, pos.q_phase ^ 1);
      q_copy.issue(p, &src.q_map, w);
    }
    pos.q_phase ^= 1;

    const int32_t* ids = p.block_table + w.request * p.block_table_stride;
    for (int n = w.keys.tile_end - 1; n >= w.keys.tile_begin; --n) {
      const KeyTileBlocks blocks =
          key_tile_blocks<kBlockN>(n, w.kv_len, p.block_size);
      const uint32_t bytes = KvTile::bytes(blocks.count, p.block_size);
      const int s = pos.k.stage;
      EmptyBarrier::wait(&bar.k_empty[s], pos.k.phase ^ 1);
      if (lane == 0) FullBarrier::arrive_and_expect_tx(&bar.k_full[s], bytes);
      __syncwarp();
      KvTile::issue(&src.k_map, &bar.k_full[s],
                    smem + Config::kKOffset + s * Config::kStageBytes,
                    ids + blocks.first, blocks.count, p.block_size, w.kv_head,
                    Config::kElemBytes, kKvCacheHint, lane);
      pos.k.advance();
      // V: into its stage, or (FP8) into the raw ring.
      uint64_t* v_full;
      uint8_t* v_dst;
      if constexpr (Config::kFp8) {
        EmptyBarrier::wait(&bar.raw_empty[pos.raw.stage], pos.raw.phase ^ 1);
        v_full = &bar.raw_full[pos.raw.stage];
        v_dst = smem + Config::kRawOffset + pos.raw.stage * Config::kStageBytes;
        pos.raw.advance();
      } else {
        EmptyBarrier::wait(&bar.v_empty[pos.v.stage], pos.v.phase ^ 1);
        v_full = &bar.v_full[pos.v.stage];
        v_dst = smem + Config::kVOffset + pos.v.stage * Config::kStageBytes;
        pos.v.advance();
      }
      if (lane == 0) FullBarrier::arrive_and_expect_tx(v_full, bytes);
      __syncwarp();
      KvTile::issue(&src.v_map, v_full, v_dst, ids + blocks.first, blocks.count,
                    p.block_size, w.kv_head, Config::kElemBytes, kKvCacheHint,
                    lane);
    }
  }
}

// FP8 caches, producer warps 1..3: 16-bit queries quantized per row into
// the Q tile, and every raw V tile transposed into its V stage.
template <class Config>
__device__ void transpose_tiles(const PrefillParams& p, uint8_t* smem,
                                typename Config::Barriers& bar) {
  static_assert(Config::kFp8);
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kHeadDim = Config::kHeadDim;
  const int warp = threadIdx.x / 32 - 1;
  const int tid = threadIdx.x - 32;
  const attention::VTransposer<kBlockN, kHeadDim, Config::kRowBytes,
                               kTransposeWarps>
      transpose;
  // Generic-proxy writes, read by wgmma through the async proxy.
  auto arrive = [&](uint64_t* full) {
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    if (tid % 32 == 0) FullBarrier::arrive(full);
  };

  TileScheduler<kBlockN> scheduler(p);
  TileWork w;
  typename Config::Pipeline pos;
  while (scheduler.next(w)) {
    if (w.empty()) continue;
    if (Config::quantizes_queries(p)) {
      // The staged copy was issued once the consumers released the
      // previous tile's Q and staged queries.
      FullBarrier::wait(&bar.q_staged, pos.q_phase);
      Config::StagedQ::template quantize<Config::kRowBytes>(
          smem + Config::kQStagingOffset, smem, p.q_type == ElemType::kBf16,
          p.group * p.tile_tokens, tid, kTransposeWarps * 32);
      arrive(&bar.q_full);
    }
    pos.q_phase ^= 1;

    for (int n = w.keys.tile_end - 1; n >= w.keys.tile_begin; --n) {
      const int r = pos.raw.stage;
      const int s = pos.v.stage;
      FullBarrier::wait(&bar.raw_full[r], pos.raw.phase);
      EmptyBarrier::wait(&bar.v_empty[s], pos.v.phase ^ 1);
      transpose(smem + Config::kRawOffset + r * Config::kStageBytes,
                smem + Config::kVOffset + s * Config::kStageBytes,
                w.kv_len - n * kBlockN, warp);
      arrive(&bar.v_full[s]);
      // This warp has read the raw tile (its lanes' loads fed the stores).
      if (tid % 32 == 0) EmptyBarrier::arrive(&bar.raw_empty[r]);
      pos.v.advance();
      pos.raw.advance();
    }
  }
}

}  // namespace prefill
}  // namespace hpc
