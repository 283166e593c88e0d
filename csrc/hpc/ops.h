// Torch-facing entry points of _hpc_C. Each adapter converts tensors into the
// kernel's plain params struct; inputs were validated by vllm/_hpc_ops.py, so
// the adapters only TORCH_CHECK the invariants the kernels rely on.
#pragma once

#include <ATen/Tensor.h>

#include <optional>

namespace hpc {

void rope_norm_store_kv(const at::Tensor& qkv, const at::Tensor& positions,
                        const at::Tensor& slot_mapping,
                        const at::Tensor& cos_sin_cache, at::Tensor& key_cache,
                        at::Tensor& value_cache, at::Tensor& q_out,
                        const std::optional<at::Tensor>& q_scale,
                        const std::optional<at::Tensor>& q_norm_weight,
                        const std::optional<at::Tensor>& k_norm_weight,
                        const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale, double eps,
                        int64_t norm_policy, bool is_neox);

// Split-KV decode plan into `plan` (int32, decode::PlanLayout): the host
// planner for CPU lengths, the GPU planner for CUDA lengths.
void plan_decode(const at::Tensor& kv_lens, at::Tensor& plan,
                 int64_t num_kv_heads, int64_t query_tokens, int64_t window,
                 int64_t num_ctas, int64_t max_units, int64_t min_split_tiles,
                 int64_t mode, int64_t split_tiles);

// Split-KV paged decode attention (decode kernel + combine) following a plan
// written by plan_decode.
void decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                      const at::Tensor& value_cache,
                      const at::Tensor& block_table, const at::Tensor& kv_lens,
                      const at::Tensor& plan, at::Tensor& out,
                      at::Tensor& partial_out, at::Tensor& partial_lse,
                      at::Tensor& piece_counters,
                      const std::optional<at::Tensor>& q_scale,
                      const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale, double scale,
                      double softcap, int64_t window, int64_t query_tokens,
                      int64_t max_units, int64_t num_ctas);

// Persistent decode CTAs per SM for a head size and KV element size.
int64_t decode_ctas_per_sm(int64_t head_size, int64_t kv_elem_bytes);

}  // namespace hpc
