// Tile plan of paged prefill attention.
//
// Work is cut into tiles of kTileRows = 128 query rows of one KV head: the
// rows are (token, query head) pairs of that KV head, token-major, so a tile
// holds tile_tokens = 128 / group consecutive tokens of one request (GQA
// packing; for group 5, 25 tokens fill 125 rows). A request of q_len tokens
// has ceil(q_len / tile_tokens) tiles per KV head.
//
// The plan lists every (request, m-block, KV head) tile, ordered longest
// first by the keys its last query row sees (causal cost, bucketed), and
// KV-head-major inside a bucket, so that CTAs running at the same time read
// the same KV head. The persistent kernel deals the list to its CTAs in a
// snake order (prefill_tile_scheduler.cuh). The GPU planner writes it once
// per step for all layers (graph-capturable; no host synchronisation); the
// host planner evaluates the same functions, serially, for tests. Inside a
// bucket the GPU planner's order depends on atomics; every tile is
// independent of the others, so the output does not.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/host_device.h"

namespace hpc {
namespace prefill {

constexpr int kTileRows = 128;
// Cost buckets of the longest-first order. Few and wide: the tiles of one
// bucket go KV head by KV head, so the CTAs running at the same time share
// the K/V of a few heads (and requests) in L2 instead of streaming all of
// them; the snake order evens out the costs inside a bucket.
constexpr int kCostBuckets = 16;

enum PlanHeader : int {
  kNumTiles = 0,  // tiles listed
  kTileTokens,    // tokens per tile (128 / group)
  kNumKvHeads,    // KV heads the plan was made for
  kBatch,         // requests planned
  kMaxBatch,      // layout: requests the workspace holds
  kMaxTiles,      // layout: tiles the workspace holds
  kCostShift,     // bucket = keys seen >> shift
  kHeaderFields,  // the fields above; the header's remaining words are zero
  kHeaderSize = 8,
};

HPC_HOST_DEVICE int tile_tokens_of(int group) { return kTileRows / group; }

// Offsets (int32 elements) of the plan's arrays.
struct PlanLayout {
  int max_batch;
  int max_tiles;

  // request_first_item[b]: index of request b's first m-block among all
  // requests' m-blocks; [batch] = their count.
  HPC_HOST_DEVICE int64_t request_first_item() const { return kHeaderSize; }
  // tiles[i]: (request, m_block << 8 | kv_head) as two int32.
  HPC_HOST_DEVICE int64_t tiles() const {
    return request_first_item() + max_batch + 1;
  }
  HPC_HOST_DEVICE int64_t size() const {
    return tiles() + 2 * static_cast<int64_t>(max_tiles);
  }
};

// Tiles a workspace must hold for up to max_tokens query tokens in up to
// max_batch requests: sum over requests of ceil(q_len / T) per KV head is
// at most max_tokens / T + max_batch.
HPC_HOST_DEVICE int64_t max_plan_tiles(int64_t max_tokens, int max_batch,
                                       int group, int num_kv_heads) {
  const int t = tile_tokens_of(group);
  return static_cast<int64_t>(num_kv_heads) *
         ((max_tokens + t - 1) / t + max_batch);
}

HPC_HOST_DEVICE int request_m_blocks(int q_len, int tile_tokens) {
  return q_len <= 0 ? 0 : (q_len + tile_tokens - 1) / tile_tokens;
}

// Keys the last query row of m-block `m` sees (causal, no window): the
// ordering cost of the tile.
HPC_HOST_DEVICE int tile_cost(int q_len, int kv_len, int m, int tile_tokens) {
  int last = (m + 1) * tile_tokens;
  if (last > q_len) last = q_len;
  const int keys = kv_len - q_len + last;
  return keys > 0 ? keys : 0;
}

HPC_HOST_DEVICE int cost_shift(int max_kv_len) {
  int shift = 0;
  while ((max_kv_len >> shift) >= kCostBuckets) ++shift;
  return shift;
}

HPC_HOST_DEVICE void pack_tile(int32_t* entry, int request, int m_block,
                               int kv_head) {
  entry[0] = request;
  entry[1] = (m_block << 8) | kv_head;
}

struct Tile {
  int request;
  int m_block;
  int kv_head;
};

HPC_HOST_DEVICE Tile unpack_tile(const int32_t* entry) {
  return {entry[0], entry[1] >> 8, entry[1] & 0xff};
}

struct PlanArgs {
  int batch;
  int group;
  int num_kv_heads;
};

// Host planner: fills `plan` from host-resident query_start_loc [batch + 1]
// and seq_lens [batch].
void plan_prefill_host(const int32_t* query_start_loc, const int32_t* seq_lens,
                       const PlanArgs& args, const PlanLayout& layout,
                       int32_t* plan);

// GPU planner: the same tiles from device-resident lengths, in one CTA
// (graph-capturable).
void plan_prefill_device(const int32_t* query_start_loc,
                         const int32_t* seq_lens, const PlanArgs& args,
                         const PlanLayout& layout, int32_t* plan,
                         cudaStream_t stream);

}  // namespace prefill
}  // namespace hpc
