// Epilogues of the grouped FP8 GEMMs (moe_gemm.cuh). Each consumer thread
// holds acc(i) = out[weight row, token] with coord(i) = (row within its
// warpgroup's 128, token within the tile). Both stage through a shared
// memory area apart from the pipeline's stages (GemmConfig::kStagingOffset):
// a CTA's pipeline keeps loading its next block meanwhile; a CTA of one
// block (GemmConfig::kOneBlock) stages in its stage buffers instead.
//
//   merge_split_k      gate-up with split K: the split CTAs of an output
//                      tile are one cluster; the others write their partial
//                      sums into the leader's free stage buffers (DSMEM), and
//                      the leader adds them in split order (deterministic)
//                      and goes on
//   gate_up_epilogue   h = SiLU(gate) * up, quantized to FP8 (static
//                      per-tensor scale, or 1 x 128 groups: the CTA's 128
//                      columns are one group of each token), stored to the
//                      intermediate by row (moe_tiles.cuh); both
//                      warpgroups take half the columns
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

// Every thread of a split tile's cluster, once the leader has read the
// partial sums (merge_split_k()): no CTA leaves before, so the leader's
// shared memory outlives every write into it, as distributed shared memory
// requires. The partials_ready wait alone orders the leader's reads after
// the writes; this barrier states the lifetime as well, where tools (and
// readers) look for it, and costs the others only the leader's read.
__device__ __forceinline__ void leave_split_cluster() {
  __syncwarp();
  cluster_sync();
}

// The split CTAs of an output tile run as one cluster, cluster rank = split
// index. No global memory round trip: a load or an atomic issued by a CTA
// now waits behind the weight copies its SM has in flight, several µs,
// whereas shared memory of the cluster answers at once. Returns false in
// every CTA but the leader (rank 0), whose `acc` then holds the sum over all
// K ranges, added in rank order. `stages`: the CTA's stage buffers, all of
// whose copies have landed and been read once the mainloop is done. Every
// consumer thread of the cluster calls it, and each producer thread calls
// leave_split_cluster() once its loads are issued.
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
    leave_split_cluster();
    return true;
  }
  cluster_wait_acquire(&barriers->stages_free, 0);
  float* leader = map_to_cta(partials, 0) + (rank - 1) * kSlot;
#pragma unroll
  for (int i = 0; i < cute::size(acc); ++i) {
    leader[i * kConsumerThreads + t] = acc(i);
  }
  cluster_arrive_remote(&barriers->partials_ready, 0);
  leave_split_cluster();
  return false;
}

// The epilogues stage values by token row, in groups of 8 columns (32 bytes
// of fp32, 16 of 16-bit values) that swap places by the token's bits 1..2:
// the four tokens a warp's quads write at once (lanes 4 apart hold tokens 2
// apart) then fall in other banks, and a group stays one contiguous unit.
// The place of column `col` in token `tok`'s staged row.
__device__ __forceinline__ int staged_column(int tok, int col) {
  return col ^ (((tok >> 1) & 3) << 3);
}

// Float index of column `col` of token `tok` in gate_up_epilogue()'s staged
// h values, [kTokens][128].
__device__ __forceinline__ int staged_h_index(int tok, int col) {
  return tok * kWgRows + staged_column(tok, col);
}

// Stores the tile's h values into the intermediate's columns [n0, n0 +
// kCols) quantized to FP8, 16 columns of one token per thread in two 8-byte
// stores: `h4(tok, col)` gives the float4 of columns col..col + 3 (relative
// to n0) of token `tok`, `scale_of(tok, col)` the token's scale for its
// chunk at `col` (called first for the chunk). Rows past the tile's and
// columns past the intermediate are skipped.
template <int kTokens, int kCols, class H4, class ScaleOf>
__device__ void store_inter_rows(const MoeParams& p, const TileInfo& tile,
                                 const int* rows, int n0, H4 h4,
                                 ScaleOf scale_of) {
  uint8_t* inter = p.workspace + p.layout.inter_q();
  constexpr int kChunks = kCols / 16;
  for (int i = threadIdx.x; i < kTokens * kChunks; i += kConsumerThreads) {
    const int tok = i / kChunks;
    const int col = (i % kChunks) * 16;
    if (tok >= tile.rows || n0 + col >= p.inter) continue;
    const float scale = scale_of(tok, col);
    uint8_t* dst = inter + int64_t(rows[tok]) * p.inter + n0 + col;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float h[8];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float4 f = h4(tok, col + 8 * half + 4 * q);
        h[4 * q] = f.x;
        h[4 * q + 1] = f.y;
        h[4 * q + 2] = f.z;
        h[4 * q + 3] = f.w;
      }
      // Divided, as the quantize stage does (moe_quantize.cuh).
      store8_fp8_divided(dst + 8 * half, h, scale);
    }
  }
}

// `rows`: the tile's rows (moe_tiles.cuh). `static_scale`: the
// intermediate's per-tensor scale (unused block-wise), read by the caller
// before its mainloop.
//
// Both warpgroups finish half the columns: warpgroup w takes the w-th 64-row
// block of its accumulator (columns 64w..64w+63 of the 128) and trades the
// other block through shared memory, so the epilogue, which the CTA's next
// loads wait behind, runs on all eight consumer warps. The h values are then
// staged by token row, and each thread quantizes 16 columns of one token
// (one scale) into two 8-byte stores.
template <int kTokens, GemmScaling kScaling, class Acc, class Coord>
__device__ void gate_up_epilogue(const MoeParams& p, const TileInfo& tile,
                                 const int* rows, int n0, float static_scale,
                                 Acc& acc, const Coord& coord,
                                 uint8_t* staging) {
  using cute::get;
  constexpr int kValues = kAccValues<Acc>;
  static_assert(decltype(cute::size<1>(acc))::value == 2 &&
                kValues * 128 * sizeof(float) == kTokens * kCtaRows * 2);
  constexpr int kBlockValues = kValues / 2;  // one 64-row block's
  const int wg = threadIdx.x / 128;
  const int t = threadIdx.x % 128;
  // [warpgroup][value][thread]: warpgroup 0's gate values of block 1 and
  // warpgroup 1's up values of block 0; then the h values [kTokens][128].
  float* staged = reinterpret_cast<float*>(staging);
  int* token_amax =
      reinterpret_cast<int*>(staging + kValues * 128 * sizeof(float));
  // f(Int<m>) for block m: the accumulator is indexed by compile-time
  // blocks only, which keeps it in registers.
  auto on_block = [](int m, auto&& f) {
    if (m == 0) {
      f(cute::Int<0>{});
    } else {
      f(cute::Int<1>{});
    }
  };

  // Both warpgroups are past their wgmma (and the previous block's stores
  // have read the staging area; a CTA of one block stages in its stage
  // buffers, which the wgmma read) before the trade.
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);
  on_block(1 - wg, [&](auto m) {
#pragma unroll
    for (int v = 0; v < kBlockValues; ++v) {
      staged[(wg * kBlockValues + v) * 128 + t] = acc(v, m, 0);
    }
  });
  const bool block_wise = kScaling != GemmScaling::kPerTensor && p.block_wise;
  if (block_wise && threadIdx.x < kTokens) token_amax[threadIdx.x] = 0;
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);

  // h = SiLU(gate) * up for block `wg`.
  const float* other = staged + (1 - wg) * kBlockValues * 128;
  on_block(wg, [&](auto m) {
#pragma unroll
    for (int v = 0; v < kBlockValues; ++v) {
      const float theirs = other[v * 128 + t];
      if constexpr (m == 0) {
        acc(v, m, 0) = silu(acc(v, m, 0)) * theirs;
      } else {
        acc(v, m, 0) = silu(theirs) * acc(v, m, 0);
      }
    }
  });
  if (block_wise) {
    // Amax per token over the 128 columns: lanes of one quad hold other
    // tokens, lanes 4 apart the same ones, so reduce over lane bits 2..4.
    on_block(wg, [&](auto m) {
#pragma unroll
      for (int v = 0; v < kBlockValues; ++v) {
        float a = fabsf(acc(v, m, 0));
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 4));
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 8));
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 16));
        if (t % 32 < 4) {
          atomicMax(&token_amax[get<1>(coord(v, m, 0))], __float_as_int(a));
        }
      }
    });
  }
  // Every traded value read.
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);
  on_block(wg, [&](auto m) {
#pragma unroll
    for (int v = 0; v < kBlockValues; ++v) {
      const auto c = coord(v, m, 0);
      staged[staged_h_index(get<1>(c), get<0>(c))] = acc(v, m, 0);
    }
  });
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);

  // The intermediate's columns [n0, n0 + 128), and block-wise, the token's
  // scale of that group.
  float* inter_scale =
      reinterpret_cast<float*>(p.workspace + p.layout.inter_scale());
  store_inter_rows<kTokens, kWgRows>(
      p, tile, rows, n0,
      [&](int tok, int col) {
        return *reinterpret_cast<const float4*>(staged +
                                                staged_h_index(tok, col));
      },
      [&](int tok, int col) {
        if (!block_wise) return static_scale;
        const float scale = dynamic_scale(__int_as_float(token_amax[tok]));
        if (col == 0) {
          inter_scale[int64_t(rows[tok]) * ceil_div(p.inter, kScaleBlock) +
                      n0 / kScaleBlock] = scale;
        }
        return scale;
      });
}

// Gate-up epilogue of wide warpgroups (GemmConfig::kWide: kRows = 192
// rows each, the CTA's one column block): both warpgroups stage their values
// (warpgroup 0 the gate's, 1 the up's) as fp32 [2][kTokens][kRows] in the
// stage buffers, free once both are past their wgmma (staged_column()).
// Then each thread makes h = SiLU(gate) * up
// for 16 columns of a token and stores them quantized with the per-tensor
// scale (wide warpgroups are per-tensor only) into two 8-byte stores.
template <int kTokens, int kRows, class Acc, class Coord>
__device__ void gate_up_epilogue_wide(const MoeParams& p, const TileInfo& tile,
                                      const int* rows, int n0,
                                      float static_scale, const Acc& acc,
                                      const Coord& coord, uint8_t* stages) {
  using cute::get;
  static_assert(kAccValues<Acc> * 128 == kTokens * kRows);
  const int wg = threadIdx.x / 128;
  float* staged = reinterpret_cast<float*>(stages);
  auto index = [](int w, int tok, int col) {
    return (w * kTokens + tok) * kRows + staged_column(tok, col);
  };
  // Both warpgroups' wgmma are done, and with them every read of the
  // stages (all of whose copies the mainloop waited for).
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);
#pragma unroll
  for (int i = 0; i < cute::size(acc); ++i) {
    staged[index(wg, get<1>(coord(i)), get<0>(coord(i)))] = acc(i);
  }
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);

  store_inter_rows<kTokens, kRows>(
      p, tile, rows, n0,
      [&](int tok, int c) {
        const float4 g =
            *reinterpret_cast<const float4*>(staged + index(0, tok, c));
        const float4 u =
            *reinterpret_cast<const float4*>(staged + index(1, tok, c));
        return make_float4(silu(g.x) * u.x, silu(g.y) * u.y, silu(g.z) * u.z,
                           silu(g.w) * u.w);
      },
      [&](int, int) { return static_scale; });
}

// Element index of weight row `row` of token `tok` in down_epilogue()'s
// staged rows, [kTokens][kCtaRows] (unswizzled, the 512-byte token rows
// would put the four tokens a warp's quads write in the same four banks).
__device__ __forceinline__ int staged_down_index(int tok, int row) {
  return tok * kCtaRows + staged_column(tok, row);
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
    staged[staged_down_index(cute::get<1>(coord(i)), row)] =
        __float2bfloat16(acc(i));
  }
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);

  // The copy-out: a thread takes one 16-byte chunk (8 rows of H) of every
  // kTokensPerPass-th token. The row indices and chunks of kBatch tokens are
  // loaded before any of them is stored, so their shared-memory latencies
  // overlap instead of each store waiting for its own.
  __nv_bfloat16* down =
      reinterpret_cast<__nv_bfloat16*>(p.workspace + p.layout.down_rows());
  constexpr int kChunks = kCtaRows / 8;
  constexpr int kTokensPerPass = kConsumerThreads / kChunks;
  constexpr int kPasses = (kTokens + kTokensPerPass - 1) / kTokensPerPass;
  constexpr int kBatch = kPasses < 4 ? kPasses : 4;
  static_assert(kPasses % kBatch == 0);
  const int chunk = threadIdx.x % kChunks;
  const int col = n0 + chunk * 8;
  if (col >= p.hidden) return;
  for (int pass0 = 0; pass0 < kPasses; pass0 += kBatch) {
    if (pass0 * kTokensPerPass >= tile.rows) break;
    int64_t dst[kBatch];
    uint4 chunk_values[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int tok = (pass0 + b) * kTokensPerPass + threadIdx.x / kChunks;
      dst[b] = tok < tile.rows ? int64_t(rows[tok]) * p.hidden + col : -1;
      chunk_values[b] = *reinterpret_cast<const uint4*>(
          staged + staged_down_index(tok, chunk * 8));
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (dst[b] >= 0) {
        *reinterpret_cast<uint4*>(down + dst[b]) = chunk_values[b];
      }
    }
  }
}

}  // namespace moe
}  // namespace hpc
