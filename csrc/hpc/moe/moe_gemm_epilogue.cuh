// Epilogues of the grouped FP8 GEMMs (moe_gemm.cuh). Each consumer thread
// holds acc(i) = out[weight row, token] with coord(i) = (row within its
// warpgroup's 128, token within the tile). Both stage through a shared
// memory area apart from the pipeline's stages (GemmConfig::kStagingOffset):
// a down CTA's pipeline keeps loading its next row block meanwhile.
//
//   merge_split_k      gate-up with split K: the split CTAs of an output
//                      tile are one cluster; the others write their partial
//                      sums into the leader's free stage buffers (DSMEM), and
//                      the leader adds them in split order (deterministic)
//                      and goes on
//   gate_up_epilogue   h = SiLU(gate) * up, quantized to FP8 (static
//                      per-tensor scale, or 1 x 128 groups: the CTA's 128
//                      columns are one group of each token), stored to the
//                      intermediate by row (moe_tiles.cuh)
//   down_epilogue      16-bit rows of each (token, expert) pair for the
//                      top-k reduction
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>

#include "common/cluster.cuh"
#include "common/sync.cuh"
#include "common/vec.cuh"
#include "moe/moe_activation.cuh"
#include "moe/moe_fp8.cuh"
#include "moe/moe_gemm.cuh"
#include "moe/moe_params.h"

namespace hpc {
namespace moe {

template <class Acc>
constexpr int kAccValues = decltype(cute::size(std::declval<Acc>()))::value;

// The split-K merge's barriers, in each CTA's shared memory: `stages_free`
// (count 1), which the leader arrives on remotely once its stage buffers may
// be overwritten, and `partials_ready` (the leader's, count (split - 1) x
// kConsumerThreads), on which every consumer thread of the others arrives
// after writing its partial sums there.
struct SplitBarriers {
  uint64_t stages_free;
  uint64_t partials_ready;
};

// The split CTAs of an output tile run as one cluster, cluster rank = split
// index. No global memory round trip: a load or an atomic issued by a CTA
// now waits behind the weight copies its SM has in flight, several µs,
// whereas shared memory of the cluster answers at once. Returns false in
// every CTA but the leader (rank 0), whose `acc` then holds the sum over all
// K ranges, added in rank order. `stages`: the CTA's stage buffers, all of
// whose copies have landed and been read once the mainloop is done.
template <class Acc>
__device__ bool merge_split_k(int split, int rank, Acc& acc, uint8_t* stages,
                              SplitBarriers* barriers) {
  constexpr int kSlot = kCtaRows * kMinTokenTile;  // floats per CTA
  static_assert(kAccValues<Acc> * kConsumerThreads == kSlot);
  const int t = threadIdx.x;
  float* partials = reinterpret_cast<float*>(stages);
  if (rank == 0) {
    // Both warpgroups are past their last wgmma: the stages are free.
    named_barrier_sync(kConsumerBarrier, kConsumerThreads);
    if (t > 0 && t < split) {
      cluster_arrive_remote(&barriers->stages_free, t);
    }
    cluster_wait_acquire(&barriers->partials_ready, 0);
#pragma unroll
    for (int i = 0; i < cute::size(acc); ++i) {
      float sum = acc(i);
      for (int r = 1; r < split; ++r) {
        sum += partials[(r - 1) * kSlot + i * kConsumerThreads + t];
      }
      acc(i) = sum;
    }
    return true;
  }
  cluster_wait_acquire(&barriers->stages_free, 0);
  float* leader = map_to_cta(partials, 0) + (rank - 1) * kSlot;
#pragma unroll
  for (int i = 0; i < cute::size(acc); ++i) {
    leader[i * kConsumerThreads + t] = acc(i);
  }
  cluster_arrive_remote(&barriers->partials_ready, 0);
  return false;
}

// `rows`: the tile's rows (moe_tiles.cuh). `static_scale`: the
// intermediate's per-tensor scale (unused block-wise), read by the caller
// before its mainloop.
template <int kTokens, class Acc, class Coord>
__device__ void gate_up_epilogue(const MoeParams& p, const TileInfo& tile,
                                 const int* rows, int n0, float static_scale,
                                 Acc& acc, const Coord& coord,
                                 uint8_t* staging) {
  constexpr int kValues = kAccValues<Acc>;
  static_assert(kValues * 128 * sizeof(float) == kTokens * kCtaRows * 2);
  const int wg = threadIdx.x / 128;
  const int t = threadIdx.x % 128;
  // The up values, then (once read) the FP8 rows in their place.
  float* up = reinterpret_cast<float*>(staging);  // [kValues][128]
  uint8_t* staged = staging;                      // [kTokens][128]
  int* token_amax =
      reinterpret_cast<int*>(staging + kValues * 128 * sizeof(float));

  // Both warpgroups are past their wgmma before the exchange.
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);
  if (wg == 1) {
#pragma unroll
    for (int i = 0; i < kValues; ++i) up[i * 128 + t] = acc(i);
  }
  if (t < kTokens && wg == 0) token_amax[t] = 0;
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);
  if (wg == 1) return;

#pragma unroll
  for (int i = 0; i < kValues; ++i) acc(i) = silu(acc(i)) * up[i * 128 + t];
  named_barrier_sync(kGateBarrier, 128);  // every up value read

  // Block-wise calls run tiles of at most kMaxBlockWiseTokenTile tokens.
  constexpr bool kMayBeBlockWise = kTokens <= kMaxBlockWiseTokenTile;
  if (kMayBeBlockWise && p.block_wise) {
    // Amax per token over the 128 columns: lanes of one quad hold other
    // tokens, lanes 4 apart the same ones, so reduce over lane bits 2..4.
#pragma unroll
    for (int i = 0; i < kValues; ++i) {
      float m = fabsf(acc(i));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
      if (t % 32 < 4) {
        atomicMax(&token_amax[cute::get<1>(coord(i))], __float_as_int(m));
      }
    }
    named_barrier_sync(kGateBarrier, 128);
    float* inter_scale =
        reinterpret_cast<float*>(p.workspace + p.layout.inter_scale());
    if (t < tile.rows) {
      const float m = __int_as_float(token_amax[t]);
      inter_scale[int64_t(rows[t]) * ceil_div(p.inter, kScaleBlock) +
                  n0 / kScaleBlock] = dynamic_scale(m);
    }
  }
#pragma unroll
  for (int i = 0; i < kValues; ++i) {
    const int row = cute::get<0>(coord(i));
    const int tok = cute::get<1>(coord(i));
    float scale = static_scale;
    if (kMayBeBlockWise && p.block_wise) {
      const float m = __int_as_float(token_amax[tok]);  // the scale above
      scale = dynamic_scale(m);
    }
    // Divided, as the quantize stage does (moe_quantize.cuh).
    staged[tok * kWgRows + row] = __nv_cvt_float_to_fp8(
        __fdiv_rn(acc(i), scale), __NV_SATFINITE, __NV_E4M3);
  }
  named_barrier_sync(kGateBarrier, 128);

  // 16-byte chunks of the tile's intermediate rows, columns [n0, n0 + 128).
  uint8_t* inter = p.workspace + p.layout.inter_q();
  constexpr int kChunks = kWgRows / 16;
  for (int c = t; c < kTokens * kChunks; c += 128) {
    const int tok = c / kChunks;
    const int col = n0 + (c % kChunks) * 16;
    if (tok < tile.rows && col < p.inter) {
      *reinterpret_cast<uint4*>(inter + int64_t(rows[tok]) * p.inter + col) =
          *reinterpret_cast<const uint4*>(staged + tok * kWgRows + col - n0);
    }
  }
}

template <int kTokens, class Acc, class Coord>
__device__ void down_epilogue(const MoeParams& p, const TileInfo& tile,
                              const int* rows, int n0, const Acc& acc,
                              const Coord& coord, uint8_t* staging) {
  const int wg = threadIdx.x / 128;
  __nv_bfloat16* staged =
      reinterpret_cast<__nv_bfloat16*>(staging);  // [kTokens][kCtaRows]
  // The previous block's stores have read the staging area.
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);
#pragma unroll
  for (int i = 0; i < cute::size(acc); ++i) {
    const int row = wg * kWgRows + cute::get<0>(coord(i));
    staged[cute::get<1>(coord(i)) * kCtaRows + row] = __float2bfloat16(acc(i));
  }
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);

  __nv_bfloat16* down =
      reinterpret_cast<__nv_bfloat16*>(p.workspace + p.layout.down_rows());
  constexpr int kChunks = kCtaRows / 8;
  for (int c = threadIdx.x; c < kTokens * kChunks; c += kConsumerThreads) {
    const int tok = c / kChunks;
    const int col = n0 + (c % kChunks) * 8;
    if (tok < tile.rows && col < p.hidden) {
      *reinterpret_cast<uint4*>(down + int64_t(rows[tok]) * p.hidden + col) =
          *reinterpret_cast<const uint4*>(staged + tok * kCtaRows + col - n0);
    }
  }
}

}  // namespace moe
}  // namespace hpc
