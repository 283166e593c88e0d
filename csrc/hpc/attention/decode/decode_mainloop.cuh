// Consumer side of the swap-AB decode kernel: the queries of a work item,
// and one consumer warpgroup's tiles of it (decode_config.cuh for the
// layout). Per tile:
//   wait K; S^T = K Q^T (FP8 with 16-bit queries: plus K Q_residual^T,
//   in one product K [Q; Q_residual]^T where the rows are few); wait for
//   it and for the previous tile's O^T product; release K and the
//   previous tile's V
//   soft-cap, mask (boundary tiles only); online softmax over the columns
//   O^T *= alpha (when a column's maximum moved); P^T -> shared memory
//   wait V (16-bit: zero its rows past the sequence); issue O^T += V^T P^T
// The O^T product runs while the warpgroup waits for its next K tile and
// issues S^T, instead of ending each tile's chain with a wait of its own.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cute/tensor.hpp>

#include "attention/common/column_softmax.cuh"
#include "attention/common/fp8_operands.cuh"
#include "attention/common/mask.h"
#include "attention/common/named_barriers.h"
#include "attention/common/online_softmax.cuh"
#include "attention/common/paged_kv_tma.cuh"
#include "attention/common/swizzle.h"
#include "attention/common/warpgroup.cuh"
#include "attention/decode/decode_config.cuh"
#include "attention/decode/decode_load.cuh"
#include "attention/decode/decode_params.h"
#include "attention/decode/decode_work.cuh"
#include "common/shared_memory.cuh"
#include "common/sync.cuh"

namespace hpc {
namespace decode {

// A consumer warpgroup: which one, its thread index within it, the rows its
// columns are (row0 + column) and its named barrier.
struct ConsumerGroup {
  int wg;
  int tid;
  int row0;

  __device__ int barrier() const {
    return static_cast<int>(attention::DecodeBarrier::kWarpgroup0) + wg;
  }
};

// Per-column constants of a consumer thread's columns (query rows) in the
// current work item.
template <int kSlots>
struct ColumnInfo {
  int pos[kSlots];      // query position (bottom-right causal)
  float qk[kSlots];     // factor of q.k before the soft-cap's tanh
  float scale[kSlots];  // the softmax's logit scale, log2 domain (> 0)
};

// `smem_q_scale`: the row scales of queries quantized in the kernel (FP8
// caches with 16-bit queries), else unused.
template <class Config>
__device__ ColumnInfo<Config::kWgRows / 4> column_info(
    const DecodeParams& p, const WorkItem& item, const ConsumerGroup& g,
    const float* smem_q_scale) {
  constexpr int kSlots = Config::kWgRows / 4;
  ColumnInfo<kSlots> c;
  const float k_scale = p.k_scale ? *p.k_scale : 1.f;
  const int b = item.unit % p.batch;
  const int h = item.unit / p.batch;
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int row = g.row0 + attention::column_of_slot(s, g.tid % 32);
    const int t = row / p.group;
    c.pos[s] = attention::query_position(item.kv_len, p.query_tokens, t);
    float scale = p.scale * k_scale;
    if (p.q_type == ElemType::kFp8E4m3 && row < p.rows) {
      const int64_t token = static_cast<int64_t>(b) * p.query_tokens + t;
      scale *= p.q_scale[token * p.q_scale_token_stride + h * p.group +
                         row % p.group];
    } else if (Config::kFp8 && row < p.rows) {
      scale *= smem_q_scale[row];
    }
    // A zero scale (an all-zero query row) would turn -inf into NaN.
    scale = fmaxf(scale, 1e-30f);
    c.qk[s] = p.softcap > 0.f ? scale / p.softcap : scale;
    c.scale[s] = (p.softcap > 0.f ? p.softcap : scale) * attention::kLog2e;
  }
  return c;
}

// Where byte `byte` of query row `row`'s term `term` goes in the Q tile
// (the warpgroups' parts, each [chunk][term row][kRowBytes];
// decode_config.cuh).
template <class Config>
__device__ __forceinline__ int q_tile_offset(int row, int byte, int term = 0) {
  return Config::kQOffset +
         row / Config::kWgRows * Config::kQTermRows * Config::kHeadDim *
             Config::kElemBytes +
         attention::swizzled_offset<Config::kRowBytes>(
             term * Config::kWgRows + row % Config::kWgRows, byte,
             Config::kQTermRows);
}

// The queries' row `row` of `item` (a unit row: query token, then head).
__device__ __forceinline__ const uint8_t* query_row(const DecodeParams& p,
                                                    const WorkItem& item,
                                                    int row) {
  const int64_t token =
      static_cast<int64_t>(item.unit % p.batch) * p.query_tokens +
      row / p.group;
  const int head = item.unit / p.batch * p.group + row % p.group;
  const int elem_bytes = p.q_type == ElemType::kFp8E4m3 ? 1 : 2;
  return static_cast<const uint8_t*>(p.q) +
         (token * p.q_token_stride + head * p.q_head_stride) * elem_bytes;
}

// The unit's query rows into the Q tile (rows past p.rows zero), by all
// consumer threads (`thread` of kWgmmaConsumerThreads), 8 bytes at a time
// (query rows are only 8-byte aligned in general: slices of a fused QKV
// tensor). Queries in the tile's type are copied; 16-bit queries over an
// FP8 cache are quantized per row (e4m3_row_scale) into two E4M3 terms, the
// residual's rows below the first term's (one term loses too much for the
// decode accuracy bar), their scales stored beside the tiles.
template <class Config>
__device__ void load_queries(const DecodeParams& p, const WorkItem& item,
                             uint8_t* smem, int thread) {
  if (!Config::kFp8 || p.q_type == ElemType::kFp8E4m3) {
    // Every load issued before the first store: one memory latency.
    constexpr int kUnitsPerRow = Config::kHeadDim * Config::kElemBytes / 8;
    constexpr int kUnits = Config::kRows * kUnitsPerRow;
    constexpr int kPerThread =
        (kUnits + kWgmmaConsumerThreads - 1) / kWgmmaConsumerThreads;
    uint2 v[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int e = thread + j * kWgmmaConsumerThreads;
      const int row = e / kUnitsPerRow;
      v[j] = make_uint2(0, 0);
      if (e < kUnits && row < p.rows) {
        v[j] = *reinterpret_cast<const uint2*>(query_row(p, item, row) +
                                               8 * (e % kUnitsPerRow));
      }
    }
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int e = thread + j * kWgmmaConsumerThreads;
      if (e < kUnits) {
        *reinterpret_cast<uint2*>(
            smem + q_tile_offset<Config>(e / kUnitsPerRow,
                                         8 * (e % kUnitsPerRow))) = v[j];
      }
    }
    return;
  }
  // 16 channels per lane, kLanesPerRow consecutive lanes per row; every
  // lane takes part in each pass (the row's amax is a shuffle).
  constexpr int kLanesPerRow = Config::kHeadDim / 16;
  constexpr int kRowsPerPass = kWgmmaConsumerThreads / kLanesPerRow;
  float* q_scale = reinterpret_cast<float*>(smem + Config::kQScaleOffset);
  const bool bf16 = p.q_type == ElemType::kBf16;
  const int part = thread % kLanesPerRow;
#pragma unroll 1
  for (int r0 = 0; r0 < Config::kRows; r0 += kRowsPerPass) {
    const int row = r0 + thread / kLanesPerRow;
    float x[16];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (row < p.rows) {
        const uint2* src = reinterpret_cast<const uint2*>(
            query_row(p, item, row) + 2 * (16 * part + 8 * u));
        const uint2 lo = src[0];
        const uint2 hi = src[1];
        raw = make_uint4(lo.x, lo.y, hi.x, hi.y);
      }
      attention::unpack_16bit_unit(raw, bf16, &x[8 * u]);
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float scale =
        attention::e4m3_row_scale(attention::row_abs_max<kLanesPerRow>(amax));
    if (row < Config::kRows) {
      uint4 hi, residual;
      attention::quantize16_e4m3_two_terms(x, scale, hi, residual);
      *reinterpret_cast<uint4*>(smem + q_tile_offset<Config>(row, 16 * part)) =
          hi;
      *reinterpret_cast<uint4*>(
          smem + q_tile_offset<Config>(row, 16 * part, 1)) = residual;
      if (part == 0) q_scale[row] = scale;
    }
  }
}

// Runs a warpgroup's tiles of `item` (the CTA's tiles it0, it0 + 1, ...;
// taking turns, the warpgroup's parity only); accumulates into `acc_o`
// (cleared by the caller) and `softmax` (reset by the caller). `parity`
// carries the softmax scratch half from call to call. `window`: the plan's
// sliding window (0: none).
template <class Config, class FragO>
__device__ void mma_item(const DecodeParams& p, const WorkItem& item,
                         int window, int it0, const ConsumerGroup& g,
                         uint8_t* smem, DecodeBarriers<Config>& bar,
                         FragO& acc_o, typename Config::Softmax& softmax,
                         int& parity) {
  using namespace cute;
  using Element = typename Config::Element;
  constexpr int kSlots = Config::kWgRows / 4;
  const int lane = g.tid % 32;
  const int warp = g.tid / 32;

  typename Config::TiledMmaS mma_s;
  typename Config::TiledMmaSTerms mma_s_terms;
  typename Config::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(g.tid);
  auto thr_s_terms = mma_s_terms.get_thread_slice(g.tid);
  auto thr_o = mma_o.get_thread_slice(g.tid);
  Tensor sK = make_tensor(
      make_smem_ptr(reinterpret_cast<Element*>(smem + Config::kKOffset)),
      typename Config::SmemLayoutK{});
  Tensor sQ = make_tensor(
      make_smem_ptr(reinterpret_cast<Element*>(smem + Config::kQOffset)),
      typename Config::SmemLayoutQ{});
  Tensor sQTerms = make_tensor(
      make_smem_ptr(reinterpret_cast<Element*>(smem + Config::kQOffset)),
      typename Config::SmemLayoutQTerms{});
  Tensor sVt = make_tensor(
      make_smem_ptr(reinterpret_cast<Element*>(smem + Config::kVOffset)),
      typename Config::SmemLayoutVt{});
  Tensor sP =
      make_tensor(make_smem_ptr(reinterpret_cast<Element*>(
                      smem + Config::kPOffset + g.wg * Config::kPBytes)),
                  typename Config::SmemLayoutP{});
  const int q_part = Config::kSplitRows ? g.wg : 0;
  Tensor tSrK = thr_s.partition_fragment_A(sK);                   // stage last
  Tensor tSrQ = thr_s.partition_fragment_B(sQ(_, _, 0, q_part));  // (V, N, K)
  Tensor tSrQResidual =
      thr_s.partition_fragment_B(sQ(_, _, Config::kQTerms - 1, q_part));
  Tensor tSrKTerms = thr_s_terms.partition_fragment_A(sK);
  Tensor tSrQTerms = thr_s_terms.partition_fragment_B(sQTerms(_, _, q_part));
  Tensor tOrV = thr_o.partition_fragment_A(sVt);  // stage last
  Tensor tOrP = thr_o.partition_fragment_B(sP);   // (V, N, K)
  // The P^T stores' shared-memory addresses in 32-bit integer math: the
  // layout's swizzle applied to the absolute address, as wgmma reads it
  // (taking &sP(column, key) would swizzle 64-bit generic pointers in the
  // tile loop).
  const uint32_t p_base =
      cast_smem_ptr_to_uint(smem + Config::kPOffset + g.wg * Config::kPBytes);
  const auto p_address = [p_base](int column, int key) -> uint32_t {
    constexpr auto swizzle =
        get_swizzle_portion(typename Config::SmemLayoutP{});
    constexpr auto linear =
        get_nonswizzle_portion(typename Config::SmemLayoutP{});
    return swizzle(p_base + static_cast<uint32_t>(linear(column, key)) *
                                static_cast<uint32_t>(sizeof(Element)));
  };
  Tensor acc_s = partition_fragment_C(
      mma_s, Shape<Int<Config::kTileKeys>, Int<Config::kWgRows>>{});
  Tensor acc_s_residual = partition_fragment_C(
      mma_s, Shape<Int<Config::kTileKeys>, Int<Config::kWgRows>>{});
  // Both terms' scores of one product: the first term's columns, then the
  // residual's (the accumulator's values run column group by column group).
  Tensor acc_s_terms = partition_fragment_C(
      mma_s_terms, Shape<Int<Config::kTileKeys>, Int<Config::kQTermRows>>{});
  static_assert(size(decltype(acc_s_terms){}) ==
                Config::kQTerms * size(decltype(acc_s){}));
  // FP8 caches with 16-bit queries: S adds the residual term's scores.
  const bool two_terms = Config::kFp8 && p.q_type != ElemType::kFp8E4m3;
  float* reduce = reinterpret_cast<float*>(smem + Config::kReduceOffset +
                                           g.wg * Config::kReduceBytes);

  const ColumnInfo<kSlots> cols = column_info<Config>(
      p, item, g, reinterpret_cast<const float*>(smem + Config::kQScaleOffset));
  const attention::KeyTiles keys = attention::KeyTiles::of(
      attention::query_position(item.kv_len, p.query_tokens, 0),
      attention::query_position(item.kv_len, p.query_tokens,
                                p.query_tokens - 1),
      item.kv_len, window, Config::kTileKeys);
  const bool softcap = p.softcap > 0.f;

  int it = it0;
  // The V stage of the O^T product still running (-1: none).
  int v_in_flight = -1;
  for (int tile = item.tile_begin; tile < item.tile_end; ++tile, ++it) {
    if (!Config::kSplitRows && (it & 1) != g.wg) continue;
    const auto slot = RingState<Config::kStages>::of(it);

    FullBarrier::wait(&bar.k_full[slot.stage], slot.phase);
    if (Config::kTermsInOneProduct && two_terms) {
      attention::wgmma_batch(mma_s_terms, tSrKTerms(_, _, _, slot.stage),
                             tSrQTerms, acc_s_terms, true);
    } else {
      attention::wgmma_batch(mma_s, tSrK(_, _, _, slot.stage), tSrQ, acc_s,
                             true);
      if (Config::kQTerms > 1 && !Config::kTermsInOneProduct && two_terms) {
        attention::wgmma_batch(mma_s, tSrK(_, _, _, slot.stage), tSrQResidual,
                               acc_s_residual, true);
      }
    }
    // S^T and, before it, the previous tile's O^T product are done.
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_o);
    attention::release(&bar.k_empty[slot.stage]);
    if (v_in_flight >= 0) attention::release(&bar.v_empty[v_in_flight]);
    if constexpr (Config::kQTerms > 1) {
      if (two_terms) {
        constexpr float kResidual = 1.f / attention::kE4m3ResidualScale;
#pragma unroll
        for (int i = 0; i < size(acc_s); ++i) {
          acc_s(i) = Config::kTermsInOneProduct
                         ? fmaf(acc_s_terms(i + size(acc_s)), kResidual,
                                acc_s_terms(i))
                         : fmaf(acc_s_residual(i), kResidual, acc_s(i));
        }
      }
    }

    // Scores: soft-cap, then the mask where a key of the tile may be
    // invisible to a row.
    const bool interior = keys.interior(tile);
    if (softcap || !interior) {
#pragma unroll
      for (int i = 0; i < size(acc_s); ++i) {
        const int s = attention::column_slot_of(i);
        float x = acc_s(i);
        if (softcap) x = tanhf(x * cols.qk[s]);
        if (!interior) {
          const int key = tile * Config::kTileKeys + 16 * warp + lane / 4 +
                          8 * attention::row_half_of(i);
          x = attention::key_visible(key, cols.pos[s], item.kv_len, window)
                  ? x
                  : -INFINITY;
        }
        acc_s(i) = x;
      }
    }
    float alpha[kSlots];
    softmax.update(acc_s, cols.scale, alpha, reduce, parity, g.barrier());
    parity ^= 1;
    bool moved = false;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) moved |= alpha[s] != 1.f;
    if (__any_sync(0xffffffffu, moved)) attention::scale_columns(acc_o, alpha);

    // P^T for the wgmma. 16-bit: 8 x 8 blocks by stmatrix.trans; FP8: one
    // element per value (its key and column), at the key's k-position in
    // V^T's order.
    if constexpr (Config::kFp8) {
#pragma unroll
      for (int i = 0; i < size(acc_s); ++i) {
        int key = 16 * warp + lane / 4 + 8 * attention::row_half_of(i);
        key = (key & ~15) | attention::position_of_prob_key(key & 15);
        store_shared_byte(p_address(attention::fragment_column(i, lane), key),
                          Element(acc_s(i)).storage);
      }
    } else {
      attention::store_probs_transposed<Element, Config::kWgRows>(
          acc_s, warp, lane, p_address);
    }

    const auto v = RingState<Config::kVStages>::of(it);
    FullBarrier::wait(&bar.v_full[v.stage], v.phase);
    const int valid = item.kv_len - tile * Config::kTileKeys;
    if (!Config::kFp8 && valid < Config::kTileKeys) {
      // (FP8: zeroed by the transposition.)
      attention::PagedKvTile<
          Config::kTileKeys, Config::kChunks,
          Config::kRowBytes>::zero_keys_from(smem + Config::kVOffset +
                                                 v.stage * Config::kStageBytes,
                                             valid, g.tid, 128);
    }
    // Orders the zeros and the P^T stores above before the wgmma.
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(g.barrier(), 128);
    attention::wgmma_batch(mma_o, tOrV(_, _, _, v.stage), tOrP, acc_o, false);
    v_in_flight = v.stage;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc_o);
  if (v_in_flight >= 0) attention::release(&bar.v_empty[v_in_flight]);
}

}  // namespace decode
}  // namespace hpc
