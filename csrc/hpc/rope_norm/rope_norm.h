// Fused attention prologue: per-head QK-RMSNorm + RoPE + paged KV-cache write
// (+ FP8 quantisation of the cache and of Q), one launch for any mix of
// prefill and decode tokens.
//
// Host interface only: no torch and no device code, so torch_bindings.cpp can
// include it and the kernel translation unit needs no torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hpc {

enum class QkNormPolicy : int {
  kNone = 0,
  kRopeThenNorm = 1,
  kNormThenRope = 2,
};

enum class ScalarType : int { kBFloat16 = 0, kFloat16 = 1 };

struct RopeNormParams {
  // Packed [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim] rows in
  // the order Q heads, K heads, V heads.
  const void* qkv;
  int64_t qkv_row_stride;  // elements
  ScalarType dtype;

  const void* positions;     // [num_tokens], int32 or int64
  const void* slot_mapping;  // [num_tokens], int32 or int64; < 0 = padding
  bool positions_are_int64;
  bool slots_are_int64;

  // vLLM's cos/sin cache: [max_position, rotary_dim], cos half then sin half.
  const void* cos_sin_cache;
  bool cos_sin_is_fp32;  // else the model dtype
  int rotary_dim;
  int max_position;  // rows of the cos/sin cache; positions are clamped
  bool is_neox;

  // Per-head RMSNorm weights [head_dim]; null when policy is kNone.
  const void* q_norm_weight;
  const void* k_norm_weight;
  bool norm_weight_is_fp32;  // else the model dtype
  float eps;
  QkNormPolicy norm_policy;

  // Paged caches viewed as [num_blocks, block_size, num_kv_heads, head_dim]
  // with these element strides (the head_dim stride is 1).
  void* key_cache;
  void* value_cache;
  int64_t cache_block_stride;
  int64_t cache_token_stride;
  int64_t cache_head_stride;
  int block_size;
  bool cache_is_fp8;
  const float* k_scale;  // [1], FP8 cache only
  const float* v_scale;  // [1], FP8 cache only

  // Q output [num_tokens, num_q_heads, head_dim], contiguous.
  void* q_out;
  bool q_out_is_fp8;
  float* q_scale;  // [num_tokens, num_q_heads] when q_out_is_fp8

  int num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
};

void launch_rope_norm(const RopeNormParams& params, cudaStream_t stream);

}  // namespace hpc
