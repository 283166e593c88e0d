// Host implementation of the split-KV decode planner. Evaluates the same
// functions as the GPU planner (decode_plan.h), so both write identical
// plans.
#include <stdexcept>

#include "attention/decode/decode_plan.h"

namespace hpc {
namespace decode {

void plan_decode_host(const int32_t* kv_lens, const PlanArgs& args,
                      const PlanLayout& layout, int32_t* plan) {
  const int num_units = args.batch * args.num_kv_heads;
  if (num_units > layout.max_units || args.ctas_offered > layout.max_ctas) {
    throw std::invalid_argument("plan_decode: workspace too small");
  }

  int32_t* unit_offset = plan + layout.unit_granule_offset();
  int64_t total = 0;
  int max_unit_tiles = 0;
  for (int u = 0; u < num_units; ++u) {
    unit_offset[u] = static_cast<int32_t>(total);
    const int tiles =
        unit_tiles(kv_lens[u % args.batch], args.query_tokens, args.window);
    total += unit_granules(tiles, args.mode, args.split_tiles);
    if (tiles > max_unit_tiles) max_unit_tiles = tiles;
  }
  unit_offset[num_units] = static_cast<int32_t>(total);
  const int num_ctas =
      ctas_used(total, args.ctas_offered,
                balanced_min_tiles(args, max_unit_tiles), args.mode);
  if (num_ctas > layout.max_ctas) {
    throw std::invalid_argument("plan_decode: more pieces than CTA slots");
  }

  int32_t* num_pieces = plan + layout.unit_num_pieces();
  int32_t* first_partial = plan + layout.unit_first_partial();
  int32_t partials = 0;
  for (int u = 0; u < num_units; ++u) {
    const int count = unit_offset[u + 1] - unit_offset[u];
    const int pieces = num_ctas == 0 ? 0
                                     : unit_pieces(unit_offset[u], count, total,
                                                   num_ctas, args.mode);
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

  // Every slot is rewritten, so that a slot idle in this plan never keeps
  // the work of an earlier, larger one.
  const ItemSource source{plan,
                          layout,
                          kv_lens,
                          args.batch,
                          args.query_tokens,
                          args.window,
                          args.mode,
                          args.split_tiles,
                          static_cast<int>(total),
                          num_ctas};
  for (int c = 0; c < layout.max_ctas; ++c) {
    if (c < num_ctas && begin[c] < begin[c + 1]) {
      int u = first_unit[c];
      WorkItem item;
      resolve_item(source, c, begin[c], begin[c + 1], u, item);
      store_cta_item(plan, layout, c, &item);
    } else {
      store_cta_item(plan, layout, c, nullptr);
    }
  }

  plan[kNumUnits] = num_units;
  plan[kTotalGranules] = static_cast<int32_t>(total);
  plan[kNumCtas] = num_ctas;
  plan[kNumPartials] = partials;
  plan[kSplitTiles] =
      args.mode == SplitMode::kBatchInvariant ? args.split_tiles : 0;
  plan[kQueryTokens] = args.query_tokens;
  plan[kMode] = static_cast<int32_t>(args.mode);
  plan[kWindow] = args.window;
}

}  // namespace decode
}  // namespace hpc
