// Parameters of the split-KV decode kernel (decode_kernel.cuh, which also
// runs the combine, combine.cuh). Plain data: no torch, no device code.
#pragma once

#include <cstdint>

#include "attention/decode/decode_plan.h"
#include "common/elem_type.h"

namespace hpc {
namespace decode {

using hpc::ElemType;

struct DecodeParams {
  // Queries [tokens, num_q_heads, head_size]: query t of sequence b is token
  // b * query_tokens + t. FP8 queries carry scales [tokens, num_q_heads].
  const void* q;
  int64_t q_token_stride;
  int64_t q_head_stride;
  ElemType q_type;
  const float* q_scale;
  int64_t q_scale_token_stride;

  // Output [tokens, num_q_heads, head_size], bf16 or fp16.
  void* out;
  int64_t out_token_stride;
  int64_t out_head_stride;
  ElemType out_type;

  // Paged KV: the kernels read K and V through TMA descriptors built from
  // the cache views; the block table maps (sequence, block) to a cache block.
  const int32_t* block_table;
  int64_t block_table_stride;
  const int32_t* kv_lens;
  int block_size;

  const int32_t* plan;
  PlanLayout layout;
  float* partial_out;  // [partial rows, rows, head_size]
  float* partial_lse;  // [partial rows, rows], log2 domain
  // Per unit: pieces finished, then merge slices done; zero between
  // launches (the CTA that ends the unit's merge resets it, combine.cuh).
  int32_t* piece_counters;

  int batch;
  int num_kv_heads;
  int group;         // query heads per KV head
  int query_tokens;  // query tokens per sequence
  int rows;          // query_tokens * group: rows of one unit's tile

  float scale;           // softmax scale applied to q.k
  const float* k_scale;  // FP8 KV: per-tensor scales (device scalars)
  const float* v_scale;
  float softcap;  // 0: none
  // Every CTA of the grid is resident at once (the grid fits the device,
  // set at launch): only then may a CTA wait for others, as the pieces that
  // share a unit's merge do (WorkItem::mergers).
  bool grid_resident;
  // The sliding window is the plan's (plan[kWindow]): it is stated once, by
  // the planner that cut the tiles it leaves out.
};

}  // namespace decode
}  // namespace hpc
