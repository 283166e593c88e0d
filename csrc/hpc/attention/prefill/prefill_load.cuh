// Producer side of the paged prefill kernel: fills the Q buffer and the K/V
// rings (prefill_pipeline.cuh) for every tile the scheduler gives the CTA,
// each tile's key tiles last first (the order the consumers read them).
//
// 16-bit caches: one warp issues TMA copies, Q through a 4-D map over
// [tokens, query heads, head size] whose box is (64 channels, the group's
// query heads, tile_tokens tokens), which lands rows in the tile's (token,
// head) order; K and V through the paged maps (paged_kv_tma.cuh).
// FP8 caches: the producer warpgroup loads the cache with vector loads and
// writes it widened to the MMA type (exact for E4M3), zeros for keys past
// the sequence; Q likewise (bf16 or FP8 queries converted to fp16).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>

#include "attention/common/paged_kv_tma.cuh"
#include "attention/prefill/prefill_config.cuh"
#include "attention/prefill/prefill_params.h"
#include "attention/prefill/prefill_pipeline.cuh"
#include "attention/prefill/prefill_tile_scheduler.cuh"
#include "common/paged_cache_view.h"

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

// One warp of the producer warpgroup.
template <class Config>
__device__ void load_tiles_tma(const PrefillParams& p,
                               const CUtensorMap* tmap_q,
                               const CUtensorMap* tmap_k,
                               const CUtensorMap* tmap_v, uint8_t* smem,
                               PipelineBarriers<Config::kStages>& bar) {
  constexpr int kBlockN = Config::kBlockN;
  using KvTile =
      attention::PagedKvTile<kBlockN, Config::kChunks, Config::kRowBytes>;
  const int lane = threadIdx.x % 32;
  const uint32_t q_bytes =
      Config::kChunks * Config::kRowBytes * p.group * p.tile_tokens;
  TileScheduler<kBlockN> scheduler(p);
  TileWork w;
  RingState<Config::kStages> ring;
  uint32_t q_phase = 0;
  while (scheduler.next(w)) {
    if (w.empty()) continue;
    if (lane == 0) {
      EmptyBarrier::wait(&bar.q_empty, q_phase ^ 1);
      FullBarrier::arrive_and_expect_tx(&bar.q_full, q_bytes);
#pragma unroll
      for (int c = 0; c < Config::kChunks; ++c) {
        cute::SM90_TMA_LOAD_4D::copy(
            tmap_q, &bar.q_full,
            static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST),
            smem + c * Config::kBlockM * Config::kRowBytes,
            c * Config::kChunkElems, w.kv_head * p.group, w.q_begin + w.token0,
            0);
      }
    }
    q_phase ^= 1;

    const int32_t* ids = p.block_table + w.request * p.block_table_stride;
    for (int n = w.keys.tile_end - 1; n >= w.keys.tile_begin; --n) {
      const KeyTileBlocks blocks =
          key_tile_blocks<kBlockN>(n, w.kv_len, p.block_size);
      const uint32_t bytes = KvTile::bytes(blocks.count, p.block_size);
      const int s = ring.stage;
      EmptyBarrier::wait(&bar.k_empty[s], ring.phase ^ 1);
      if (lane == 0) FullBarrier::arrive_and_expect_tx(&bar.k_full[s], bytes);
      __syncwarp();
      KvTile::issue(tmap_k, &bar.k_full[s],
                    smem + Config::kKOffset + s * Config::kStageBytes,
                    ids + blocks.first, blocks.count, p.block_size, w.kv_head,
                    2, kKvCacheHint, lane);
      EmptyBarrier::wait(&bar.v_empty[s], ring.phase ^ 1);
      if (lane == 0) FullBarrier::arrive_and_expect_tx(&bar.v_full[s], bytes);
      __syncwarp();
      KvTile::issue(tmap_v, &bar.v_full[s],
                    smem + Config::kVOffset + s * Config::kStageBytes,
                    ids + blocks.first, blocks.count, p.block_size, w.kv_head,
                    2, kKvCacheHint, lane);
      ring.advance();
    }
  }
}

// ---------------------------------------------------------------------------
// FP8 caches: widening loads by the producer warpgroup
// ---------------------------------------------------------------------------

// 16 E4M3 values to 16 fp16 values (exact).
__device__ __forceinline__ void widen16(const uint4& raw, uint4 (&out)[2]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t h[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(w[i] & 0xffffu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(w[i] >> 16), __NV_E4M3);
    h[2 * i] =
        static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(lo.y) << 16);
    h[2 * i + 1] =
        static_cast<uint32_t>(hi.x) | (static_cast<uint32_t>(hi.y) << 16);
  }
  out[0] = make_uint4(h[0], h[1], h[2], h[3]);
  out[1] = make_uint4(h[4], h[5], h[6], h[7]);
}

// 8 bf16 values to 8 fp16 values (rounded; magnitudes above 65504
// overflow, as for bf16 queries over FP8 caches in decode).
__device__ __forceinline__ uint4 bf16x8_to_f16x8(const uint4& raw) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f =
        __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    const __half2 v = __floats2half2_rn(f.x, f.y);
    h[i] = *reinterpret_cast<const uint32_t*>(&v);
  }
  return make_uint4(h[0], h[1], h[2], h[3]);
}

// Writes the 8 elements at (row, col .. col + 7) of a swizzled tile (the
// swizzle moves 16-byte units whole).
template <class SmemTensor>
__device__ __forceinline__ void store_unit(SmemTensor t, int row, int col,
                                           const uint4& v) {
  *reinterpret_cast<uint4*>(&t(row, col)) = v;
}

// Producer warpgroup (128 threads), FP8 cache; the MMA type is fp16.
template <class Config>
__device__ void load_tiles_widened(const PrefillParams& p, const void* q,
                                   int64_t q_token_stride,
                                   int64_t q_head_stride,
                                   const PagedCacheView& k_cache,
                                   const PagedCacheView& v_cache, uint8_t* smem,
                                   PipelineBarriers<Config::kStages>& bar) {
  using namespace cute;
  using Element = typename Config::Element;
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kHeadDim = Config::kHeadDim;
  constexpr int kUnits = kHeadDim / 16;  // 16-byte FP8 units of a row
  constexpr int kRowsPerPass = kProducerThreads / kUnits;
  static_assert(kBlockN % kRowsPerPass == 0);
  const int tid = threadIdx.x;  // 0 .. kProducerThreads - 1
  const int unit = tid % kUnits;
  const int row0 = tid / kUnits;

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                          typename Config::SmemLayoutQ{});
  Tensor sK = make_tensor(
      make_smem_ptr(reinterpret_cast<Element*>(smem + Config::kKOffset)),
      typename Config::SmemLayoutK{});
  // V shares K's byte layout (prefill_config.cuh).
  Tensor sV = make_tensor(
      make_smem_ptr(reinterpret_cast<Element*>(smem + Config::kVOffset)),
      typename Config::SmemLayoutK{});

  const int q_elem_bytes = p.q_type == ElemType::kFp8E4m3 ? 1 : 2;
  const int rows = p.group * p.tile_tokens;
  TileScheduler<kBlockN> scheduler(p);
  TileWork w;
  RingState<Config::kStages> ring;
  uint32_t q_phase = 0;
  auto arrive = [&](uint64_t* full) {
    // Generic-proxy writes, read by wgmma through the async proxy.
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    if (tid % 32 == 0) FullBarrier::arrive(full);
  };

  while (scheduler.next(w)) {
    if (w.empty()) continue;
    // Q: rows (token, head) of the tile; 8 channels per 16-byte unit of
    // 16-bit queries, 16 per unit of FP8 ones.
    EmptyBarrier::wait(&bar.q_empty, q_phase ^ 1);
    {
      const int units = kHeadDim * q_elem_bytes / 16;
      for (int e = tid; e < Config::kBlockM * units; e += kProducerThreads) {
        const int row = e / units;
        const int u = e % units;
        const int t = row / p.group;
        const int head = w.kv_head * p.group + row % p.group;
        const int64_t token = w.q_begin + w.token0 + t;
        const bool live = row < rows && t < w.tokens;
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (live) {
          raw = *reinterpret_cast<const uint4*>(
              static_cast<const uint8_t*>(q) +
              (token * q_token_stride + head * q_head_stride) * q_elem_bytes +
              u * 16);
        }
        if (p.q_type == ElemType::kFp8E4m3) {
          uint4 h[2];
          widen16(raw, h);
          store_unit(sQ, row, u * 16, h[0]);
          store_unit(sQ, row, u * 16 + 8, h[1]);
        } else {
          store_unit(sQ, row, u * 8,
                     p.q_type == ElemType::kBf16 ? bf16x8_to_f16x8(raw) : raw);
        }
      }
    }
    arrive(&bar.q_full);
    q_phase ^= 1;

    const int32_t* ids = p.block_table + w.request * p.block_table_stride;
    for (int n = w.keys.tile_end - 1; n >= w.keys.tile_begin; --n) {
      const int s = ring.stage;
      // This thread's rows of the key tile: row0 + i * kRowsPerPass; the
      // cache block and slot of each (block -1: past the sequence).
      constexpr int kRows = kBlockN / kRowsPerPass;
      int64_t block[kRows];
      int slot[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int key = n * kBlockN + row0 + i * kRowsPerPass;
        block[i] = key < w.kv_len ? ids[key / p.block_size] : -1;
        slot[i] = key % p.block_size;
      }
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const PagedCacheView& cache = m == 0 ? k_cache : v_cache;
        uint64_t* empty = m == 0 ? &bar.k_empty[s] : &bar.v_empty[s];
        uint64_t* full = m == 0 ? &bar.k_full[s] : &bar.v_full[s];
        uint4 raw[kRows];
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          raw[i] = make_uint4(0, 0, 0, 0);
          if (block[i] >= 0) {
            raw[i] = __ldg(reinterpret_cast<const uint4*>(
                static_cast<const uint8_t*>(cache.data) +
                block[i] * cache.block_stride + slot[i] * cache.token_stride +
                w.kv_head * cache.head_stride + unit * 16));
          }
        }
        EmptyBarrier::wait(empty, ring.phase ^ 1);
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          uint4 h[2];
          widen16(raw[i], h);
          const int row = row0 + i * kRowsPerPass;
          store_unit((m == 0 ? sK : sV)(_, _, s), row, unit * 16, h[0]);
          store_unit((m == 0 ? sK : sV)(_, _, s), row, unit * 16 + 8, h[1]);
        }
        arrive(full);
      }
      ring.advance();
    }
  }
}

}  // namespace prefill
}  // namespace hpc
