// The consumers of token-major GEMM tiles (moe_tiling.h: kTokenMajorTile):
// the tile's 128 tokens are the wgmma M side, 64 per consumer warpgroup,
// and a stage's 128 weight rows (two boxes of moe_gemm.cuh's producer) the
// N side, so both warpgroups read the same weights and their own tokens.
// Block-wise scaling only: each k-block's product goes into a block
// accumulator and is folded into the result with the k-block's scales, two
// token scales a thread (the rows its accumulator holds) and one weight
// scale per 64-row box.
//
//   gate-up   box 0 holds 64 gate rows, box 1 the matching up rows, so a
//             thread has a column's gate value at N index n and its up value
//             at n + 64: h = SiLU(gate) * up needs no exchange. The CTA's two
//             blocks are one 128-column scale group: both stage their h
//             values and per-token amax, and the second quantizes the group
//             (store_inter_rows()).
//   down      16-bit rows of 128 hidden rows, staged and copied out to each
//             (token, expert) pair's row (store_down_rows()).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "common/sync.cuh"
#include "moe/moe_activation.cuh"
#include "moe/moe_gemm.cuh"
#include "moe/moe_gemm_epilogue.cuh"
#include "moe/moe_params.h"
#include "moe/moe_token_source.cuh"

namespace hpc {
namespace moe {

// Both consumer warpgroups along M (64 tokens each), the stage's weight rows
// as N.
template <class Config>
using TokenMajorMma = decltype(cute::make_tiled_mma(
    cute::GMMA::ss_op_selector<
        typename Config::Fp8, typename Config::Fp8, float,
        cute::Shape<cute::_64, cute::Int<kTokenMajorRows>, cute::_32>>(),
    cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));

// A stage's two weight boxes as one (N, K, stage) operand.
template <class Config>
using TokenMajorWeightLayout = decltype(cute::tile_to_shape(
    typename Config::Atom{},
    cute::Shape<cute::Int<kTokenMajorRows>, cute::Int<kTileK>,
                cute::Int<Config::kStages>>{}));

// acc = sum over k-blocks [kb_begin, kb_end) of (X[tokens] . W[rows from
// n0]^T) * activation scale * weight scale. `stage` and `phase` carry the
// ring's position from one block to the next.
template <bool kGateUp, class Config, class Acc, class Coord>
__device__ void token_major_mma_stages(const MoeParams& p, const TileInfo& tile,
                                       int n0, const int64_t* src, int kb_begin,
                                       int kb_end, uint8_t* smem,
                                       uint64_t* full, uint64_t* empty,
                                       Acc& acc, const Coord& coord, int& stage,
                                       uint32_t& phase) {
  using namespace cute;
  using Fp8 = typename Config::Fp8;
  static_assert(Config::kTokenMajor);
  const int lane = threadIdx.x % 32;
  Tensor weights = make_tensor(make_smem_ptr(reinterpret_cast<Fp8*>(smem)),
                               TokenMajorWeightLayout<Config>{});
  Tensor tokens = make_tensor(
      make_smem_ptr(reinterpret_cast<Fp8*>(smem + Config::kWeightBytes)),
      typename Config::TokenLayout{});
  TokenMajorMma<Config> mma;
  auto thr = mma.get_thread_slice(threadIdx.x);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(tokens));   // (V,M,K,S)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(weights));  // (V,N,K,S)
  // Values are ((column pair, row half, 8-column group), 1, 1): the token
  // depends on the row half only, the weight box on the group.
  constexpr int kGroups = kTokenMajorRows / 8;
  static_assert(decltype(size(acc))::value == 2 * 2 * kGroups);

  const TokenSource<kGateUp> source = TokenSource<kGateUp>::make(p);
  const ScaleView& w_scale = kGateUp ? p.w13_scale : p.w2_scale;
  // Scale-block rows of the two boxes: the gate's and the up's rows of the
  // column block (gate-up), or the 128 rows' one block (down).
  const int64_t box_block[2] = {
      n0 / kScaleBlock,
      (kGateUp ? int64_t(p.inter) + n0 : int64_t(n0)) / kScaleBlock};
  int tok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tok[h] = get<0>(coord(make_coord(make_coord(0, h, 0), 0, 0)));
  }

  Tensor blk = make_fragment_like(acc);
  clear(acc);
  for (int kb = kb_begin; kb < kb_end; ++kb) {
    // Loaded before the stage wait, whose latency hides theirs.
    float scale[2][2];  // [row half][box]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float st =
          tok[h] < tile.rows ? source.scale.at(src[tok[h]], kb) : 0.f;
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        scale[h][b] = st * w_scale.at(tile.expert, box_block[b], kb);
      }
    }

    FullBarrier::wait(&full[stage], phase);
    // Token rows copied by cp.async came through the generic proxy.
    cutlass::arch::fence_view_async_shared();
    issue_block_product(mma, tCrA, tCrB, stage, blk);
    warpgroup_wait<0>();
    warpgroup_fence_operand(blk);
    __syncwarp();
    if (lane == 0) EmptyBarrier::arrive(&empty[stage]);

#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const auto v = make_coord(make_coord(c, h, j), 0, 0);
          acc(v) += blk(v) * scale[h][j < kGroups / 2 ? 0 : 1];
        }
      }
    }
    if (++stage == Config::kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
}

// Gate-up block of the 64 columns from n0: h = SiLU(gate) * up staged as
// fp32 [kTokens][128] by token (staged_h_index()), its per-token amax
// merged; the group's second block then stores the group quantized, with
// each token's scale.
template <class Config, class Acc, class Coord>
__device__ void token_major_gate_up_epilogue(const MoeParams& p,
                                             const TileInfo& tile,
                                             const int* rows, int n0,
                                             const Acc& acc, const Coord& coord,
                                             uint8_t* staging) {
  using cute::get;
  using cute::make_coord;
  constexpr int kTokens = Config::kTokens;
  constexpr int kGroups = kTokenMajorRows / 8;
  float* staged = reinterpret_cast<float*>(staging);
  int* token_amax =
      reinterpret_cast<int*>(staging + kTokens * kScaleBlock * sizeof(float));
  const int half = n0 / kTokenMajorGateUpColumns % kTokenMajorGateUpGroup;
  const int lane = threadIdx.x % 32;
  if (half == 0) {
    // The previous group's stores have read the staging area, then the
    // amax is cleared before any thread merges into it.
    named_barrier_sync(kConsumerBarrier, kConsumerThreads);
    if (threadIdx.x < kTokens) token_amax[threadIdx.x] = 0;
    named_barrier_sync(kConsumerBarrier, kConsumerThreads);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int tok = get<0>(coord(make_coord(make_coord(0, h, 0), 0, 0)));
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kGroups / 2; ++j) {
      float v[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float gate = acc(make_coord(make_coord(c, h, j), 0, 0));
        const float up =
            acc(make_coord(make_coord(c, h, j + kGroups / 2), 0, 0));
        v[c] = silu(gate) * up;
        amax = fmaxf(amax, fabsf(v[c]));
      }
      const int col = half * kTokenMajorGateUpColumns +
                      get<1>(coord(make_coord(make_coord(0, h, j), 0, 0)));
      *reinterpret_cast<float2*>(staged + staged_h_index(tok, col)) =
          make_float2(v[0], v[1]);
    }
    // The four lanes of a quad hold the same two tokens.
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    if (lane % 4 == 0) atomicMax(&token_amax[tok], __float_as_int(amax));
  }
  if (half == 0) return;
  // The group's h values and amax are all staged.
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);
  const int group_n0 = n0 - kTokenMajorGateUpColumns;
  store_inter_rows<kTokens, kScaleBlock>(
      p, tile, rows, group_n0,
      [&](int tok, int col) {
        return *reinterpret_cast<const float4*>(staged +
                                                staged_h_index(tok, col));
      },
      [&](int tok, int col) {
        return group_scale_of(p, rows, group_n0, token_amax, tok, col);
      });
}

// Down block of the 128 hidden rows from n0: 16-bit values staged by token,
// then copied out to each (token, expert) pair's row.
template <class Config, class Acc, class Coord>
__device__ void token_major_down_epilogue(const MoeParams& p,
                                          const TileInfo& tile, const int* rows,
                                          int n0, const Acc& acc,
                                          const Coord& coord,
                                          uint8_t* staging) {
  using cute::get;
  using cute::make_coord;
  constexpr int kGroups = kTokenMajorRows / 8;
  __nv_bfloat16* staged = reinterpret_cast<__nv_bfloat16*>(staging);
  // The previous block's stores have read the staging area.
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const auto c0 = coord(make_coord(make_coord(0, h, j), 0, 0));
      *reinterpret_cast<__nv_bfloat162*>(
          staged + staged_down_index<kTokenMajorRows>(get<0>(c0), get<1>(c0))) =
          __floats2bfloat162_rn(acc(make_coord(make_coord(0, h, j), 0, 0)),
                                acc(make_coord(make_coord(1, h, j), 0, 0)));
    }
  }
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);
  store_down_rows<Config::kTokens, kTokenMajorRows>(p, tile, rows, n0, staged);
}

// Both consumer warpgroups of a token-major CTA: every block of `range`,
// mainloop and epilogue.
template <bool kGateUp, class Config>
__device__ void token_major_consumers(const MoeParams& p, const TileInfo& tile,
                                      const int* tile_rows,
                                      const int64_t* token_src,
                                      const WorkRange& range, uint8_t* smem,
                                      uint64_t* full, uint64_t* empty) {
  using namespace cute;
  TokenMajorMma<Config> mma;
  auto thr = mma.get_thread_slice(threadIdx.x);
  const auto tile_shape =
      make_shape(Int<Config::kTokens>{}, Int<kTokenMajorRows>{});
  Tensor acc = partition_fragment_C(mma, tile_shape);
  const Tensor coord = thr.partition_C(make_identity_tensor(tile_shape));
  int stage = 0;
  uint32_t phase = 0;
  for (int block = range.block_begin; block < range.block_end; ++block) {
    const int n0 = block_row<kGateUp, Config>(block);
    token_major_mma_stages<kGateUp, Config>(
        p, tile, n0, token_src, range.kb_begin, range.kb_end, smem, full, empty,
        acc, coord, stage, phase);
    if constexpr (kGateUp) {
      token_major_gate_up_epilogue<Config>(p, tile, tile_rows, n0, acc, coord,
                                           smem + Config::kStagingOffset);
    } else {
      token_major_down_epilogue<Config>(p, tile, tile_rows, n0, acc, coord,
                                        smem + Config::kStagingOffset);
    }
  }
}

}  // namespace moe
}  // namespace hpc
