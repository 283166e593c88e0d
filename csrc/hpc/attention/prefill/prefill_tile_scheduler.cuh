// Persistent tile scheduler of the paged prefill kernel: deals the plan's
// longest-first tile list (prefill_plan.h) to the CTAs in snake order (round
// r gives tile r * C + c to CTA c on even rounds and r * C + C - 1 - c on
// odd ones), so that the costs a CTA collects even out. The producer and
// the consumers walk it independently and see the same tiles; no atomics,
// no host synchronisation, nothing to reset between launches.
#pragma once

#include <cstdint>

#include "attention/common/mask.h"
#include "attention/prefill/prefill_params.h"
#include "attention/prefill/prefill_plan.h"

namespace hpc {
namespace prefill {

// One 128-row query tile: tile_tokens consecutive tokens of a request times
// the query heads of one KV head, and the key tiles those rows read.
struct TileWork {
  int request;
  int kv_head;
  int token0;    // first token of the tile within the request
  int tokens;    // tokens of the request in the tile (<= tile_tokens)
  int q_begin;   // the request's first query token in the batch
  int kv_len;    // the request's keys, context and new tokens
  int q_offset;  // kv_len - q_len: position of the request's token 0
  attention::KeyTiles keys;

  __device__ bool empty() const { return keys.count() <= 0; }

  // Position of the tile's token t (t may exceed `tokens` for padding
  // rows, whose results are discarded).
  __device__ int position(int t) const { return q_offset + token0 + t; }
};

template <int kBlockN>
class TileScheduler {
 public:
  __device__ explicit TileScheduler(const PrefillParams& p)
      : p_(p),
        tiles_(p.plan + PlanLayout{p.plan[kMaxBatch], 0}.tiles()),
        num_tiles_(p.plan[kNumTiles]),
        round_(0) {}

  __device__ bool next(TileWork& w) {
    const int ctas = static_cast<int>(gridDim.x);
    const int cta = static_cast<int>(blockIdx.x);
    const int index = round_ * ctas + ((round_ & 1) ? ctas - 1 - cta : cta);
    ++round_;
    if (index >= num_tiles_) return false;
    const Tile t = unpack_tile(tiles_ + 2 * static_cast<int64_t>(index));
    const int q_begin = p_.query_start_loc[t.request];
    const int q_len = p_.query_start_loc[t.request + 1] - q_begin;
    w.request = t.request;
    w.kv_head = t.kv_head;
    w.token0 = t.m_block * p_.tile_tokens;
    w.tokens = min(p_.tile_tokens, q_len - w.token0);
    w.q_begin = q_begin;
    w.kv_len = p_.seq_lens[t.request];
    w.q_offset = w.kv_len - q_len;
    w.keys = attention::KeyTiles::of(w.position(0), w.position(w.tokens - 1),
                                     w.kv_len, p_.window, kBlockN);
    // A tile past its request (a plan made for other lengths): no
    // copies, zeros out.
    if (w.tokens <= 0) {
      w.keys.tile_end = w.keys.tile_begin;
    }
    return true;
  }

 private:
  const PrefillParams& p_;
  const int32_t* tiles_;
  int num_tiles_;
  int round_;
};

}  // namespace prefill
}  // namespace hpc
