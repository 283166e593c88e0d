// Torch-facing entry points of _hpc_C, on torch's stable C ABI. Each adapter
// converts tensors into the kernel's plain params struct and checks (with
// STD_TORCH_CHECK) the invariants the kernels rely on; the argument checks a
// caller may run are vllm/_hpc_ops_validation.py's.
#pragma once

#include <torch/csrc/stable/tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace hpc {

using torch::stable::Tensor;

void rope_norm_store_kv(const Tensor& qkv, const Tensor& positions,
                        const Tensor& slot_mapping, const Tensor& cos_sin_cache,
                        Tensor& key_cache, Tensor& value_cache, Tensor& q_out,
                        const std::optional<Tensor>& q_scale,
                        const std::optional<Tensor>& q_norm_weight,
                        const std::optional<Tensor>& k_norm_weight,
                        const std::optional<Tensor>& k_scale,
                        const std::optional<Tensor>& v_scale, double eps,
                        int64_t norm_policy, bool is_neox);

// Split-KV decode plan into `plan` (int32, decode::PlanLayout): the host
// planner for CPU lengths, the GPU planner for CUDA lengths.
void plan_decode(const Tensor& kv_lens, Tensor& plan, int64_t num_kv_heads,
                 int64_t query_tokens, int64_t window, int64_t num_ctas,
                 int64_t max_units, int64_t min_split_tiles, int64_t mode,
                 int64_t split_tiles, int64_t group, int64_t kv_elem_bytes);

// Split-KV paged decode attention following a plan written by plan_decode
// (pieces of a split sequence are merged by the CTA that finishes last);
// the sliding window is the plan's.
void decode_attention(const Tensor& q, const Tensor& key_cache,
                      const Tensor& value_cache, const Tensor& block_table,
                      const Tensor& kv_lens, const Tensor& plan, Tensor& out,
                      Tensor& partial_out, Tensor& partial_lse,
                      Tensor& piece_counters,
                      const std::optional<Tensor>& q_scale,
                      const std::optional<Tensor>& k_scale,
                      const std::optional<Tensor>& v_scale, double scale,
                      double softcap, int64_t query_tokens, int64_t max_units,
                      int64_t num_ctas);

// The offsets of decode::PlanLayout's arrays and the plan's size, in int32
// elements (cta_first_item: max_ctas descriptors of decode::kItemWords
// words); decode_plan_layout_fields names them, in order.
std::vector<int64_t> decode_plan_layout(int64_t max_units, int64_t max_ctas);
std::vector<std::string> decode_plan_layout_fields();

// The plan CTA slots and partial rows of a decode workspace (decode::
// workspace_sizes): what every step of up to max_batch sequences over a
// cache of max_kv_tokens tokens needs in the given split mode;
// decode_workspace_sizes_fields names them, in order.
std::vector<int64_t> decode_workspace_sizes(int64_t mode, int64_t max_batch,
                                            int64_t num_kv_heads,
                                            int64_t max_kv_tokens,
                                            int64_t ctas_offered,
                                            int64_t split_tiles);
std::vector<std::string> decode_workspace_sizes_fields();

// Names of the decode plan's header words and of a CTA's first-item
// descriptor words, in order (decode::PlanHeader, decode::CtaItemField).
std::vector<std::string> decode_plan_header_fields();
std::vector<std::string> decode_plan_item_fields();

// Persistent decode CTAs per SM for a head size and KV element size (one
// for every supported pair; both are still checked).
int64_t decode_ctas_per_sm(int64_t head_size, int64_t kv_elem_bytes);

// Paged prefill tile plan into `plan` (int32, prefill::PlanLayout for
// max_batch / max_tiles): the host planner for CPU lengths, the GPU planner
// for CUDA lengths.
void plan_prefill(const Tensor& query_start_loc, const Tensor& seq_lens,
                  Tensor& plan, int64_t num_q_heads, int64_t num_kv_heads,
                  int64_t max_batch, int64_t max_tiles);

// A prefill plan for up to max_tokens query tokens in up to max_batch
// requests (prefill::PlanLayout): the tile capacity, the offsets of the two
// arrays and the size, in int32 elements; prefill_plan_layout_fields names
// them, in order.
std::vector<int64_t> prefill_plan_layout(int64_t max_tokens, int64_t max_batch,
                                         int64_t num_q_heads,
                                         int64_t num_kv_heads);
std::vector<std::string> prefill_plan_layout_fields();

// The names of a prefill plan's header fields (prefill::PlanHeader), in
// order from offset 0.
std::vector<std::string> prefill_plan_header_fields();

// Paged prefill / chunked-prefill attention over a varlen batch, following
// a plan written by plan_prefill for the same lengths.
void prefill_attention(const Tensor& q, const Tensor& key_cache,
                       const Tensor& value_cache, const Tensor& block_table,
                       const Tensor& query_start_loc, const Tensor& seq_lens,
                       const Tensor& plan, Tensor& out,
                       const std::optional<Tensor>& q_scale,
                       const std::optional<Tensor>& k_scale,
                       const std::optional<Tensor>& v_scale, double scale,
                       double softcap, int64_t window);

// Fused FP8 MoE (route, gate-up GEMM + SiLU-and-mul + quant, down GEMM,
// top-k reduce) into `out`, using `workspace` (moe_workspace_bytes).
void fused_moe_fp8(const Tensor& hidden_states,
                   const std::optional<Tensor>& a1_scale, const Tensor& w13,
                   const Tensor& w13_scale, const Tensor& w2,
                   const Tensor& w2_scale,
                   const std::optional<Tensor>& a2_scale,
                   const Tensor& topk_weights, const Tensor& topk_ids,
                   const std::optional<Tensor>& expert_map,
                   const std::optional<Tensor>& shared_output, Tensor& out,
                   Tensor& workspace, int64_t expert_offset,
                   int64_t global_num_experts, bool block_wise,
                   bool apply_router_weight_on_input);

// The MoE pipeline's tiling for a call (moe/moe_tiling.h): token_tile,
// max_tiles, gate_up_blocks, gate_up_split, down_blocks, down_group, decode,
// slot_tiles.
std::vector<int64_t> moe_tiling(int64_t num_tokens, int64_t topk,
                                int64_t num_local_experts, int64_t num_experts,
                                int64_t hidden_size, int64_t intermediate_size,
                                int64_t num_sms, bool block_wise);

// The names of moe_tiling's values, in order.
std::vector<std::string> moe_tiling_fields();

// Workspace bytes of fused_moe_fp8 for up to `max_tokens` tokens.
int64_t moe_workspace_bytes(int64_t max_tokens, int64_t topk,
                            int64_t num_local_experts, int64_t hidden_size,
                            int64_t intermediate_size);

// What the kernels accept (kernel_limits.h), by name: "name=v1,v2,...".
std::vector<std::string> kernel_limits();

}  // namespace hpc
