// Consumer side of the paged prefill kernel: the two consumer warpgroups'
// S = Q K^T, masking, online softmax and O += P V over one query tile's key
// tiles, last first, with the next tile's S = Q K^T issued before this
// tile's O += P V so that the softmax of one overlaps the other's wgmma.
//
// Per key tile (after the first):
//   issue S = Q K[n]^T      issue O += P[n + 1] V[n + 1]
//   wait S; release K[n]; softmax(S) -> P (fp32), row factors alpha
//   wait O; release V[n + 1]; O *= alpha; P -> MMA type
// Only key tiles that are not interior to the query tile's visible range
// (mask.h: the diagonal, the sequence's end, a window's start) are masked.
// FP8 caches: P is rounded to E4M3 (fp8_operands.cuh); queries quantized
// in the kernel take their row scales from the staging tile.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cute/tensor.hpp>

#include "attention/common/fp8_operands.cuh"
#include "attention/common/mask.h"
#include "attention/common/named_barriers.h"
#include "attention/common/online_softmax.cuh"
#include "attention/common/packed_pair.cuh"
#include "attention/common/paged_kv_tma.cuh"
#include "attention/common/warpgroup.cuh"
#include "attention/prefill/prefill_config.cuh"
#include "attention/prefill/prefill_params.h"
#include "attention/prefill/prefill_pipeline.cuh"
#include "attention/prefill/prefill_tile_scheduler.cuh"
#include "common/sync.cuh"

namespace hpc {
namespace prefill {

// Per-row constants of a consumer thread's two rows in the current tile.
struct RowInfo {
  bool live[2];     // a real (token, head) of the request
  int tile_row[2];  // row of the 128-row tile
  int token[2];     // token index within the batch
  int head[2];      // query head
  int pos[2];       // query position (-1 for rows that are not live)
  float logit[2];   // factor of q.k: scale and the K and query scales
  float qk[2];      // factor of q.k before the soft-cap's tanh (softcap only)
  float scale[2];   // the softmax's logit scale, log2 domain (> 0)

  // Sets row half h's factor of q.k and the scales derived from it.
  __device__ void set_logit(const PrefillParams& p, int h, float s) {
    logit[h] = s;
    // A zero scale (an all-zero query row) would turn -inf into NaN.
    s = fmaxf(s, 1e-30f);
    qk[h] = p.softcap > 0.f ? s / p.softcap : s;
    scale[h] = (p.softcap > 0.f ? p.softcap : s) * attention::kLog2e;
  }
};

__device__ __forceinline__ RowInfo row_info(const PrefillParams& p,
                                            const TileWork& w,
                                            const int (&rows)[2]) {
  RowInfo r;
  const float k_scale = p.k_scale ? *p.k_scale : 1.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = rows[h] / p.group;
    r.live[h] = rows[h] < p.group * p.tile_tokens && t < w.tokens;
    r.tile_row[h] = rows[h];
    r.token[h] = w.q_begin + w.token0 + t;
    r.head[h] = w.kv_head * p.group + rows[h] % p.group;
    r.pos[h] = r.live[h] ? w.position(t) : -1;
    float s = p.scale * k_scale;
    if (p.q_type == ElemType::kFp8E4m3 && r.live[h]) {
      s *= p.q_scale[static_cast<int64_t>(r.token[h]) * p.q_scale_token_stride +
                     r.head[h]];
    }
    r.set_logit(p, h, s);
  }
  return r;
}

// Scores of key tile n in place: soft-cap (tanh(s * qk), the cap itself in
// the softmax scale) and mask (kMask).
template <bool kMask, class FragS>
__device__ __forceinline__ void scores(const PrefillParams& p,
                                       const TileWork& w, const RowInfo& r,
                                       int key0, FragS& s) {
  const bool softcap = p.softcap > 0.f;
#pragma unroll
  for (int i = 0; i < int(cute::size(s)); ++i) {
    const int h = attention::row_half_of(i);
    float x = s(i);
    if (softcap) x = tanhf(x * r.qk[h]);
    if constexpr (kMask) {
      const int key = key0 + attention::fragment_column(i, threadIdx.x % 32);
      x = attention::key_visible(key, r.pos[h], w.kv_len, p.window) ? x
                                                                    : -INFINITY;
    }
    s(i) = x;
  }
}

// The consumer warpgroups issue their wgmma batches in turns (when
// kEnabled): while one warpgroup's S = Q K^T and O += P V run, the other
// computes its softmax, so the tensor cores alternate between them instead
// of both warpgroups' batches queueing together. Every take() of one
// warpgroup is matched by a pass() of the other; warpgroup 0 goes first.
template <bool kEnabled>
struct WarpgroupTurns {
  int warpgroup;

  static constexpr int kThreads = 256;  // the waiting and the passing one

  __device__ static int id(int wg) {
    return static_cast<int>(attention::PrefillBarrier::kWarpgroup0Turn) + wg;
  }
  __device__ void start() const {
    if (kEnabled && warpgroup == 1) named_barrier_arrive(id(0), kThreads);
  }
  __device__ void take() const {
    if (kEnabled) named_barrier_sync(id(warpgroup), kThreads);
  }
  __device__ void pass() const {
    if (kEnabled) named_barrier_arrive(id(1 - warpgroup), kThreads);
  }
  // Warpgroup 1's start() left warpgroup 0 one turn ahead.
  __device__ void finish() const {
    if (kEnabled && warpgroup == 0) named_barrier_sync(id(0), kThreads);
  }
};

// Runs one query tile; leaves O (unnormalised) in `acc_o` and the row
// statistics in `softmax`. `pos` carries the pipeline's position from tile
// to tile. Queries quantized in the kernel (FP8 caches, 16-bit queries)
// fold their row scales into `rows` once the Q tile has landed.
template <class Config, class FragO>
__device__ void mma_tile(const PrefillParams& p, const TileWork& w,
                         RowInfo& rows, uint8_t* smem,
                         typename Config::Barriers& bar,
                         typename Config::Pipeline& pos,
                         const WarpgroupTurns<Config::kTakeTurns>& turns,
                         FragO& acc_o, typename Config::Softmax& softmax) {
  using namespace cute;
  using Element = typename Config::Element;
  constexpr int kBlockM = Config::kBlockM;
  constexpr int kBlockN = Config::kBlockN;
  const int tid = threadIdx.x - kProducerThreads;

  typename Config::TiledMmaQK mma_qk;
  typename Config::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                          typename Config::SmemLayoutQ{});
  Tensor sK = make_tensor(
      make_smem_ptr(reinterpret_cast<Element*>(smem + Config::kKOffset)),
      typename Config::SmemLayoutK{});
  Tensor sVt = make_tensor(
      make_smem_ptr(reinterpret_cast<Element*>(smem + Config::kVOffset)),
      typename Config::SmemLayoutVt{});
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // (V, M, K)
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (V, N, K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (V, D, N, stage)
  Tensor acc_s =
      partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor frag_p = make_tensor<Element>(
      partition_shape_A(mma_pv, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  static_assert(size(acc_s) == size(frag_p));

  auto softmax_step = [&](int n, float (&alpha)[2]) {
    if (w.keys.interior(n)) {
      if (p.softcap > 0.f) scores<false>(p, w, rows, n * kBlockN, acc_s);
    } else {
      scores<true>(p, w, rows, n * kBlockN, acc_s);
    }
    softmax.update(acc_s, rows.scale, alpha);
  };
  // P in the MMA type: two probabilities per packed conversion (16-bit),
  // four per register (E4M3, in the order of V^T's keys).
  auto convert_p = [&] {
    Tensor p2 = recast<uint32_t>(frag_p);
    if constexpr (Config::kFp8) {
      attention::probabilities_to_e4m3(acc_s, p2);
    } else {
#pragma unroll
      for (int i = 0; i < size(p2); ++i) {
        p2(i) = attention::pack2<Element>(acc_s(2 * i), acc_s(2 * i + 1));
      }
    }
  };
  // O += P V over stage s; the first product of the tile initialises O.
  bool first_pv = true;
  auto issue_pv = [&](int s) {
    warpgroup_fence_operand(frag_p);
    attention::wgmma_batch(mma_pv, frag_p, tOrV(_, _, _, s), acc_o, first_pv);
    first_pv = false;
  };

  softmax.reset();
  if (Config::quantizes_queries(p)) {
    // The scales the transposing warps quantize with, read from the staging
    // tile while they quantize (it is released with the Q tile, below). A
    // quad of lanes holds a row.
    FullBarrier::wait(&bar.q_staged, pos.q_phase);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float q_scale = Config::StagedQ::template row_scale<4>(
          smem + Config::kQStagingOffset, rows.tile_row[h], tid % 4,
          p.q_type == ElemType::kBf16);
      rows.set_logit(p, h, rows.logit[h] * q_scale);
    }
  }
  FullBarrier::wait(&bar.q_full, pos.q_phase);
  pos.q_phase ^= 1;

  // First key tile (the last one of the range). `pv`: the V stage of the
  // key tile whose O += P V is pending.
  int n = w.keys.tile_end - 1;
  RingState<Config::kVStages> pv = pos.v;
  {
    FullBarrier::wait(&bar.k_full[pos.k.stage], pos.k.phase);
    turns.take();
    attention::wgmma_batch(mma_qk, tSrQ, tSrK(_, _, _, pos.k.stage), acc_s,
                           true);
    turns.pass();
    warpgroup_wait<0>();
    attention::release(&bar.k_empty[pos.k.stage]);
    float alpha[2];
    softmax_step(n, alpha);
    convert_p();
    if constexpr (!Config::kFp8) {
      // The sequence's last key tile (read first) may hold stale slots
      // (FP8: zeroed by the transposition).
      const int valid = w.kv_len - n * kBlockN;
      if (valid < kBlockN) {
        FullBarrier::wait(&bar.v_full[pv.stage], pv.phase);
        // Both consumer warpgroups share the stage, so both take part.
        attention::PagedKvTile<kBlockN, Config::kChunks, Config::kRowBytes>::
            zero_keys_from(
                smem + Config::kVOffset + pv.stage * Config::kStageBytes, valid,
                tid, kConsumerThreads);
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync(
            static_cast<int>(attention::PrefillBarrier::kConsumers),
            kConsumerThreads);
      }
    }
    pos.k.advance();
    pos.v.advance();
  }
  for (--n; n >= w.keys.tile_begin; --n) {
    FullBarrier::wait(&bar.k_full[pos.k.stage], pos.k.phase);
    FullBarrier::wait(&bar.v_full[pv.stage], pv.phase);
    turns.take();
    attention::wgmma_batch(mma_qk, tSrQ, tSrK(_, _, _, pos.k.stage), acc_s,
                           true);
    issue_pv(pv.stage);
    turns.pass();
    warpgroup_wait<1>();
    attention::release(&bar.k_empty[pos.k.stage]);
    float alpha[2];
    softmax_step(n, alpha);
    warpgroup_wait<0>();
    attention::release(&bar.v_empty[pv.stage]);
    // Once the running maxima settle, O needs no rescaling.
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
      attention::scale_rows(acc_o, alpha);
    }
    convert_p();
    pv = pos.v;
    pos.k.advance();
    pos.v.advance();
  }
  // Every S = Q K^T of the tile is done: the next tile's Q (and staged
  // queries) may come.
  attention::release(&bar.q_empty);
  FullBarrier::wait(&bar.v_full[pv.stage], pv.phase);
  turns.take();
  issue_pv(pv.stage);
  turns.pass();
  warpgroup_wait<0>();
  attention::release(&bar.v_empty[pv.stage]);
}

}  // namespace prefill
}  // namespace hpc
