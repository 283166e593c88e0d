// Host implementation of the split-KV decode planner. Evaluates the same
// functions as the GPU planner (decode_plan.h), so both write identical
// plans.
#include <stdexcept>

#include "attention/decode/decode_plan.h"

namespace hpc {
namespace decode {

void plan_decode_host(const int32_t* kv_lens, int batch, int num_kv_heads,
                      int query_tokens, int ctas_offered, int min_split_tiles,
                      int fixed_split_tiles, const PlanLayout& layout,
                      int32_t* plan) {
  const int num_units = batch * num_kv_heads;
  if (num_units > layout.max_units || ctas_offered > layout.max_ctas) {
    throw std::invalid_argument("plan_decode: workspace too small");
  }
  const bool balanced = fixed_split_tiles == 0;
  const int granule_tiles = balanced ? 1 : fixed_split_tiles;

  int32_t* unit_offset = plan + layout.unit_granule_offset();
  int64_t total = 0;
  for (int u = 0; u < num_units; ++u) {
    unit_offset[u] = static_cast<int32_t>(total);
    total += unit_granules(kv_lens[u % batch], granule_tiles);
  }
  unit_offset[num_units] = static_cast<int32_t>(total);
  const int num_ctas =
      ctas_used(total, ctas_offered, min_split_tiles, balanced);

  int32_t* num_pieces = plan + layout.unit_num_pieces();
  int32_t* first_partial = plan + layout.unit_first_partial();
  int32_t partials = 0;
  for (int u = 0; u < num_units; ++u) {
    const int count = unit_offset[u + 1] - unit_offset[u];
    const int pieces = num_ctas == 0 ? 0
                                     : unit_pieces(unit_offset[u], count, total,
                                                   num_ctas, balanced);
    num_pieces[u] = pieces;
    first_partial[u] = pieces > 1 ? partials : -1;
    if (pieces > 1) partials += pieces;
  }

  int32_t* begin = plan + layout.cta_granule_begin();
  int32_t* first_unit = plan + layout.cta_first_unit();
  int unit = 0;
  for (int c = 0; c < num_ctas; ++c) {
    begin[c] = static_cast<int32_t>(cta_begin(c, total, num_ctas));
    // Units are visited in order, so this walk is O(units + CTAs); the GPU
    // planner finds the same unit by binary search.
    while (unit_offset[unit + 1] <= begin[c]) ++unit;
    first_unit[c] = unit;
  }
  begin[num_ctas] = static_cast<int32_t>(total);

  plan[kNumUnits] = num_units;
  plan[kTotalGranules] = static_cast<int32_t>(total);
  plan[kNumCtas] = num_ctas;
  plan[kNumPartials] = partials;
  plan[kGranuleTiles] = granule_tiles;
  plan[kQueryTokens] = query_tokens;
  plan[kBatchInvariant] = balanced ? 0 : 1;
}

}  // namespace decode
}  // namespace hpc
