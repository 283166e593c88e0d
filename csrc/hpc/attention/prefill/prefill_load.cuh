// Producer side of the paged prefill kernel: fills the Q buffer and the K/V
// rings (prefill_pipeline.cuh) for every tile the scheduler gives the CTA,
// each tile's key tiles last first (the order the consumers read them).
//
// 16-bit caches: one warp issues TMA copies, Q through a 4-D map over
// [tokens, query heads, head size] whose box is (64 channels, the group's
// query heads, tile_tokens tokens), which lands rows in the tile's (token,
// head) order; K and V through the paged maps (paged_kv_tma.cuh).
// FP8 caches: one warp copies the cache's FP8 tiles by TMA into a raw ring;
// the other three widen them into the stages in the MMA type (fp16, exact
// for E4M3), zeros for keys past the sequence, and write Q themselves
// (bf16 or FP8 queries converted to fp16).
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
__device__ void load_tiles_tma(
    const PrefillParams& p, const CUtensorMap* tmap_q,
    const CUtensorMap* tmap_k, const CUtensorMap* tmap_v, uint8_t* smem,
    PipelineBarriers<Config::kStages, Config::kRawSlots>& bar) {
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

// FP8 caches, producer warp 0: the K and V copies of every key tile into
// the raw ring, running ahead of the widening warps.
template <class Config>
__device__ void load_raw_tiles(
    const PrefillParams& p, const CUtensorMap* tmap_k,
    const CUtensorMap* tmap_v, uint8_t* smem,
    PipelineBarriers<Config::kStages, Config::kRawSlots>& bar) {
  constexpr int kBlockN = Config::kBlockN;
  using RawTile =
      attention::PagedKvTile<kBlockN, Config::kRawChunks, Config::kRawRowBytes>;
  const int lane = threadIdx.x % 32;
  TileScheduler<kBlockN> scheduler(p);
  TileWork w;
  RingState<Config::kRawSlots> raw;
  while (scheduler.next(w)) {
    if (w.empty()) continue;
    const int32_t* ids = p.block_table + w.request * p.block_table_stride;
    for (int n = w.keys.tile_end - 1; n >= w.keys.tile_begin; --n) {
      const KeyTileBlocks blocks =
          key_tile_blocks<kBlockN>(n, w.kv_len, p.block_size);
      const uint32_t bytes = RawTile::bytes(blocks.count, p.block_size);
      uint8_t* slot =
          smem + Config::kRawOffset + raw.stage * Config::kRawSlotBytes;
      EmptyBarrier::wait(&bar.raw_empty[raw.stage], raw.phase ^ 1);
      if (lane == 0) {
        FullBarrier::arrive_and_expect_tx(&bar.raw_full[raw.stage], 2 * bytes);
      }
      __syncwarp();
      RawTile::issue(tmap_k, &bar.raw_full[raw.stage], slot, ids + blocks.first,
                     blocks.count, p.block_size, w.kv_head, 1, kKvCacheHint,
                     lane);
      RawTile::issue(tmap_v, &bar.raw_full[raw.stage],
                     slot + Config::kRawTileBytes, ids + blocks.first,
                     blocks.count, p.block_size, w.kv_head, 1, kKvCacheHint,
                     lane);
      raw.advance();
    }
  }
}

// Byte offset of byte `byte` of `row` in a raw tile: chunks of kRowBytes
// per row, each swizzled as the copies write it (16-byte units XOR-ed with
// the row's position in its 1024-byte atom).
template <int kTileRows, int kRowBytes>
__device__ __forceinline__ int raw_offset(int row, int byte) {
  const int linear = (byte / kRowBytes) * (kTileRows * kRowBytes) +
                     row * kRowBytes + byte % kRowBytes;
  constexpr int kMask = kRowBytes / 16 - 1;
  return linear ^ (((linear >> 7) & kMask) << 4);
}

// FP8 caches, producer warps 1..3: Q (bf16 or FP8 queries to fp16) and
// every raw key tile widened to fp16 (exact) into the stages, zeros for the
// keys past the sequence (their slots may hold anything).
constexpr int kWideningWarps = kProducerThreads / 32 - 1;

template <class Config>
__device__ void widen_tiles(
    const PrefillParams& p, const void* q, int64_t q_token_stride,
    int64_t q_head_stride, uint8_t* smem,
    PipelineBarriers<Config::kStages, Config::kRawSlots>& bar) {
  using namespace cute;
  using Element = typename Config::Element;
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kHeadDim = Config::kHeadDim;
  constexpr int kThreads = kWideningWarps * 32;
  constexpr int kUnits = kHeadDim / 16;  // 16-byte FP8 units of a row
  constexpr int kTotal = kBlockN * kUnits;
  constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
  constexpr int kBatch = 4;
  const int tid = threadIdx.x - 32;  // 0 .. kThreads - 1

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
  RingState<Config::kRawSlots> raw;
  uint32_t q_phase = 0;
  auto arrive = [&](uint64_t* bar_full) {
    // Generic-proxy writes, read by wgmma through the async proxy.
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    if (tid % 32 == 0) FullBarrier::arrive(bar_full);
  };

  while (scheduler.next(w)) {
    if (w.empty()) continue;
    // Q: rows (token, head) of the tile; 8 channels per 16-byte unit of
    // 16-bit queries, 16 per unit of FP8 ones; kBatch global loads in
    // flight per thread.
    EmptyBarrier::wait(&bar.q_empty, q_phase ^ 1);
    {
      const int units = kHeadDim * q_elem_bytes / 16;
      const int q_units = Config::kBlockM * units;
#pragma unroll 1
      for (int e0 = tid; e0 < q_units; e0 += kBatch * kThreads) {
        uint4 in[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int e = e0 + j * kThreads;
          const int row = e / units;
          const int t = row / p.group;
          const int head = w.kv_head * p.group + row % p.group;
          const int64_t token = w.q_begin + w.token0 + t;
          in[j] = make_uint4(0, 0, 0, 0);
          if (e < q_units && row < rows && t < w.tokens) {
            in[j] = *reinterpret_cast<const uint4*>(
                static_cast<const uint8_t*>(q) +
                (token * q_token_stride + head * q_head_stride) * q_elem_bytes +
                (e % units) * 16);
          }
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int e = e0 + j * kThreads;
          if (e >= q_units) break;
          const int row = e / units;
          const int u = e % units;
          if (p.q_type == ElemType::kFp8E4m3) {
            uint4 h[2];
            widen16(in[j], h);
            store_unit(sQ, row, u * 16, h[0]);
            store_unit(sQ, row, u * 16 + 8, h[1]);
          } else {
            store_unit(
                sQ, row, u * 8,
                p.q_type == ElemType::kBf16 ? bf16x8_to_f16x8(in[j]) : in[j]);
          }
        }
      }
    }
    arrive(&bar.q_full);
    q_phase ^= 1;

    for (int n = w.keys.tile_end - 1; n >= w.keys.tile_begin; --n) {
      const int s = ring.stage;
      const uint8_t* slot =
          smem + Config::kRawOffset + raw.stage * Config::kRawSlotBytes;
      const int valid = w.kv_len - n * kBlockN;
      FullBarrier::wait(&bar.raw_full[raw.stage], raw.phase);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        EmptyBarrier::wait(m == 0 ? &bar.k_empty[s] : &bar.v_empty[s],
                           ring.phase ^ 1);
        const uint8_t* src = slot + m * Config::kRawTileBytes;
        // kBatch independent shared loads in flight per thread.
#pragma unroll 1
        for (int i0 = 0; i0 < kIters; i0 += kBatch) {
          uint4 in[kBatch];
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            const int e = tid + (i0 + j) * kThreads;
            const int row = e / kUnits;
            in[j] = make_uint4(0, 0, 0, 0);
            if (i0 + j < kIters && e < kTotal && row < valid) {
              in[j] = *reinterpret_cast<const uint4*>(
                  src + raw_offset<kBlockN, Config::kRawRowBytes>(
                            row, (e % kUnits) * 16));
            }
          }
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            const int e = tid + (i0 + j) * kThreads;
            if (i0 + j < kIters && e < kTotal) {
              uint4 h[2];
              widen16(in[j], h);
              const int row = e / kUnits;
              const int col = (e % kUnits) * 16;
              store_unit((m == 0 ? sK : sV)(_, _, s), row, col, h[0]);
              store_unit((m == 0 ? sK : sV)(_, _, s), row, col + 8, h[1]);
            }
          }
        }
        arrive(m == 0 ? &bar.k_full[s] : &bar.v_full[s]);
      }
      // Every widening warp has read the raw tile.
      __syncwarp();
      if (tid % 32 == 0) EmptyBarrier::arrive(&bar.raw_empty[raw.stage]);
      ring.advance();
      raw.advance();
    }
  }
}

}  // namespace prefill
}  // namespace hpc
