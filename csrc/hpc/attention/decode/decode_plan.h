// Split-KV decode plan: which persistent CTA processes which KV tiles, and
// how the combine finds the pieces of a split sequence.
//
// Work is cut into 64-token KV tiles per (KV head, sequence) "unit", in the
// order unit = kv_head * batch + sequence. A unit's tiles start at the first
// tile its sliding window can see (tile 0 without a window). Three modes:
//
// * balanced: the work granule is one tile. The W = sum of all units' tiles
//   are dealt to C CTAs as contiguous ranges [floor(c * W / C),
//   floor((c + 1) * W / C)), so tile counts differ by at most one between
//   CTAs; a unit is split wherever a range boundary falls. C is the number of
//   CTAs the caller offers, reduced so that every CTA gets at least
//   min_split_tiles tiles (or more, merge_bound_tiles). When whole pieces
//   of nearly the same length fit every unit into those CTAs, the plan is
//   the batch-invariant one with that piece length instead
//   (aligned_split_tiles): one work item per CTA.
// * batch-invariant: every unit is cut into pieces of S = split_tiles tiles
//   (the last may be shorter), independently of the other sequences, and the
//   pieces are dealt to CTAs as contiguous ranges in the same way. Each piece
//   is combined in a fixed order, so a sequence's output does not depend on
//   what it is batched with.
// * static: the classic split-KV schedule, kept for A/B comparison: a unit of
//   L tokens is cut into min(16, ceil(L / 512)) equal pieces and every piece
//   gets a CTA of its own.
//
// The plan is a flat int32 workspace (layout below) written either by the
// host implementation or by the GPU planner; both evaluate the functions in
// this header, so their outputs are bit-identical. Besides the split tables
// it holds every CTA's first work item, resolved by the same function the
// kernel's cursor uses (resolve_item). No torch, no device code beyond
// __host__ __device__ helpers.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>

#include "attention/common/mask.h"
#include "common/host_device.h"
#include "kernel_limits.h"

namespace hpc {
namespace decode {

constexpr int kTileTokens = limits::kDecodeTileTokens;
constexpr int kStaticMaxSplits = 16;
constexpr int kStaticSplitTokens = 512;

enum class SplitMode : int { kBalanced = 0, kBatchInvariant = 1, kStatic = 2 };

// Header fields, at the start of the workspace.
enum PlanHeader : int {
  kNumUnits = 0,   // batch * num_kv_heads
  kTotalGranules,  // W: tiles (balanced) or pieces (other modes)
  kNumCtas,        // CTAs that receive work
  kNumPartials,    // pieces of split units: rows of partial output/LSE
  kSplitTiles,     // S of the batch-invariant mode, else 0
  kQueryTokens,    // query tokens per sequence
  kMode,           // SplitMode
  kWindow,         // sliding window in tokens, 0: none
  kHeaderSize = 8,
};

// Fields of a CTA's first-item descriptor (PlanLayout::cta_first_item), in
// WorkItem's order. A CTA without work has unit -1 and an empty tile range.
enum CtaItemField : int {
  kItemUnit = 0,
  kItemKvLen,
  kItemTileBegin,
  kItemTileEnd,
  kItemPieces,
  kItemFirstPartial,
  kItemPartialRow,
  kItemMergers,
  kItemWords = 8,
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
  // cta_first_item[c * kItemWords + field]: CTA c's first work item,
  // resolved, for every CTA slot (the kernel's grid), so that a CTA starts
  // from one load instead of a chain of dependent ones. It is last so that
  // the other arrays keep their offsets. Each descriptor is 8 words on a
  // 32-byte boundary of the plan (a fresh allocation is at least that
  // aligned), so it fills exactly one 32-byte L2 sector: one memory
  // transaction, read whole by two 16-byte vector loads (which need 16-byte
  // alignment) or one 32-byte load where the ISA has it.
  HPC_HOST_DEVICE int64_t cta_first_item() const {
    const int64_t end = cta_first_unit() + max_ctas;
    return (end + kItemWords - 1) / kItemWords * kItemWords;
  }
  HPC_HOST_DEVICE int64_t size() const {
    return cta_first_item() + static_cast<int64_t>(max_ctas) * kItemWords;
  }
};

HPC_HOST_DEVICE int num_tiles(int kv_len) {
  return kv_len <= 0 ? 0 : (kv_len + kTileTokens - 1) / kTileTokens;
}

// First KV tile any of the unit's query tokens can see: the last
// query_tokens positions of the sequence are the queries, and with a window
// of w tokens the query at position p sees (p - w, p].
HPC_HOST_DEVICE int first_visible_tile(int kv_len, int query_tokens,
                                       int window) {
  return attention::key_begin(
             attention::query_position(kv_len, query_tokens, 0), window) /
         kTileTokens;
}

// Tiles of a unit that are read: from the first visible tile to the end.
HPC_HOST_DEVICE int unit_tiles(int kv_len, int query_tokens, int window) {
  const int tiles = num_tiles(kv_len);
  return tiles == 0 ? 0
                    : tiles - first_visible_tile(kv_len, query_tokens, window);
}

// Tiles per granule of a unit with `tiles` tiles.
HPC_HOST_DEVICE int granule_tiles(int tiles, SplitMode mode, int split_tiles) {
  if (mode == SplitMode::kBalanced) return 1;
  if (mode == SplitMode::kBatchInvariant) return split_tiles;
  int splits =
      (tiles * kTileTokens + kStaticSplitTokens - 1) / kStaticSplitTokens;
  if (splits > kStaticMaxSplits) splits = kStaticMaxSplits;
  if (splits < 1) splits = 1;
  return (tiles + splits - 1) / splits;
}

HPC_HOST_DEVICE int unit_granules(int tiles, SplitMode mode, int split_tiles) {
  if (tiles <= 0) return 0;
  const int per = granule_tiles(tiles, mode, split_tiles);
  return (tiles + per - 1) / per;
}

// Balanced mode: the fewest tiles a CTA's range should hold so that merging
// the longest unit does not outweigh its pieces. A split unit's merge reads
// every piece's partial rows (rows x head size fp32 each, combine.cuh;
// shared by its mergers or done by one CTA), while a piece streams its
// tiles' K and V (2 x 64 x head size x kv_elem_bytes bytes each). A unit of
// T tiles in pieces of S tiles reads T / S partials in its merge; the
// merge's bytes stay at most kMergeBytesPerPieceByte times a piece's KV
// bytes when
//   S^2 >= kMergeBytesPerPieceByte^-1 x T x rows x 4 / (128 x kv_elem_bytes).
// Rows here are the unit's query rows (query tokens x query heads per KV
// head). Returns that least S (0 when the units are short enough that the
// offered CTAs decide).
constexpr int kMergeBytesPerPieceByte = 1;
HPC_HOST_DEVICE int merge_bound_tiles(int max_unit_tiles, int rows,
                                      int kv_elem_bytes) {
  // S^2 x 32 x kv_elem_bytes x kMergeBytesPerPieceByte >= T x rows.
  const int64_t need = static_cast<int64_t>(max_unit_tiles) * rows;
  const int64_t per = 32LL * kv_elem_bytes * kMergeBytesPerPieceByte;
  if (need <= 0 || per <= 0) return 0;
  // The square root rounded, then made exact in integers, so that the host
  // and the GPU planner agree bit for bit.
  int64_t s = static_cast<int64_t>(sqrt(static_cast<double>(need) / per));
  while (s * s * per < need) ++s;
  while (s > 1 && (s - 1) * (s - 1) * per >= need) --s;
  return static_cast<int>(s);
}

// CTAs that receive work. Balanced: all offered, but no more than keep
// min_split_tiles tiles each. Batch-invariant: all offered, at most one per
// piece. Static: one per piece.
HPC_HOST_DEVICE int ctas_used(int64_t total_granules, int ctas_offered,
                              int min_split_tiles, SplitMode mode) {
  if (total_granules <= 0) return 0;
  if (mode == SplitMode::kStatic) return static_cast<int>(total_granules);
  int64_t limit = total_granules;
  if (mode == SplitMode::kBalanced && min_split_tiles > 1) {
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
// Balanced: one per CTA its tiles touch; other modes: one per granule.
HPC_HOST_DEVICE int unit_pieces(int64_t first, int count,
                                int64_t total_granules, int num_ctas,
                                SplitMode mode) {
  if (count == 0) return 0;
  if (mode != SplitMode::kBalanced) return count;
  return cta_of(first + count - 1, total_granules, num_ctas) -
         cta_of(first, total_granules, num_ctas) + 1;
}

// One (unit, tile range) a CTA processes: the granules of one unit within
// its range (balanced) or one granule (other modes, where every granule is a
// piece).
struct WorkItem {
  int unit;
  int kv_len;
  int tile_begin;  // absolute tile indices in the sequence
  int tile_end;
  int pieces;         // pieces of the unit (1: written directly)
  int first_partial;  // partial row of the unit's first piece (split units)
  int partial_row;    // partial row of this piece (split units)
  int mergers;        // the unit's first pieces that share its merge
};

// The pieces that share the merge of a unit cut into `pieces` pieces over
// granules [first, last): the first `mergers` pieces, each the last work
// item of its CTA, which waits for the unit's other pieces and then merges
// a slice of its rows (combine.cuh) instead of leaving the whole merge to
// the CTA that finishes last. Balanced: every piece but the last ends its
// CTA's range (the unit goes on into the next CTA), and the last does when
// the unit ends where its CTA's range does. Other modes: every piece when
// each CTA holds one granule, else none (the last CTA merges alone).
HPC_HOST_DEVICE int unit_mergers(int first, int last, int pieces,
                                 int64_t total_granules, int num_ctas,
                                 SplitMode mode) {
  if (pieces <= 1) return 0;
  if (mode != SplitMode::kBalanced) {
    return num_ctas >= total_granules ? pieces : 0;
  }
  const int c = cta_of(last - 1, total_granules, num_ctas);
  const bool ends_cta = cta_begin(c + 1, total_granules, num_ctas) == last;
  return pieces - 1 + (ends_cta ? 1 : 0);
}

// What resolving a work item reads besides the CTA's position: the plan's
// unit arrays (already written), its scalars and the lengths. The kernel
// takes them from its parameters and the plan header, the planners from
// their arguments; the values are the same.
struct ItemSource {
  const int32_t* plan;
  PlanLayout layout;
  const int32_t* kv_lens;
  int batch;
  int query_tokens;
  int window;
  SplitMode mode;
  int split_tiles;
  int total;     // W
  int num_ctas;  // CTAs that receive work
};

// The work item CTA `cta` starts at granule x of its range [.., end),
// x < end. `unit` is the unit holding x or an earlier one (the CTA's
// previous unit, or its first) and is advanced to the one holding x.
// Returns the granule after the item. This is the one definition of a work
// item: the decode kernel's cursor and both planners' descriptors call it.
HPC_HOST_DEVICE int resolve_item(const ItemSource& s, int cta, int x, int end,
                                 int& unit, WorkItem& item) {
  const int32_t* offset = s.plan + s.layout.unit_granule_offset();
  while (offset[unit + 1] <= x) ++unit;
  const int first = offset[unit];
  const int last = offset[unit + 1];
  const int kv_len = s.kv_lens[unit % s.batch];
  const int tile0 = first_visible_tile(kv_len, s.query_tokens, s.window);
  const int tiles = unit_tiles(kv_len, s.query_tokens, s.window);
  const int per = granule_tiles(tiles, s.mode, s.split_tiles);
  const int g0 = x - first;
  const bool balanced = s.mode == SplitMode::kBalanced;
  const int g1 = balanced ? (end < last ? end : last) - first : g0 + 1;
  item.unit = unit;
  item.kv_len = kv_len;
  item.tile_begin = tile0 + g0 * per;
  item.tile_end = tile0 + (g1 * per < tiles ? g1 * per : tiles);
  item.pieces = s.plan[s.layout.unit_num_pieces() + unit];
  const int piece = balanced ? cta - cta_of(first, s.total, s.num_ctas) : g0;
  item.first_partial = s.plan[s.layout.unit_first_partial() + unit];
  item.partial_row = item.first_partial + piece;
  item.mergers =
      unit_mergers(first, last, item.pieces, s.total, s.num_ctas, s.mode);
  return first + g1;
}

// Writes CTA c's descriptor: its first work item, or the idle marker when
// `item` is null.
HPC_HOST_DEVICE void store_cta_item(int32_t* plan, const PlanLayout& layout,
                                    int c, const WorkItem* item) {
  int32_t* d =
      plan + layout.cta_first_item() + static_cast<int64_t>(c) * kItemWords;
  d[kItemUnit] = item ? item->unit : -1;
  d[kItemKvLen] = item ? item->kv_len : 0;
  d[kItemTileBegin] = item ? item->tile_begin : 0;
  d[kItemTileEnd] = item ? item->tile_end : 0;
  d[kItemPieces] = item ? item->pieces : 0;
  d[kItemFirstPartial] = item ? item->first_partial : -1;
  d[kItemPartialRow] = item ? item->partial_row : -1;
  d[kItemMergers] = item ? item->mergers : 0;
}

// What a workspace must hold to serve every step of up to `max_batch`
// sequences with `num_kv_heads` KV heads over a cache of `max_kv_tokens`
// tokens: the plan's CTA slots and the rows of partial output (pieces of
// split units), from the bounds each mode's planner keeps.
struct WorkspaceSizes {
  int64_t plan_ctas;
  int64_t max_partials;
};

inline WorkspaceSizes workspace_sizes(SplitMode mode, int64_t max_batch,
                                      int64_t num_kv_heads,
                                      int64_t max_kv_tokens,
                                      int64_t ctas_offered,
                                      int64_t split_tiles) {
  const int64_t max_units = max_batch * num_kv_heads;
  switch (mode) {
    case SplitMode::kStatic:
      // Every piece gets its own CTA.
      return {max_units * kStaticMaxSplits, max_units * kStaticMaxSplits};
    case SplitMode::kBatchInvariant: {
      // Pieces of unit u: ceil(T_u / S) <= T_u / S + 1, and the tiles of all
      // units together are bounded by the cache capacity.
      const int64_t max_tiles =
          num_kv_heads *
          ((max_kv_tokens + kTileTokens - 1) / kTileTokens + max_batch);
      return {ctas_offered,
              max_units + (max_tiles + split_tiles - 1) / split_tiles};
    }
    case SplitMode::kBalanced:
    default:
      // A CTA holds at most two pieces of split units: its first and its
      // last.
      return {ctas_offered, 2 * ctas_offered};
  }
}

struct PlanArgs {
  int batch;
  int num_kv_heads;
  int query_tokens;
  int window;  // 0: none
  int ctas_offered;
  int min_split_tiles;
  SplitMode mode;
  int split_tiles;    // batch-invariant mode
  int group;          // query heads per KV head
  int kv_elem_bytes;  // 1 (FP8) or 2
};

// The balanced mode's least tiles per CTA for a step whose longest unit
// has `max_unit_tiles` tiles: the caller's, or more where the merge asks
// for it (merge_bound_tiles).
HPC_HOST_DEVICE int balanced_min_tiles(const PlanArgs& args,
                                       int max_unit_tiles) {
  const int merge = merge_bound_tiles(
      max_unit_tiles, args.query_tokens * args.group, args.kv_elem_bytes);
  return merge > args.min_split_tiles ? merge : args.min_split_tiles;
}

// Balanced mode, unit-aligned. The balanced ranges cut units wherever a
// range boundary falls, so most CTAs hold the end of one unit and the start
// of the next: two work items, each with its own query load, epilogue and
// partial rows, the second waiting for the first's merge when the CTA
// finished that unit's last piece. If pieces of L tiles, L at most an eighth
// (and at least one tile) above the balanced plan's longest range `l0`,
// cut every unit into no more pieces than the plan's `ctas` CTAs, the
// planners write the batch-invariant plan with S = L (one piece per CTA).
// `pieces_of(L)` returns the sum over units of ceil(tiles / L), the same on
// every caller (a block-wide sum on the GPU). Returns the least such L, or 0
// when none fits.
HPC_HOST_DEVICE int aligned_limit(int l0) { return l0 + (l0 + 7) / 8; }

template <class PiecesOf>
HPC_HOST_DEVICE int aligned_split_tiles(int l0, int ctas, PiecesOf pieces_of) {
  int lo = l0;
  int hi = aligned_limit(l0);
  if (l0 <= 0 || pieces_of(hi) > ctas) return 0;
  // pieces_of does not grow with L: the least L that fits, by bisection.
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (pieces_of(mid) <= ctas) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// Host planner: fills `plan` (layout.size() int32) for `args.batch`
// sequences with KV lengths `kv_lens`.
void plan_decode_host(const int32_t* kv_lens, const PlanArgs& args,
                      const PlanLayout& layout, int32_t* plan);

// GPU planner: the same plan from device-resident lengths, in one small
// kernel launched with PDL (graph-capturable).
void plan_decode_device(const int32_t* kv_lens, const PlanArgs& args,
                        const PlanLayout& layout, int32_t* plan,
                        cudaStream_t stream);

}  // namespace decode
}  // namespace hpc
