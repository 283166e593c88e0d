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

// Split-KV decode plan into `plan` (int32, decode::PlanLayout) for KV
// lengths on the host.
void plan_decode(const at::Tensor& kv_lens, at::Tensor& plan,
                 int64_t num_kv_heads, int64_t query_tokens, int64_t num_ctas,
                 int64_t max_units, int64_t min_split_tiles,
                 int64_t fixed_split_tiles);

}  // namespace hpc
