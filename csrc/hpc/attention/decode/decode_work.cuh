// The work of a persistent decode CTA: its granule range of the plan
// (decode_plan.h) turned into work items, one per (unit, tile range), in
// order. The producer and the consumers of a CTA walk it alike.
#pragma once

#include <cstdint>

#include "attention/decode/decode_params.h"
#include "attention/decode/decode_plan.h"

namespace hpc {
namespace decode {

// Turns the CTA's granule range into work items, in order, with the
// planners' own resolution (resolve_item, decode_plan.h).
class WorkCursor {
 public:
  __device__ WorkCursor(const DecodeParams& p, int cta)
      : p_(p),
        cta_(cta),
        total_(p.plan[kTotalGranules]),
        num_ctas_(p.plan[kNumCtas]),
        mode_(static_cast<SplitMode>(p.plan[kMode])),
        split_tiles_(p.plan[kSplitTiles]) {
    if (cta < num_ctas_) {
      const int32_t* begin = p.plan + p.layout.cta_granule_begin();
      x_ = begin[cta];
      end_ = begin[cta + 1];
      unit_ = p.plan[p.layout.cta_first_unit() + cta];
    } else {
      x_ = end_ = 0;
      unit_ = 0;
    }
  }

  __device__ bool next(WorkItem& item) {
    if (x_ >= end_) return false;
    const ItemSource source{
        p_.plan,   p_.layout, p_.kv_lens,   p_.batch, p_.query_tokens,
        p_.window, mode_,     split_tiles_, total_,   num_ctas_};
    x_ = resolve_item(source, cta_, x_, end_, unit_, item);
    return true;
  }

 private:
  const DecodeParams& p_;
  int cta_;
  int total_;
  int num_ctas_;
  SplitMode mode_;
  int split_tiles_;
  int x_;
  int end_;
  int unit_;
};

}  // namespace decode
}  // namespace hpc
