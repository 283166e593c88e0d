// Parameters of the paged prefill kernel (prefill_kernel.cuh). Plain data:
// no torch, no device code.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "attention/prefill/prefill_plan.h"
#include "common/elem_type.h"

namespace hpc {
namespace prefill {

using hpc::ElemType;

struct PrefillParams {
  // Queries [tokens, num_q_heads, head_size], read through a tensor map;
  // FP8 queries carry scales [tokens, num_q_heads]. 16-bit queries over an
  // FP8 cache are quantized per (token, head) in the kernel.
  ElemType q_type;
  const float* q_scale;
  int64_t q_scale_token_stride;

  // Output [tokens, num_q_heads, head_size], bf16 or fp16.
  void* out;
  int64_t out_token_stride;
  int64_t out_head_stride;
  ElemType out_type;

  // Varlen batch: request b owns query tokens [query_start_loc[b],
  // query_start_loc[b + 1]) and seq_lens[b] keys (context + new tokens),
  // cache blocks block_table[b][0..].
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* block_table;
  int64_t block_table_stride;
  int block_size;

  const int32_t* plan;  // prefill_plan.h
  int num_tokens;
  int num_kv_heads;
  int group;        // query heads per KV head
  int tile_tokens;  // tokens per 128-row tile: 128 / group

  float scale;           // softmax scale applied to q.k
  const float* k_scale;  // FP8 KV: per-tensor scales (device scalars)
  const float* v_scale;
  float softcap;  // 0: none
  int window;     // 0: none
};

// What the producer copies: the tensor maps of the queries and of the
// paged cache.
struct PrefillSources {
  CUtensorMap q_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
};

}  // namespace prefill
}  // namespace hpc
