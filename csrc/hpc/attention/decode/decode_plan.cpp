// Host implementation of the split-KV decode planner. Evaluates the same
// functions as the GPU planner (decode_plan.h), so both write identical
// plans.
#include <stdexcept>

#include "attention/decode/decode_plan.h"

namespace hpc {
namespace decode {

namespace {

// The step's cut: the requested mode's, or for the balanced mode its
// unit-aligned form when one fits (aligned_split_tiles).
PlanArgs step_cut(const int32_t* kv_lens, const PlanArgs& request) {
  if (request.mode != SplitMode::kBalanced) return request;
  const int num_units = request.batch * request.num_kv_heads;
  const auto tiles_of = [&](int u) {
    return unit_tiles(kv_lens[u % request.batch], request.query_tokens,
                      request.window);
  };
  int64_t total = 0;
  int max_unit_tiles = 0;
  for (int u = 0; u < num_units; ++u) {
    const int tiles = tiles_of(u);
    total += tiles;
    if (tiles > max_unit_tiles) max_unit_tiles = tiles;
  }
  const int ctas = ctas_used(total, request.ctas_offered,
                             balanced_min_tiles(request, max_unit_tiles),
                             SplitMode::kBalanced);
  if (ctas == 0) return request;
  const int l0 = static_cast<int>((total + ctas - 1) / ctas);
  const int split = aligned_split_tiles(l0, ctas, [&](int s) {
    int64_t pieces = 0;
    for (int u = 0; u < num_units; ++u) pieces += (tiles_of(u) + s - 1) / s;
    return pieces;
  });
  if (split == 0) return request;
  PlanArgs cut = request;
  cut.mode = SplitMode::kBatchInvariant;
  cut.split_tiles = split;
  cut.ctas_offered = ctas;
  return cut;
}

}  // namespace

void plan_decode_host(const int32_t* kv_lens, const PlanArgs& request,
                      const PlanLayout& layout, int32_t* plan) {
  const int num_units = request.batch * request.num_kv_heads;
  if (num_units > layout.max_units || request.ctas_offered > layout.max_ctas) {
    throw std::invalid_argument("plan_decode: workspace too small");
  }
  const PlanArgs args = step_cut(kv_lens, request);

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
