// Grouped FP8 GEMMs of the fused MoE pipeline (gate-up and down), on wgmma.
//
// A CTA computes one token tile of one expert against kCtaRows = 256 weight
// rows: out[row, tok] = sum_k W[row, k] * X[tok, k]. The weights are the
// wgmma A operand (M: 128 rows per consumer warpgroup) and the tile's
// tokens the B operand (N = kTokens, 8..128), both K-major FP8 in shared
// memory with the 128-byte swizzle. Roles:
//
//   producer        TMA for the weight rows (a 4-D tensor map per weight,
//                   out-of-range rows and k zero-filled), cp.async for the
//                   token rows, gathered through the route's row list by
//                   every producer thread (a warp, or a warpgroup for tiles
//                   of 64 tokens or more) and arriving on the stage's
//                   barrier as they land (TMA for the down GEMM's routed
//                   tiles, whose rows are consecutive); one mbarrier ring of
//                   kStages k-blocks of 128
//   2 consumer WGs  per-tensor calls: wgmma accumulating in place (one
//                   k-block's in flight while the next is issued, where a
//                   tile has 3 stages or more), and the scales applied once
//                   at the end; block-wise calls (tiles of at most 64
//                   tokens, moe_tiling.h): each k-block's product into a
//                   block accumulator, folded into the result with that
//                   k-block's weight and activation scales
//
// The gate-up GEMM's warpgroup 0 holds 128 gate rows and warpgroup 1 the
// matching 128 up rows, so SiLU(gate) * up pairs thread with thread; its K
// may be split over CTAs (moe_tiling.h). A CTA may take several blocks of
// its tile in turn (a WorkRange: down row blocks, or unsplit gate-up column
// blocks); the stage ring runs on across them, so the next block's weights
// stream in during this one's epilogue.
// Epilogues: moe_gemm_epilogue.cuh.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "common/cluster.cuh"
#include "common/pdl.cuh"
#include "common/sync.cuh"
#include "moe/moe_params.h"
#include "moe/moe_token_source.cuh"

namespace hpc {
namespace moe {

constexpr int kConsumerThreads = 2 * 128;
constexpr int kConsumerBarrier = 1;  // named barrier of both warpgroups

using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

// The narrowest token tile whose GEMM CTAs have a producer warpgroup
// (GemmConfig::kProducerWarpgroup).
constexpr int kProducerWarpgroupMinTokens = 64;

// kCtasPerSm: CTAs sharing an SM (moe_tiling.h: gemm_ctas_per_sm(), or
// kDenseMinTileCtasPerSm for 8-token tiles chosen so by the tiling).
// kScaling: the scalings its mainloop takes (moe_tiling.h: gemm_scaling()).
// kWgRows: weight rows per consumer warpgroup, kWideWgRows for the gate-up
// GEMM of a tiling whose gate_up_rows says so.
template <int kTokenTile, int kCtasPerSmValue, GemmScaling kScalingValue,
          int kWgRowsValue = kWgRows>
struct GemmConfig {
  static constexpr int kTokens = kTokenTile;
  static constexpr int kCtasPerSm = kCtasPerSmValue;
  static constexpr GemmScaling kScaling = kScalingValue;
  static constexpr int kWgRows = kWgRowsValue;
  static constexpr bool kWide = kWgRows == kWideWgRows;
  // The CTA's one weight block (wide warpgroups, paired 64-token gate-up
  // CTAs): its epilogue stages in the stage buffers.
  static constexpr bool kOneBlock =
      kWide || gemm_one_block_per_cta(kTokens, kCtasPerSm);
  static_assert(kTokens % 8 == 0 && kTokens <= kMaxTokenTile);
  static_assert(gemm_ctas_per_sm_supported(kTokens, kCtasPerSm));
  static_assert(kWgRows == hpc::moe::kWgRows ||
                (kWide && kTokens == kThreeQuarterTokenTile &&
                 kScaling == GemmScaling::kPerTensor));
  static_assert(kScaling == GemmScaling::kPerTensor ||
                kTokens <= kMaxBlockWiseTokenTile);
  // Block-wise-only instantiations (32- and 64-token tiles) fold each
  // k-block's product while the next k-block's wgmma runs, in two block
  // accumulators besides the result (3 x 64 a thread for 64 tokens). Each
  // k-block's token scales then come with its stage, copied by the producer
  // into shared memory, instead of registers.
  static constexpr bool kOverlappedFold = kScaling == GemmScaling::kBlockWise;
  // A CTA of two consumer warpgroups and a producer warp gets at most 168
  // registers a thread from ptxas (the 96- and 128-token tiles use all of
  // them; 64-token tiles spill). A CTA alone on its SM with tiles of 64
  // tokens or more has a producer warpgroup instead (all of it copies),
  // which hands its registers to the consumers (setmaxnreg); wide
  // warpgroups' 144 accumulators need that. 32-token tiles fit in 168
  // without spilling, and there the fourth warpgroup only costs.
  static constexpr bool kProducerWarpgroup =
      kCtasPerSm == 1 && kTokens >= kProducerWarpgroupMinTokens;
  // The producer's threads, all of which copy a stage's token rows (and
  // scales) by cp.async: a lone warp takes longer to issue a 64-token
  // stage's 512 16-byte copies than the consumers take to use the stage
  // (benchmarks/notes/moe.md, the ring timeline).
  static constexpr int kCopyThreads = kProducerWarpgroup ? 128 : 32;
  static constexpr int kThreads = kConsumerThreads + kCopyThreads;
  // What the CTA is given at launch, per thread: the register file over its
  // threads, in units of 8 (ptxas gives a kernel that uses setmaxnreg all
  // that its launch bounds allow). setmaxnreg only moves registers between
  // the CTA's own warps, so the budgets below must fit in it: an increase
  // that does not waits forever.
  static constexpr int kLaunchRegs = 64 * 1024 / kThreads / 8 * 8;
  static constexpr int kChunksPerThread =
      kTokens * (kTileK / 16) / kCopyThreads;
  // The producer keeps a 64-bit token-row address per 16-byte chunk it
  // copies a stage (kChunksPerThread); the consumers get the rest.
  static constexpr int kProducerRegs = (2 * kChunksPerThread + 40 + 7) / 8 * 8;
  static constexpr int kConsumerRegs =
      (kThreads * kLaunchRegs - 128 * kProducerRegs) / kConsumerThreads / 8 * 8;
  static_assert(!kProducerWarpgroup ||
                128 * kProducerRegs + kConsumerThreads * kConsumerRegs <=
                    kThreads * kLaunchRegs);
  // Narrow tiles keep few accumulators: two CTAs per SM with 3 stages each
  // put more weight bytes in flight per SM than one CTA with 5, and halve
  // the work per wave. Wide tiles need the registers of one CTA per SM.
  static constexpr bool kNarrow = kTokens <= kNarrowTile;
  // The widest tile's stages and epilogue staging fit in an SM with 3.
  // Three 8-token CTAs share an SM with 2 each: the same weight bytes in
  // flight per SM as two CTAs with 3, in 1.5x the CTA slots.
  // Paired 32- and 64-token CTAs take 2 each, as one took 4.
  static constexpr bool kPaired =
      !kNarrow && kCtasPerSm == kPairedTileCtasPerSm;
  static constexpr int kStages = kCtasPerSm == kDenseMinTileCtasPerSm || kPaired
                                     ? 2
                                     : (kNarrow || kTokens > 64 ? 3 : 4);
  // Whether a mainloop that accumulates in place keeps one k-block's wgmma
  // in flight while it issues the next: that stage is then released one
  // k-block later, so the producer fills kStages - 1 ahead instead of
  // kStages. With two stages that leaves one, whose fill latency shows: it
  // pays to wait for each k-block's wgmma and release its stage at once.
  static constexpr bool kWgmmaInFlight = kStages > 2;
  using Fp8 = cute::float_e4m3_t;
  using Atom = cute::GMMA::Layout_K_SW128_Atom<Fp8>;  // 8 rows x 128 bytes
  // One warpgroup's weight rows and the tile's token rows, per stage.
  using WeightLayout = decltype(cute::tile_to_shape(
      Atom{}, cute::Shape<cute::Int<kWgRows>, cute::Int<kTileK>,
                          cute::Int<kStages>>{}));
  using TokenLayout = decltype(cute::tile_to_shape(
      Atom{}, cute::Shape<cute::Int<kTokens>, cute::Int<kTileK>,
                          cute::Int<kStages>>{}));
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<
          Fp8, Fp8, float,
          cute::Shape<cute::_64, cute::Int<kTokens>, cute::_32>>()));

  static constexpr int kWgStageBytes = kWgRows * kTileK;
  static constexpr int kTokenStageBytes = kTokens * kTileK;
  // [warpgroup][stage] weights, [stage] tokens, then the epilogues' staging
  // (apart from the stages, which keep loading the CTA's next block
  // meanwhile): a tile's 256 16-bit down rows, or the gate-up's fp32 up
  // values (later its FP8 rows) and per-token amax; 1024-byte aligned.
  // A CTA of one block (kOneBlock): the staging (wide warpgroups: gate and
  // up values, fp32) in the stage buffers, free once that block is done.
  static constexpr int kWeightBytes = 2 * kStages * kWgStageBytes;
  static constexpr int kStageBytes = kWeightBytes + kStages * kTokenStageBytes;
  static constexpr int kStagingOffset = kOneBlock ? 0 : kStageBytes;
  static constexpr int kStagingBytes =
      kWide ? 2 * kTokens * kWgRows * 4 : kTokens * (kCtaRows * 2 + 4);
  static_assert(!kOneBlock || kStagingBytes <= kStageBytes);
  // Then [stage][token] fp32 activation scales (kOverlappedFold).
  static constexpr int kTokenScalesOffset =
      kOneBlock ? kStageBytes : kStagingOffset + kStagingBytes;
  static constexpr int kTokenScalesBytes =
      kOverlappedFold ? kStages * kTokens * 4 : 0;
  static constexpr int kBytes = kTokenScalesOffset + kTokenScalesBytes + 1024;
  // kCtasPerSm CTAs fit in an SM's 228 KB, with 1 KB reserved per CTA and
  // the static shared memory (barriers, the tile's rows, sources and
  // scales, find_slot_tile()'s tables; by ptxas 0.8-0.9 KB for the narrow
  // tiles that share an SM, up to 2.8 KB for the wide ones).
  static constexpr int kStaticBytes = kNarrow ? 1024 : 3 * 1024;
  static_assert(kCtasPerSm * (kBytes + 1024 + kStaticBytes) <= 228 * 1024);
};

// Whether the CTA's mainloop accumulates in place and applies the scales
// once after it: always for per-tensor scaling, whose scales are the same
// for every k-block, so the tensor cores never wait for a k-block's fold.
template <class Config>
__device__ __forceinline__ bool scales_once(const MoeParams& p) {
  if constexpr (Config::kScaling == GemmScaling::kEither) {
    return !p.block_wise;
  }
  return Config::kScaling == GemmScaling::kPerTensor;
}

// The k-blocks a CTA runs: k-blocks [kb_begin, kb_end) of each weight row
// block in [block_begin, block_end), block by block. Gate-up: a group of
// 128-column blocks, or one and its K range when K is split; down: a group
// of 256-row blocks.
struct WorkRange {
  int block_begin, block_end;
  int kb_begin, kb_end;

  __device__ int k_blocks() const { return kb_end - kb_begin; }
  __device__ int size() const { return (block_end - block_begin) * k_blocks(); }
  __device__ int block(int i) const { return block_begin + i / k_blocks(); }
  __device__ int kb(int i) const { return kb_begin + i % k_blocks(); }
};

// First weight row (gate-up: column of the intermediate) of a block.
template <bool kGateUp, class Config>
__device__ __forceinline__ int block_row(int block) {
  return block * (kGateUp ? Config::kWgRows : 2 * Config::kWgRows);
}

// A cp.async of kBytes (16: token-row chunks, L2 only; 4: scales, which
// .cg does not take), zero-filled where !valid.
template <int kBytes>
__device__ __forceinline__ void cp_async_zfill(void* smem, const void* gmem,
                                               bool valid) {
  static_assert(kBytes == 16 || kBytes == 4);
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                     smem_address(smem)),
                 "l"(gmem), "r"(valid ? 16 : 0)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(
                     smem_address(smem)),
                 "l"(gmem), "r"(valid ? 4 : 0)
                 : "memory");
  }
}

// Whether the producer's copy threads (GemmConfig::kCopyThreads) arrive on
// each stage's full barrier once their cp.async copies land (token rows
// gathered, or the token scales of kOverlappedFold), beside the weights'
// (and the TMA token rows') expect_tx.
template <class Config>
__device__ __forceinline__ bool threads_copy_stages(bool tma_token_rows) {
  return !tma_token_rows || Config::kOverlappedFold;
}

// An arrival on `bar` once every cp.async this thread issued so far has
// landed, counted among the barrier's expected arrivals (.noinc).
__device__ __forceinline__ void cp_async_arrive_on_landing(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(
                   smem_address(bar))
               : "memory");
}

// Whether consumer warpgroup `wg` has weight rows in the block from row n0.
// The down GEMM's last row block may end past H (H % 256 == 128): its
// second warpgroup then gets no rows (no weights, no scales), computes on
// stale shared memory and stores nothing. (A gate-up block always starts
// below I.)
template <bool kGateUp, class Config>
__device__ __forceinline__ bool warpgroup_has_rows(const MoeParams& p, int n0,
                                                   int wg) {
  return kGateUp || n0 + wg * Config::kWgRows < p.hidden;
}

// Weight boxes of k-block `kb` into `stage`, by one thread: the first
// stages go out as soon as the tile is known, before the token rows are.
template <bool kGateUp, class Config>
__device__ void load_weights(const MoeParams& p, const CUtensorMap* weights,
                             const TileInfo& tile, int n0, int kb, int stage,
                             uint64_t* full, uint8_t* smem) {
  const int boxes = warpgroup_has_rows<kGateUp, Config>(p, n0, 1) ? 2 : 1;
  FullBarrier::arrive_and_expect_tx(&full[stage],
                                    boxes * Config::kWgStageBytes);
  for (int wg = 0; wg < boxes; ++wg) {
    // Gate-up: (k, column, gate|up, expert); down: (k, row, 0, expert).
    const int row = kGateUp ? n0 : n0 + wg * Config::kWgRows;
    cute::SM90_TMA_LOAD_4D::copy(
        weights, &full[stage],
        static_cast<uint64_t>(p.tiling.evict_first_weights
                                  ? cute::TMA::CacheHintSm90::EVICT_FIRST
                                  : cute::TMA::CacheHintSm90::EVICT_NORMAL),
        smem + (wg * Config::kStages + stage) * Config::kWgStageBytes,
        kb * kTileK, row, kGateUp ? wg : 0, tile.expert);
  }
}

// The token rows of k-block `kb` into `stage` by TMA, by one thread: the
// down GEMM on routed tiles, whose rows are consecutive rows of the
// intermediate. Rows past the tile's (the next expert's, stale ones, or
// zeros) meet a zero scale and are not stored. Its own arrival on the full
// barrier: the weights' may come before the PDL wait, these only after.
template <class Config>
__device__ void load_token_rows(const CUtensorMap* token_rows,
                                const TileInfo& tile, int kb, int stage,
                                uint64_t* full, uint8_t* smem) {
  FullBarrier::arrive_and_expect_tx(&full[stage], Config::kTokenStageBytes);
  cute::SM90_TMA_LOAD_4D::copy(
      token_rows, &full[stage],
      static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
      smem + Config::kWeightBytes + stage * Config::kTokenStageBytes,
      kb * kTileK, tile.row0, 0, 0);
}

// Producer threads (GemmConfig::kCopyThreads): weight rows by TMA from one
// thread (the first kStages k-blocks' already issued by the kernel), token
// rows by cp.async from all (with `token_rows`, by TMA from one:
// load_token_rows()), and with kOverlappedFold the tile's activation
// scales of the k-block (0 past its rows), for every k-block of `range`.
template <bool kGateUp, class Config>
__device__ void load_stages(const MoeParams& p, const CUtensorMap* weights,
                            const CUtensorMap* token_rows, const TileInfo& tile,
                            const int64_t* src, const WorkRange& range,
                            uint8_t* smem, uint64_t* full, uint64_t* empty) {
  constexpr int kCopyThreads = Config::kCopyThreads;
  static_assert(kConsumerThreads % kCopyThreads == 0);
  const int copier = threadIdx.x % kCopyThreads;
  const bool tma_issuer = copier == 0;  // the kernel's tma_thread
  const int K = kGateUp ? p.hidden : p.inter;
  const TokenSource<kGateUp> source = TokenSource<kGateUp>::make(p);
  auto tokens = cute::make_tensor(
      cute::make_smem_ptr(
          reinterpret_cast<typename Config::Fp8*>(smem + Config::kWeightBytes)),
      typename Config::TokenLayout{});

  // This thread's 16-byte chunks of the token tile: row, k chunk, source
  // (kept for every stage).
  auto chunk = [&](int i) { return i * kCopyThreads + copier; };
  auto chunk_row = [&](int i) { return chunk(i) / (kTileK / 16); };
  auto chunk_k = [&](int i) { return chunk(i) % (kTileK / 16) * 16; };
  auto chunk_source = [&](int i) -> const uint8_t* {
    const int row = chunk_row(i);
    return row < tile.rows ? source.base + src[row] * source.stride + chunk_k(i)
                           : nullptr;
  };
  const uint8_t* chunk_src[Config::kChunksPerThread];
#pragma unroll
  for (int i = 0; i < Config::kChunksPerThread; ++i) {
    chunk_src[i] = chunk_source(i);
  }

  // Each thread's token copies of a stage arrive on the stage's full
  // barrier once they land (one of kCopyThreads arrivals), so the producer
  // never waits for its own copies: it only waits for a stage's release
  // before refilling it, and every stage not being read has its copies in
  // flight.
  const int n = range.size();
  int stage = 0;
  uint32_t phase = 0;
  for (int i = 0; i < n; ++i) {
    const int kb = range.kb(i);
    if (i >= Config::kStages) {
      EmptyBarrier::wait(&empty[stage], phase ^ 1);
      if (tma_issuer) {
        load_weights<kGateUp, Config>(
            p, weights, tile, block_row<kGateUp, Config>(range.block(i)), kb,
            stage, full, smem);
      }
    }
    if (token_rows) {
      if (tma_issuer) {
        load_token_rows<Config>(token_rows, tile, kb, stage, full, smem);
      }
    } else {
      auto copy_chunk = [&](int c, const uint8_t* from) {
        const bool valid = from != nullptr && kb * kTileK + chunk_k(c) < K;
        cp_async_zfill<16>(&tokens(chunk_row(c), chunk_k(c), stage),
                           valid ? from + kb * kTileK : source.base, valid);
      };
#pragma unroll
      for (int c = 0; c < Config::kChunksPerThread; ++c) {
        copy_chunk(c, chunk_src[c]);
      }
    }
    if constexpr (Config::kOverlappedFold) {
      float* scales = reinterpret_cast<float*>(
          smem + Config::kTokenScalesOffset + stage * Config::kTokens * 4);
      for (int t = copier; t < Config::kTokens; t += kCopyThreads) {
        const bool valid = t < tile.rows;
        cp_async_zfill<4>(&scales[t],
                          source.scale.address(valid ? src[t] : 0, kb), valid);
      }
    }
    if (threads_copy_stages<Config>(token_rows != nullptr)) {
      cp_async_arrive_on_landing(&full[stage]);
    }
    if (++stage == Config::kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// Per-tensor scaling: each token's activation scale times the expert's
// weight scale (0 past the tile's rows), into `tile_scale` [kTokens], by
// the consumer threads before their mainloop: the loads then wait behind
// the CTA's first weight copies, not behind the last ones.
template <bool kGateUp, int kTokens>
__device__ void load_tile_scales(const MoeParams& p, const TileInfo& tile,
                                 const int64_t* src, float* tile_scale) {
  const TokenSource<kGateUp> source = TokenSource<kGateUp>::make(p);
  const float w_scale = (kGateUp ? p.w13_scale : p.w2_scale).at(tile.expert, 0);
  for (int t = threadIdx.x; t < kTokens; t += kConsumerThreads) {
    tile_scale[t] = t < tile.rows ? w_scale * source.scale.at(src[t], 0) : 0.f;
  }
  named_barrier_sync(kConsumerBarrier, kConsumerThreads);
}

// Consumer warpgroup `wg`: acc = sum over k-blocks [kb_begin, kb_end) of
// (W[rows of wg] . X[tokens]^T) * weight scale * activation scale, for the
// weight rows from n0. `stage` and `phase` carry the ring's position from
// one call to the next. `tile_scale`: load_tile_scales()'s, when
// scales_once().
template <bool kGateUp, class Config, class Acc, class Coord>
__device__ void mma_stages(const MoeParams& p, const TileInfo& tile, int n0,
                           const int64_t* src, const float* tile_scale,
                           int kb_begin, int kb_end, uint8_t* smem,
                           uint64_t* full, uint64_t* empty, Acc& acc,
                           const Coord& coord, int& stage, uint32_t& phase) {
  using namespace cute;
  constexpr int kTokens = Config::kTokens;
  using Fp8 = typename Config::Fp8;
  const int wg = threadIdx.x / 128;
  const int lane = threadIdx.x % 32;

  Tensor weights =
      make_tensor(make_smem_ptr(reinterpret_cast<Fp8*>(
                      smem + wg * Config::kStages * Config::kWgStageBytes)),
                  typename Config::WeightLayout{});
  Tensor tokens = make_tensor(
      make_smem_ptr(reinterpret_cast<Fp8*>(smem + Config::kWeightBytes)),
      typename Config::TokenLayout{});
  typename Config::TiledMma mma;
  auto thr = mma.get_thread_slice(threadIdx.x % 128);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(weights));  // (V,M,K,S)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(tokens));   // (V,N,K,S)
  static_assert(decltype(size<0>(acc))::value == kTokens / 2 &&
                decltype(size<1>(acc))::value == Config::kWgRows / 64 &&
                decltype(size<2>(acc))::value == 1);
  auto advance = [&] {
    if (++stage == Config::kStages) {
      stage = 0;
      phase ^= 1;
    }
  };
  // The stage's copies have landed. Token rows copied by cp.async were
  // written through the generic proxy; the wgmma read them through the
  // async proxy.
  auto acquire = [&] {
    FullBarrier::wait(&full[stage], phase);
    cutlass::arch::fence_view_async_shared();
  };
  auto release = [&](int s) {
    __syncwarp();
    if (lane == 0) EmptyBarrier::arrive(&empty[s]);
  };

  // Block-wise: weight rows of this warpgroup, for its 128 x 128 scale
  // block (0 for a warpgroup without rows, whose scale block would be past
  // the tensor), and the token of accumulator value (c, j): values are
  // ((column pair, row half, 8-column group), 64-row block, 1), and the
  // token depends on the first and third only.
  const ScaleView& w_scale = kGateUp ? p.w13_scale : p.w2_scale;
  const int64_t w_row =
      kGateUp ? int64_t(wg) * p.inter + n0 : int64_t(n0) + wg * Config::kWgRows;
  const bool has_rows = warpgroup_has_rows<kGateUp, Config>(p, n0, wg);
  auto weight_scale = [&](int kb) {
    return has_rows ? w_scale.at(tile.expert, w_row / kScaleBlock, kb) : 0.f;
  };
  auto token_of = [&](int c, int j) {
    return get<1>(coord(make_coord(make_coord(c, 0, j), 0, 0)));
  };
  // acc += blk * each value's weight scale `sw` times its token's scale.
  auto fold = [&](const auto& blk, float sw, auto&& token_scale) {
#pragma unroll
    for (int j = 0; j < kTokens / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float sc = sw * token_scale(c, j);
#pragma unroll
        for (int m = 0; m < Config::kWgRows / 64; ++m) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const auto v = make_coord(make_coord(c, h, j), m, 0);
            acc(v) += blk(v) * sc;
          }
        }
      }
    }
  };

  // Block-wise: the current stage's k-block into the block accumulator
  // `blk`, once the stage's copies have landed (committed, not waited for).
  auto issue = [&](auto& blk) {
    acquire();
    warpgroup_fence_operand(blk);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
    for (int k = 0; k < size<2>(tCrA); ++k) {
      gemm(mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), blk);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };

  if constexpr (Config::kOverlappedFold) {
    // Block-wise, the fold behind the wgmma: k-block i's product goes into
    // one block accumulator while k-block i - 1's, in the other, is folded
    // in with the token scales of its stage, then that stage is released.
    Tensor blk0 = make_fragment_like(acc);
    Tensor blk1 = make_fragment_like(acc);
    clear(acc);
    auto fold_stage = [&](auto& blk, float sw, int s) {
      warpgroup_fence_operand(blk);
      const float* scales = reinterpret_cast<const float*>(
          smem + Config::kTokenScalesOffset + s * kTokens * 4);
      fold(blk, sw, [&](int c, int j) { return scales[token_of(c, j)]; });
      release(s);
    };
    // One k-block: its product issued into `into`, then the previous
    // k-block's, in `done`, folded once its wgmma are complete (the weight
    // scale read a k-block ahead of its fold). Unrolled by two, so that each
    // accumulator's role is fixed where ptxas pipelines the wgmma.
    float sw = weight_scale(kb_begin);
    issue(blk0);
    int folded_stage = stage;
    advance();
    auto step = [&](auto& into, auto& done, int kb) {
      const float next_sw = weight_scale(kb);
      issue(into);
      warpgroup_wait<1>();
      fold_stage(done, sw, folded_stage);
      sw = next_sw;
      folded_stage = stage;
      advance();
    };
    int kb = kb_begin + 1;
    for (; kb + 1 < kb_end; kb += 2) {
      step(blk1, blk0, kb);
      step(blk0, blk1, kb + 1);
    }
    if (kb < kb_end) {
      step(blk1, blk0, kb);
      warpgroup_wait<0>();
      fold_stage(blk1, sw, folded_stage);
    } else {
      warpgroup_wait<0>();
      fold_stage(blk0, sw, folded_stage);
    }
  } else if (!scales_once<Config>(p)) {
    // Block-wise: each k-block's product goes into `blk`, then is folded
    // into the result with that k-block's weight and activation scales.
    const TokenSource<kGateUp> source = TokenSource<kGateUp>::make(p);
    Tensor blk = make_fragment_like(acc);
    clear(acc);
    for (int kb = kb_begin; kb < kb_end; ++kb) {
      // Loaded before the stage wait so that their latency hides behind
      // it: after the wgmma they would stall every k-block by an L2 round
      // trip.
      const float sw = weight_scale(kb);
      float scale[kTokens / 8][2];
#pragma unroll
      for (int j = 0; j < kTokens / 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int tok = token_of(c, j);
          scale[j][c] = tok < tile.rows ? source.scale.at(src[tok], kb) : 0.f;
        }
      }

      issue(blk);
      warpgroup_wait<0>();
      warpgroup_fence_operand(blk);
      release(stage);
      fold(blk, sw, [&](int c, int j) { return scale[j][c]; });
      advance();
    }
  } else {
    // The scales are the same for every k-block: the wgmma accumulate in
    // place (one k-block's staying in flight while the next k-block's are
    // issued, kWgmmaInFlight), and the scales apply once at the end.
    clear(acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
    int in_flight = -1;  // the stage whose wgmma may still be running
    for (int kb = kb_begin; kb < kb_end; ++kb) {
      acquire();
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < size<2>(tCrA); ++k) {
        gemm(mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), acc);
      }
      warpgroup_commit_batch();
      warpgroup_wait<Config::kWgmmaInFlight ? 1 : 0>();
      warpgroup_fence_operand(acc);
      if constexpr (Config::kWgmmaInFlight) {
        if (in_flight >= 0) release(in_flight);
        in_flight = stage;
      } else {
        release(stage);
      }
      advance();
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    if (in_flight >= 0) release(in_flight);
#pragma unroll
    for (int i = 0; i < size(acc); ++i) acc(i) *= tile_scale[get<1>(coord(i))];
  }
}

}  // namespace moe
}  // namespace hpc
