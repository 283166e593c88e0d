// The work of a persistent decode CTA: its granule range of the plan
// (decode_plan.h) turned into work items, one per (unit, tile range), in
// order. The producer and the consumers of a CTA walk it alike.
#pragma once

#include <cstdint>

#include "attention/common/paged_kv_tma.cuh"
#include "attention/decode/decode_params.h"
#include "attention/decode/decode_plan.h"

namespace hpc {
namespace decode {

// What every role of a CTA reads of the plan before its first copy or
// query load: the header words the kernel checks and the CTA's first-item
// descriptor, loaded together so that they cost one memory round trip (a
// chain of them would delay the first K tile by a round trip each).
struct CtaStart {
  int query_tokens;
  int num_ctas;
  int window;
  int4 lo;  // descriptor words 0..3
  int4 hi;  // descriptor words 4..7

  __device__ static CtaStart load(const DecodeParams& p, int cta) {
    static_assert(kItemUnit == 0 && kItemKvLen == 1 && kItemTileBegin == 2 &&
                  kItemTileEnd == 3 && kItemPieces == 4 &&
                  kItemFirstPartial == 5 && kItemPartialRow == 6 &&
                  kItemMergers == 7 && kItemWords == 8);
    const int4* d =
        reinterpret_cast<const int4*>(p.plan + p.layout.cta_first_item() +
                                      static_cast<int64_t>(cta) * kItemWords);
    return {p.plan[kQueryTokens], p.plan[kNumCtas], p.plan[kWindow], d[0],
            d[1]};
  }
};

// Turns the CTA's granule range into work items, in order, with the
// planners' own resolution (resolve_item, decode_plan.h). The first item
// comes whole from the CTA's descriptor (CtaStart), taken by first() so
// that its words are not kept through the walk; the range and the rest of
// the plan are read when the second item is asked for. Walk:
//   for (bool more = cursor.first(start, item); more;
//        more = cursor.next(item)) { ... }
class WorkCursor {
 public:
  __device__ WorkCursor(const DecodeParams& p, int cta) : p_(p), cta_(cta) {}

  // The plan's sliding window (0: none), known from first() on: the planner
  // left out the tiles it hides, and the consumers mask with it.
  __device__ int window() const { return window_; }

  __device__ bool first(const CtaStart& start, WorkItem& item) {
    window_ = start.window;
    const int4 lo = start.lo;
    const int4 hi = start.hi;
    if (lo.x < 0) {
      state_ = State::kDone;
      return false;
    }
    item = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    unit_ = lo.x;
    state_ = State::kSecond;
    return true;
  }

  __device__ bool next(WorkItem& item) {
    if (state_ == State::kDone) return false;
    if (state_ == State::kSecond) locate_after_first();
    if (x_ >= end_) {
      state_ = State::kDone;
      return false;
    }
    const ItemSource source{
        p_.plan, p_.layout, p_.kv_lens,   p_.batch, p_.query_tokens,
        window_, mode_,     split_tiles_, total_,   num_ctas_};
    x_ = resolve_item(source, cta_, x_, end_, unit_, item);
    return true;
  }

 private:
  enum class State { kSecond, kRest, kDone };

  // The granule after the first item: the end of the first item's unit
  // within the range (balanced), else the granule after the range's first.
  __device__ void locate_after_first() {
    state_ = State::kRest;
    total_ = p_.plan[kTotalGranules];
    num_ctas_ = p_.plan[kNumCtas];
    mode_ = static_cast<SplitMode>(p_.plan[kMode]);
    split_tiles_ = p_.plan[kSplitTiles];
    const int32_t* begin = p_.plan + p_.layout.cta_granule_begin();
    x_ = begin[cta_];
    end_ = begin[cta_ + 1];
    if (mode_ == SplitMode::kBalanced) {
      const int last = p_.plan[p_.layout.unit_granule_offset() + unit_ + 1];
      x_ = last < end_ ? last : end_;
    } else {
      x_ += 1;
    }
  }

  const DecodeParams& p_;
  int cta_;
  State state_ = State::kDone;
  int total_ = 0;
  int num_ctas_ = 0;
  SplitMode mode_ = SplitMode::kBalanced;
  int split_tiles_ = 0;
  int window_ = 0;
  int x_ = 0;
  int end_ = 0;
  int unit_ = 0;
};

// The cache blocks of a work item's 64-token tiles, for a producer warp:
// the item's KV head, and each tile's first block, block count and ids
// (through a window that reads the block table ahead).
struct ItemBlocks {
  int kv_head;
  int block_size;
  int per_tile;    // blocks per tile
  int seq_blocks;  // blocks of the sequence
  attention::BlockIdWindow ids;

  __device__ ItemBlocks(const DecodeParams& p, const WorkItem& item, int lane)
      : kv_head(item.unit / p.batch),
        block_size(p.block_size),
        per_tile(kTileTokens / p.block_size),
        seq_blocks((item.kv_len + p.block_size - 1) / p.block_size),
        ids(p.block_table + (item.unit % p.batch) * p.block_table_stride,
            item.tile_begin * per_tile,
            min(item.tile_end * per_tile, seq_blocks), lane) {}

  __device__ int first(int tile) const { return tile * per_tile; }
  __device__ int count(int tile) const {
    return min(per_tile, seq_blocks - first(tile));
  }
  // The id of block `index` (0 .. count) of `tile`; every lane of the warp
  // calls it for the same tile.
  __device__ int id(int tile, int index) {
    return ids.get(first(tile), first(tile) + index);
  }
};

}  // namespace decode
}  // namespace hpc
