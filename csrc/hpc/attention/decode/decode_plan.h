// Split-KV decode plan: which persistent CTA processes which KV tiles, and
// how the combine finds the pieces of a split sequence.
//
// Work is cut into 64-token KV tiles per (KV head, sequence) "unit", in the
// order unit = kv_head * batch + sequence. Two modes:
//
// * balanced (fixed_split_tiles == 0): the work granule is one tile. The
//   W = sum of all units' tiles are dealt to C CTAs as contiguous ranges
//   [floor(c * W / C), floor((c + 1) * W / C)), so tile counts differ by at
//   most one between CTAs; a unit is split wherever a range boundary falls.
//   C is the number of CTAs the caller offers, reduced so that every CTA
//   gets at least min_split_tiles tiles.
// * batch-invariant (fixed_split_tiles == S > 0): every unit is cut into
//   pieces of S tiles (the last may be shorter), independently of the other
//   sequences, and the pieces are dealt to CTAs as contiguous ranges in the
//   same way. Each piece is combined in a fixed order, so a sequence's output
//   does not depend on what it is batched with.
//
// The plan is a flat int32 workspace (layout below) written either by the
// host implementation or by the GPU planner; both evaluate the functions in
// this header, so their outputs are bit-identical. No torch, no device code
// beyond __host__ __device__ helpers.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define HPC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define HPC_HOST_DEVICE inline
#endif

namespace hpc {
namespace decode {

constexpr int kTileTokens = 64;

// Header fields, at the start of the workspace.
enum PlanHeader : int {
  kNumUnits = 0,    // batch * num_kv_heads
  kTotalGranules,   // W: tiles (balanced) or pieces (batch-invariant)
  kNumCtas,         // CTAs that receive work (<= the CTAs offered)
  kNumPartials,     // pieces of split units: rows of partial output/LSE
  kGranuleTiles,    // 1 (balanced) or S (batch-invariant)
  kQueryTokens,     // query tokens per sequence
  kBatchInvariant,  // 1: every granule is a piece of its own
  kHeaderSize = 8,
};

// Offsets (in int32 elements) of the plan's arrays for a workspace sized for
// up to `max_units` units and `max_ctas` CTAs.
struct PlanLayout {
  int max_units;
  int max_ctas;

  // unit_granule_offset[u]: first granule of unit u; [num_units] = W.
  HPC_HOST_DEVICE int64_t unit_granule_offset() const { return kHeaderSize; }
  // unit_num_pieces[u]: pieces unit u is split into (1: written directly).
  HPC_HOST_DEVICE int64_t unit_num_pieces() const {
    return unit_granule_offset() + max_units + 1;
  }
  // unit_first_partial[u]: partial row of its first piece, -1 if unsplit.
  HPC_HOST_DEVICE int64_t unit_first_partial() const {
    return unit_num_pieces() + max_units;
  }
  // cta_granule_begin[c]: first granule of CTA c; [num_ctas] = W.
  HPC_HOST_DEVICE int64_t cta_granule_begin() const {
    return unit_first_partial() + max_units;
  }
  // cta_first_unit[c]: unit holding CTA c's first granule.
  HPC_HOST_DEVICE int64_t cta_first_unit() const {
    return cta_granule_begin() + max_ctas + 1;
  }
  HPC_HOST_DEVICE int64_t size() const { return cta_first_unit() + max_ctas; }
};

HPC_HOST_DEVICE int num_tiles(int kv_len) {
  return kv_len <= 0 ? 0 : (kv_len + kTileTokens - 1) / kTileTokens;
}

// Granules of one unit: its tiles, or its S-tile pieces.
HPC_HOST_DEVICE int unit_granules(int kv_len, int granule_tiles) {
  const int tiles = num_tiles(kv_len);
  return (tiles + granule_tiles - 1) / granule_tiles;
}

// CTAs that receive work: all offered, but in balanced mode no more than
// keep min_split_tiles tiles per CTA.
HPC_HOST_DEVICE int ctas_used(int64_t total_granules, int ctas_offered,
                              int min_split_tiles, bool balanced) {
  if (total_granules <= 0) return 0;
  int64_t limit = total_granules;
  if (balanced && min_split_tiles > 1) {
    limit = total_granules / min_split_tiles;
    if (limit < 1) limit = 1;
  }
  return static_cast<int>(limit < ctas_offered ? limit : ctas_offered);
}

// First granule of CTA c (c == num_ctas gives the total).
HPC_HOST_DEVICE int64_t cta_begin(int c, int64_t total_granules, int num_ctas) {
  return static_cast<int64_t>(c) * total_granules / num_ctas;
}

// The CTA whose range holds granule x: the largest c with begin(c) <= x.
HPC_HOST_DEVICE int cta_of(int64_t x, int64_t total_granules, int num_ctas) {
  return static_cast<int>(((x + 1) * num_ctas - 1) / total_granules);
}

// Pieces unit u is cut into, given its granule range [first, first + count).
HPC_HOST_DEVICE int unit_pieces(int64_t first, int count,
                                int64_t total_granules, int num_ctas,
                                bool balanced) {
  if (count == 0) return 0;
  if (!balanced) return count;  // every S-tile piece stands alone
  return cta_of(first + count - 1, total_granules, num_ctas) -
         cta_of(first, total_granules, num_ctas) + 1;
}

// Host planner: fills `plan` (PlanLayout{max_units, max_ctas}.size() ints)
// for `batch` sequences with KV lengths `kv_lens`.
void plan_decode_host(const int32_t* kv_lens, int batch, int num_kv_heads,
                      int query_tokens, int ctas_offered, int min_split_tiles,
                      int fixed_split_tiles, const PlanLayout& layout,
                      int32_t* plan);

}  // namespace decode
}  // namespace hpc
