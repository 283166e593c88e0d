// The one tiling decision of the fused FP8 MoE pipeline.
//
// Both grouped GEMMs run "swapped": expert weight rows are the wgmma M side
// (128 per consumer warpgroup) and the expert's tokens are the N side, so a
// tile of a few tokens wastes no tensor-core work on padding rows. The token
// tile width (wgmma N) is picked per call from the expected tokens per
// expert; every expert's rows are cut into tiles of that width (by the route
// kernel, or, for a few slots, by each GEMM CTA: slot tiles), and both GEMMs
// and their epilogues are instantiated for it. When the tiles leave most SMs
// idle (a handful of tokens), the gate-up GEMM also splits K, each tile's
// split CTAs one cluster.
// The down GEMM's K is only I: a CTA per 256-row block would spend about as
// long setting up as streaming its weights. So a down CTA may take a group
// of its tile's row blocks, its pipeline running on from one to the next;
// the group grows while the CTAs still fill every CTA slot (each CTA has
// only its own stages in flight, so fewer CTAs leave bandwidth unused).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernel_limits.h"

#ifdef __CUDACC__
  #define HPC_MOE_HD __host__ __device__ __forceinline__
#else
  #define HPC_MOE_HD inline
#endif

namespace hpc {
namespace moe {

// Block-wise scales: one per 128 x 128 weights and per 1 x 128 activations.
constexpr int kScaleBlock = limits::kMoeBlockShape[0];
static_assert(limits::kMoeBlockShape[0] == limits::kMoeBlockShape[1],
              "the kernels read square scale blocks");
constexpr int kTileK = 128;   // K bytes per pipeline stage = 1 scale block
constexpr int kWgRows = 128;  // weight rows per consumer warpgroup
constexpr int kCtaRows = 2 * kWgRows;  // weight rows per CTA
// Gate-up warpgroups of 192 rows (three 64-row wgmma blocks) for 96-token
// tiles, per-tensor, where the intermediate is a multiple of 192 (Hy3's
// 192 at tp8, 1536 at tp1): a tile's token rows are read by I / 192 column
// blocks instead of I / 128, and tp8's intermediate is one block, not one
// and a half-empty one. Their accumulators fill a consumer thread's
// registers; the CTA takes one column block, and its epilogue stages in the
// stage buffers.
constexpr int kWideWgRows = 192;
constexpr int kMinWideWaves = 2;
constexpr int kMaxTopk = limits::kMoeMaxTopk;
constexpr int kMinTokenTile = 8;
constexpr int kMaxTokenTile = 128;
// The one token tile between 64 and kMaxTokenTile: an expert with 129-192
// rows (tp8 or tp1 at 4096 tokens: 171 on average) fills two 96-token tiles
// to 89% where two 128-token ones are 67% full.
constexpr int kThreeQuarterTokenTile = 96;
// What moe_tiling() adds to a token tile's columns when it compares tile
// widths: the weight bytes the tile streams per k-block (32 KB, those of 256
// token rows), counted half, since an expert's tiles read them from DRAM
// once between them. So a narrower tile is chosen only where it saves
// padding columns.
constexpr int kTileWeightColumns = 128;
// Block-wise scaling folds each k-block's partial product into the result
// with its scales, in two block accumulators (the next k-block's product
// runs into one while the other is folded): the widest tile whose three
// accumulators fit in a consumer thread's registers.
constexpr int kMaxBlockWiseTokenTile = 64;
// Tiles of at most this many tokens that both scalings run at the same CTAs
// per SM share one instantiation, both mainloops behind a run-time branch;
// wider ones have one per scaling (gemm_scaling()).
constexpr int kSharedScalingMaxTokenTile = 16;
// K ranges of a split gate-up tile, at most: its CTAs are one cluster (8 at
// most, portably), and the leader's stage buffers take the others' partial
// sums (splitting is only chosen for 8-token tiles).
constexpr int kMaxSplit = 8;
// GEMM CTAs per SM with tiles of at most kNarrowTile tokens (few
// accumulators: two fit); wider tiles run one CTA per SM but for the
// per-tensor pairs below (kPairedTile, kPairedGateUpTile).
constexpr int kNarrowTile = 16;
constexpr int kNarrowTileCtasPerSm = 2;
// A GEMM of 8-token tiles may run three CTAs per SM, with 2 stages each
// instead of 3: the same weight bytes in flight per SM in 1.5x the slots.
// It pays where the CTAs then make fewer waves; with as many waves, the
// last wave's CTAs stream alone at 2 stages, slower than at 3, and with
// fewer CTAs than slots (a few tokens, K split) it only cuts the bytes in
// flight of the SMs holding one or two (moe_tiling()).
constexpr int kDenseMinTileCtasPerSm = 3;
// The GEMMs load an expert's weights evict-first with 8-token tiles: then
// about one tile reads each expert, so its weights are streamed once, and
// L2 is left to what is read again (token rows, the intermediate). Wider
// tiles keep the usual policy: measured, evict-first was slower with
// 16-token tiles and mixed with wider ones.
constexpr int kEvictFirstMaxTokenTile = kMinTokenTile;

// Per-tensor GEMMs of 32-token tiles run two CTAs per SM with 2 stages each
// instead of one with 4: the same weight bytes in flight per SM, and one
// CTA's pipeline fill and epilogue run while the other streams. Their
// accumulators fit in the registers two CTAs leave a thread (112) only
// without the block-wise fold's second one: block-wise calls keep one CTA.
constexpr int kPairedTile = 32;
constexpr int kPairedTileCtasPerSm = 2;

// Per-tensor gate-up GEMMs of 64-token tiles pair up as well, but two CTAs'
// stages and separate epilogue staging exceed an SM's shared memory: each
// CTA takes one column block, and its epilogue stages in its stage buffers,
// free once that block is done (as wide warpgroups' do). The down GEMM keeps
// one CTA per SM there: with a small intermediate (tp8: 2 k-blocks a row
// block) its CTAs need several row blocks each to stream.
constexpr int kPairedGateUpTile = 64;

// GEMM CTAs that share an SM for a token tile width, per GEMM and scaling:
// two for narrow tiles and the per-tensor pairs, else one. (The tiling may
// also put three 8-token CTAs on an SM: gemm_dense_min_tile().)
constexpr int gemm_ctas_per_sm(bool gate_up, int token_tile, bool block_wise) {
  const bool paired =
      token_tile == kPairedTile || (gate_up && token_tile == kPairedGateUpTile);
  if (paired && !block_wise) return kPairedTileCtasPerSm;
  return token_tile <= kNarrowTile ? kNarrowTileCtasPerSm : 1;
}

constexpr bool gemm_dense_min_tile(int token_tile, int ctas_per_sm) {
  return token_tile == kMinTokenTile && ctas_per_sm == kDenseMinTileCtasPerSm;
}

// Whether a GEMM CTA of `token_tile` at `ctas_per_sm` takes one weight block
// and stages its epilogue in its stage buffers (a gate-up GEMM's only).
constexpr bool gemm_one_block_per_cta(int token_tile, int ctas_per_sm) {
  return token_tile == kPairedGateUpTile && ctas_per_sm == kPairedTileCtasPerSm;
}

// The GEMM instantiations: every count gemm_ctas_per_sm() gives a tile (the
// gate-up GEMM's per-tensor ones include the down GEMM's), and three for
// 8-token tiles.
constexpr bool gemm_ctas_per_sm_supported(int token_tile, int ctas_per_sm) {
  return ctas_per_sm == gemm_ctas_per_sm(true, token_tile, true) ||
         ctas_per_sm == gemm_ctas_per_sm(true, token_tile, false) ||
         gemm_dense_min_tile(token_tile, ctas_per_sm);
}

// The scalings an instantiation's mainloop is compiled for.
enum class GemmScaling { kPerTensor, kBlockWise, kEither };

// The instantiation the gate-up (`gate_up`) or down GEMM runs for a call of
// `block_wise` scaling with `token_tile` at `ctas_per_sm`: the scaling it is
// compiled for. One that calls of a single scaling run (paired per-tensor
// CTAs; block-wise 32-token CTAs, whose paired count per-tensor calls take)
// holds that mainloop alone (with both behind a run-time branch, the
// block-wise fold ran slower); so does every tile wider than
// kSharedScalingMaxTokenTile (the block-wise one's fold overlaps the next
// k-block's wgmma, moe_gemm.cuh).
constexpr GemmScaling gemm_scaling(bool gate_up, int token_tile,
                                   int ctas_per_sm, bool block_wise) {
  const bool dense = gemm_dense_min_tile(token_tile, ctas_per_sm);
  const bool per_tensor =
      dense || ctas_per_sm == gemm_ctas_per_sm(gate_up, token_tile, false);
  const bool scaled_blocks =
      token_tile <= kMaxBlockWiseTokenTile &&
      (dense || ctas_per_sm == gemm_ctas_per_sm(gate_up, token_tile, true));
  if (per_tensor && scaled_blocks) {
    if (token_tile <= kSharedScalingMaxTokenTile) return GemmScaling::kEither;
    return block_wise ? GemmScaling::kBlockWise : GemmScaling::kPerTensor;
  }
  return per_tensor ? GemmScaling::kPerTensor : GemmScaling::kBlockWise;
}

// The decode path (moe_decode_gate_up.cuh, moe_decode_down.cuh): two
// kernels, the first quantizing its own token columns, that copy each CTA's
// weights whole into shared memory and run warp-level MMAs, with no routing
// tables, no split-K merge, and the top-k sum done by the down CTAs. It takes
// up to this many tokens (an expert then sees at most two 8-column MMA tiles),
// and only while its gate-up CTAs fit in one wave (moe_tiling()).
constexpr int kDecodeMaxTokens = 16;
constexpr int kDecodeColumns = 8;  // intermediate columns per gate-up CTA
// Shared memory per SM (227 KB) and what a decode gate-up CTA takes beyond
// its dynamic part (static arrays, the runtime's reserve), at most.
constexpr int kSmemPerSm = 227 * 1024;
constexpr int kDecodeStaticSmem = 12 * 1024;
// Decode gate-up CTAs per SM at most, so that the down CTAs fit beside
// them (104 registers x 256 threads each; moe_decode_down.cuh).
constexpr int kDecodeMaxCtasPerSm = 2;

// Bytes between rows of a decode-path MMA tile in shared memory: 64 past a
// multiple of 128, so the two rows of a quarter-warp's 16-byte fragment
// loads (g and g + 1) fall on different banks.
HPC_MOE_HD int fragment_row_stride(int bytes) {
  return (bytes + 127) / 128 * 128 + 64;
}

// Dynamic shared memory of a decode gate-up CTA: A (gate rows 0-7, up rows
// 8-15 of its columns), B (`b_rows` token columns) and B's scales
// ([column][group]).
struct GateUpSmemLayout {
  int hidden;
  int b_rows;  // 8 or 16
  HPC_MOE_HD int stride() const { return fragment_row_stride(hidden); }
  HPC_MOE_HD int b_offset() const { return 16 * stride(); }
  HPC_MOE_HD int scales_offset() const {
    return b_offset() + b_rows * stride();
  }
  HPC_MOE_HD int bytes() const {
    return scales_offset() + b_rows * (hidden / kScaleBlock) * 4;
  }
};

// The layout for a call: B holds every column an expert can get (a token
// routes to an expert once, so at most num_tokens), unless the ids repeat.
HPC_MOE_HD GateUpSmemLayout gate_up_smem_layout(int num_tokens, int hidden) {
  return {hidden, num_tokens <= 8 ? 8 : 16};
}

// Slot tiles (no route stage): for a batch of at most this many routed
// slots (token * topk + j), each GEMM CTA finds its tile from the router's
// ids itself (moe_tiles.cuh), and a routed row is identified by its
// slot. The route kernel's launch and its run before the gate-up GEMM may
// know any tile cost more than a few tokens' tiles take to find.
constexpr int kSlotTilesMaxSlots = 128;

// Standard deviations of margin on the experts a rank expects a batch to
// hit, when choosing the gate-up split (moe_tiling()).
constexpr double kSplitMarginSigmas = 1.5;

// k-blocks a down-GEMM CTA streams at least, where the tiles allow.
constexpr int kMinCtaKBlocks = 8;
// With many waves of down-GEMM CTAs, row blocks are grouped further, up to
// this many k-blocks a CTA: its pipeline fills once per group, and each
// block's epilogue overlaps the next block's loads. Below kMinGroupedWaves
// the lost spread over the SMs costs more (tp8 at 64-1024 tokens).
constexpr int kMaxGroupedKBlocks = 24;
constexpr int kMinGroupedWaves = 8;
// Gate-up column blocks per CTA at most, grouped (kMinGroupedWaves and up)
// so that one block's epilogue runs under the next block's first loads.
constexpr int kMaxGateUpGroup = 2;

struct MoeTiling {
  int token_tile;           // tokens per GEMM tile: 8, 16, 32, 64, 96, 128
  int max_tiles;            // tiles over all local experts, at most (grid size)
  int gate_up_rows;         // weight rows per gate-up warpgroup: 128 or 192
  int gate_up_blocks;       // gate_up_rows-column blocks of the intermediate
  int gate_up_split;        // K ranges of the gate-up GEMM, each its own CTA
  int gate_up_group;        // column blocks per gate-up CTA (1 when K is split)
  int gate_up_ctas_per_sm;  // gate-up CTAs sharing an SM
  int down_blocks;          // 256-row blocks of the hidden dimension
  int down_group;           // row blocks per down-GEMM CTA
  int down_ctas_per_sm;     // down-GEMM CTAs sharing an SM
  bool decode;              // the decode path instead of route + grouped GEMMs
  bool slot_tiles;          // grouped GEMMs without a route stage (slot rows)
  bool evict_first_weights;  // GEMM weight loads with the evict-first policy
};

HPC_MOE_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Standard deviations of an expert's row count below its mean under which
// expected_tiles_per_expert() takes P(X > x) as 1 (1 - 1e-30 at most).
constexpr double kPoissonLowerTailSigmas = 12.0;

// Expected tiles of `tile` rows for an expert whose row count is Poisson
// with mean `lambda` (a uniform router's spread of rows over experts):
// E[ceil(X / tile)] = sum over j >= 0 of P(X > j * tile). An expert with
// a few rows more than average takes a second tile. The sum runs from
// kPoissonLowerTailSigmas below the mean, whose P(X = x) is taken through
// its logarithm: e^-lambda alone underflows to zero from lambda ~745
// (18K tokens of top-8 over 192 experts), and the sum would never end.
inline double expected_tiles_per_expert(double lambda, int tile) {
  const int x0 = static_cast<int>(
      std::max(0.0, lambda - kPoissonLowerTailSigmas * std::sqrt(lambda)));
  double tiles = static_cast<double>((x0 + tile - 1) / tile);  // below x0
  // P(X = x)
  double pmf =
      x0 == 0
          ? std::exp(-lambda)
          : std::exp(x0 * std::log(lambda) - lambda - std::lgamma(x0 + 1.0));
  double cdf = 0.0;  // P(x0 <= X <= x)
  for (int x = x0; x <= lambda || 1.0 - cdf > 1e-9; ++x) {
    cdf += pmf;
    if (x % tile == 0) tiles += 1.0 - cdf;
    pmf *= lambda / (x + 1);
  }
  return tiles;
}

// Gate-up CTAs per token tile: the grid's x (a split tile's CTAs are
// consecutive).
HPC_MOE_HD int gate_up_ctas_per_tile(const MoeTiling& t) {
  return static_cast<int>(ceil_div(t.gate_up_blocks, t.gate_up_group)) *
         t.gate_up_split;
}

// Down-GEMM CTAs per token tile: the grid's x.
HPC_MOE_HD int down_ctas_per_tile(const MoeTiling& t) {
  return static_cast<int>(ceil_div(t.down_blocks, t.down_group));
}

// num_experts: experts of the whole model (the router's range); the rank
// holds num_local_experts of them.
inline MoeTiling moe_tiling(int num_tokens, int topk, int num_local_experts,
                            int num_experts, int hidden, int inter, int num_sms,
                            bool block_wise) {
  MoeTiling t{};
  const int64_t rows = int64_t(num_tokens) * topk;  // routed rows, at most
  const int64_t all_experts = std::max(num_experts, num_local_experts);
  // Rows per expert when the router spreads tokens evenly.
  const int64_t per_expert = ceil_div(rows, all_experts);
  const int widest = block_wise ? kMaxBlockWiseTokenTile : kMaxTokenTile;
  t.token_tile = kMinTokenTile;
  while (t.token_tile < per_expert && t.token_tile < widest) {
    t.token_tile *= 2;
  }
  // Between 64 and 128, whichever tile makes the fewer columns an expert
  // is expected to take (an expert's rows are Poisson; kTileWeightColumns).
  if (t.token_tile == kMaxTokenTile) {
    const double lambda = double(rows) / all_experts;
    auto cost = [&](int tile) {
      return expected_tiles_per_expert(lambda, tile) *
             (tile + kTileWeightColumns);
    };
    if (cost(kThreeQuarterTokenTile) < cost(kMaxTokenTile)) {
      t.token_tile = kThreeQuarterTokenTile;
    }
  }
  // An expert with c rows takes ceil(c / tile) tiles, so all tiles number
  // at most rows / tile + (experts with any row).
  const int64_t experts_hit = std::min<int64_t>(num_local_experts, rows);
  t.max_tiles = static_cast<int>(ceil_div(rows, t.token_tile) + experts_hit);
  t.down_blocks = static_cast<int>(ceil_div(hidden, kCtaRows));

  // Tiles expected with an even spread of this rank's rows.
  const int64_t tiles_per_expert = ceil_div(per_expert, t.token_tile);
  const int64_t tiles =
      std::min<int64_t>(num_local_experts,
                        ceil_div(rows * num_local_experts, all_experts)) *
      tiles_per_expert;
  // Wide gate-up warpgroups (kWideWgRows) where their CTAs, one column
  // block each, make two waves or more: fewer would leave SMs idle in the
  // last one (tp8 at 2048 tokens: 192 CTAs on 132 SMs).
  const bool wide_fits = t.token_tile == kThreeQuarterTokenTile &&
                         !block_wise && inter % kWideWgRows == 0;
  t.gate_up_rows =
      wide_fits && tiles * (inter / kWideWgRows) >= kMinWideWaves * num_sms
          ? kWideWgRows
          : kWgRows;
  t.gate_up_blocks = static_cast<int>(ceil_div(inter, t.gate_up_rows));

  // Split the gate-up GEMM's K when its CTAs would leave CTA slots idle (a
  // few tokens), keeping two k-blocks per split. With experts spread over
  // ranks, how many of this rank's experts a batch hits varies from call to
  // call: the split is sized for kSplitMarginSigmas standard deviations
  // above the expected count (each of a uniform router's rows misses a given
  // expert with probability 1 - 1 / all_experts), since a split tile more
  // than the CTA slots hold takes a second wave.
  const double hit = 1.0 - std::pow(1.0 - 1.0 / all_experts, double(rows));
  const double spread =
      num_local_experts < all_experts
          ? kSplitMarginSigmas * std::sqrt(num_local_experts * hit * (1 - hit))
          : 0.0;
  const int64_t experts_expected = std::min<int64_t>(
      num_local_experts,
      static_cast<int64_t>(std::ceil(num_local_experts * hit + spread)));
  const int64_t ctas = experts_expected * tiles_per_expert * t.gate_up_blocks;
  const int k_blocks = static_cast<int>(ceil_div(hidden, kTileK));
  int split = 1;
  const int64_t slots =
      int64_t(num_sms) * gemm_ctas_per_sm(true, t.token_tile, block_wise);
  if (t.token_tile == kMinTokenTile && ctas < slots) {
    split = static_cast<int>(std::min<int64_t>(
        {slots / std::max<int64_t>(ctas, 1), kMaxSplit, k_blocks / 2}));
    split = std::max(split, 1);
  }
  t.gate_up_split = split;
  // CTAs sharing an SM, per GEMM (kDenseMinTileCtasPerSm). Gate-up (K =
  // H: long CTAs, whose last wave sets the GEMM's end): 8-token tiles go
  // three to an SM when that makes fewer waves of the CTAs expected, an
  // expert with a few rows above the average taking a second tile. Down
  // (K = I: short CTAs, in many waves): three to an SM where its CTAs
  // before grouping outnumber the two-per-SM slots (its groups are then
  // sized for the slots chosen).
  const bool min_tile = t.token_tile == kMinTokenTile;
  t.gate_up_ctas_per_sm = gemm_ctas_per_sm(true, t.token_tile, block_wise);
  if (min_tile && split == 1) {
    const double hit_tiles =
        expected_tiles_per_expert(double(rows) / all_experts, t.token_tile) /
        std::max(hit, 1e-9);  // tiles of an expert that is hit
    const int64_t gate_up_ctas =
        static_cast<int64_t>(std::ceil(experts_expected * hit_tiles)) *
        t.gate_up_blocks;
    if (ceil_div(gate_up_ctas, int64_t(num_sms) * kDenseMinTileCtasPerSm) <
        ceil_div(gate_up_ctas, slots)) {
      t.gate_up_ctas_per_sm = kDenseMinTileCtasPerSm;
    }
  }
  const int64_t gate_up_slots = int64_t(num_sms) * t.gate_up_ctas_per_sm;
  // Column blocks per gate-up CTA: with many waves of unsplit CTAs, a CTA
  // takes kMaxGateUpGroup blocks in turn, its ring running on across them.
  t.gate_up_group = 1;
  while (split == 1 && t.gate_up_rows == kWgRows &&
         !gemm_one_block_per_cta(t.token_tile, t.gate_up_ctas_per_sm) &&
         t.gate_up_group < kMaxGateUpGroup &&
         t.gate_up_group < t.gate_up_blocks &&
         tiles * ceil_div(t.gate_up_blocks, 2 * t.gate_up_group) >=
             kMinGroupedWaves * gate_up_slots) {
    t.gate_up_group *= 2;
  }

  // Down row blocks per CTA: doubled while a CTA would stream fewer than
  // kMinCtaKBlocks k-blocks and the CTAs of the expected tiles would still
  // fill every slot, or, up to kMaxGroupedKBlocks, make kMinGroupedWaves
  // waves.
  t.down_ctas_per_sm = min_tile && tiles * t.down_blocks > slots
                           ? kDenseMinTileCtasPerSm
                           : gemm_ctas_per_sm(false, t.token_tile, block_wise);
  const int64_t down_slots = int64_t(num_sms) * t.down_ctas_per_sm;
  const int down_k_blocks = static_cast<int>(ceil_div(inter, kTileK));
  auto down_group_may_double = [&](int group) {
    const int64_t ctas = tiles * ceil_div(t.down_blocks, 2 * group);
    return (group * down_k_blocks < kMinCtaKBlocks && ctas >= down_slots) ||
           (2 * group * down_k_blocks <= kMaxGroupedKBlocks &&
            ctas >= kMinGroupedWaves * down_slots);
  };
  t.down_group = 1;
  while (t.down_group < t.down_blocks && down_group_may_double(t.down_group)) {
    t.down_group *= 2;
  }
  t.down_group = std::min(t.down_group, t.down_blocks);
  // Decode path: while the gate-up CTAs of the experts a uniform router is
  // expected to hit (one per 8-column chunk) run in one wave. Each has its
  // whole weight slice in flight at once; more chunks than CTA slots stream
  // better through the grouped GEMMs' pipelines.
  const int smem =
      gate_up_smem_layout(num_tokens, hidden).bytes() + kDecodeStaticSmem;
  const int decode_ctas_per_sm =
      std::min(kDecodeMaxCtasPerSm, kSmemPerSm / smem);
  if (num_tokens <= kDecodeMaxTokens && decode_ctas_per_sm >= 1) {
    const int64_t experts = std::max<int64_t>(
        1, static_cast<int64_t>(std::ceil(num_local_experts * hit)));
    t.decode = experts * ceil_div(inter, kDecodeColumns) <=
               int64_t(decode_ctas_per_sm) * num_sms;
  }
  t.slot_tiles = !t.decode && rows <= kSlotTilesMaxSlots;
  t.evict_first_weights = t.token_tile <= kEvictFirstMaxTokenTile;
  return t;
}

// Why the kernels cannot run tiling `t` for a call of `num_tokens` tokens,
// or nullptr. moe_tiling() only makes tilings they run; the adapter asks
// once per call shape, before it hands a tiling to the launch.
inline const char* tiling_error(const MoeTiling& t, int num_tokens, int topk,
                                bool block_wise) {
  if (t.gate_up_split < 1 || t.gate_up_split > kMaxSplit ||
      (t.gate_up_split > 1 && t.token_tile != kMinTokenTile)) {
    return "split-K tiling out of range";
  }
  if (t.gate_up_group < 1 || (t.gate_up_group > 1 && t.gate_up_split > 1)) {
    return "gate-up grouping out of range";
  }
  if (t.gate_up_rows != kWgRows &&
      (t.gate_up_rows != kWideWgRows ||
       t.token_tile != kThreeQuarterTokenTile || block_wise ||
       t.gate_up_group != 1 || t.gate_up_split != 1)) {
    return "gate-up warpgroup rows out of range";
  }
  // Each GEMM's count for its tile and scaling (the launch instantiates no
  // other), or three 8-token CTAs.
  auto ctas_ok = [&](bool gate_up, int ctas_per_sm) {
    return ctas_per_sm == gemm_ctas_per_sm(gate_up, t.token_tile, block_wise) ||
           gemm_dense_min_tile(t.token_tile, ctas_per_sm);
  };
  if (!ctas_ok(true, t.gate_up_ctas_per_sm) ||
      !ctas_ok(false, t.down_ctas_per_sm)) {
    return "GEMM CTAs per SM out of range";
  }
  if (gemm_one_block_per_cta(t.token_tile, t.gate_up_ctas_per_sm) &&
      (t.gate_up_group != 1 || t.gate_up_split != 1)) {
    return "gate-up grouping out of range";
  }
  if (block_wise && t.token_tile > kMaxBlockWiseTokenTile) {
    return "token tile too wide for block-wise scaling";
  }
  if (t.slot_tiles && int64_t(num_tokens) * topk > kSlotTilesMaxSlots) {
    return "slot tiles out of range";
  }
  return nullptr;
}

}  // namespace moe
}  // namespace hpc
