// Host implementation of the prefill tile planner (prefill_plan.h): the
// same functions as the GPU planner, evaluated serially. Inside a bucket the
// items keep their flat order (request-major, then m-block), which is one of
// the orders the GPU planner may produce.
#include <stdexcept>
#include <vector>

#include "attention/prefill/prefill_plan.h"

namespace hpc {
namespace prefill {

void plan_prefill_host(const int32_t* query_start_loc, const int32_t* seq_lens,
                       const PlanArgs& args, const PlanLayout& layout,
                       int32_t* plan) {
  if (args.batch < 0 || args.batch > layout.max_batch) {
    throw std::invalid_argument("plan_prefill: batch exceeds the workspace");
  }
  if (args.group < 1 || args.group > kTileRows || args.num_kv_heads < 1) {
    throw std::invalid_argument("plan_prefill: bad head configuration");
  }
  const int tile_tokens = tile_tokens_of(args.group);
  const int heads = args.num_kv_heads;

  // Items (request, m-block), numbered request-major.
  int32_t* first_item = plan + layout.request_first_item();
  int64_t items = 0;
  int max_kv_len = 0;
  for (int b = 0; b < args.batch; ++b) {
    first_item[b] = static_cast<int32_t>(items);
    const int q_len = query_start_loc[b + 1] - query_start_loc[b];
    items += request_m_blocks(q_len, tile_tokens);
    if (seq_lens[b] > max_kv_len) max_kv_len = seq_lens[b];
  }
  const int64_t num_tiles = items * heads;
  if (num_tiles > layout.max_tiles) {
    plan[kNumTiles] = 0;
    throw std::invalid_argument("plan_prefill: more tiles than the workspace");
  }
  first_item[args.batch] = static_cast<int32_t>(items);
  const int shift = cost_shift(max_kv_len);

  // Counting sort of the items by bucket, longest first.
  std::vector<int32_t> bucket_of(static_cast<size_t>(items));
  std::vector<int32_t> count(kCostBuckets, 0);
  for (int b = 0; b < args.batch; ++b) {
    const int q_len = query_start_loc[b + 1] - query_start_loc[b];
    for (int m = 0; m < request_m_blocks(q_len, tile_tokens); ++m) {
      const int bucket = tile_cost(q_len, seq_lens[b], m, tile_tokens) >> shift;
      bucket_of[first_item[b] + m] = bucket;
      ++count[bucket];
    }
  }
  // base[k]: items in buckets above k.
  std::vector<int32_t> base(kCostBuckets);
  int32_t above = 0;
  for (int k = kCostBuckets - 1; k >= 0; --k) {
    base[k] = above;
    above += count[k];
  }

  std::vector<int32_t> rank(kCostBuckets, 0);
  int32_t* tiles = plan + layout.tiles();
  for (int b = 0; b < args.batch; ++b) {
    const int q_len = query_start_loc[b + 1] - query_start_loc[b];
    for (int m = 0; m < request_m_blocks(q_len, tile_tokens); ++m) {
      const int bucket = bucket_of[first_item[b] + m];
      const int64_t n = count[bucket];
      const int64_t r = rank[bucket]++;
      for (int h = 0; h < heads; ++h) {
        const int64_t index = static_cast<int64_t>(base[bucket]) * heads +
                              static_cast<int64_t>(h) * n + r;
        pack_tile(tiles + 2 * index, b, m, h);
      }
    }
  }

  plan[kNumTiles] = static_cast<int32_t>(num_tiles);
  plan[kTileTokens] = tile_tokens;
  plan[kNumKvHeads] = heads;
  plan[kBatch] = args.batch;
  plan[kMaxBatch] = layout.max_batch;
  plan[kMaxTiles] = layout.max_tiles;
  plan[kCostShift] = shift;
  plan[kHeaderSize - 1] = 0;
}

}  // namespace prefill
}  // namespace hpc
