// Operator schemas of the _hpc_C library, registered through torch's stable C
// ABI so that one build loads on every torch from the targeted version on.
// Mutated arguments are marked `Tensor(x!)` so functionalization and
// torch.compile know what each op writes. The Python module stub exists only
// so the shared object can be imported as a limited-API extension; the ops
// are reached through torch.ops._hpc_C.
#include <Python.h>
#include <torch/csrc/stable/library.h>

#include "ops.h"

STABLE_TORCH_LIBRARY(_hpc_C, m) {
  m.def(
      "rope_norm_store_kv(Tensor qkv, Tensor positions, Tensor slot_mapping, "
      "Tensor cos_sin_cache, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor(c!) q_out, Tensor(d!)? q_scale, Tensor? q_norm_weight, "
      "Tensor? k_norm_weight, Tensor? k_scale, Tensor? v_scale, float eps, "
      "int norm_policy, bool is_neox) -> ()");
  m.def(
      "plan_decode(Tensor kv_lens, Tensor(a!) plan, int num_kv_heads, "
      "int query_tokens, int window, int num_ctas, int max_units, "
      "int min_split_tiles, int mode, int split_tiles, int group, "
      "int kv_elem_bytes) -> ()");
  m.def(
      "decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, "
      "Tensor block_table, Tensor kv_lens, Tensor plan, Tensor(a!) out, "
      "Tensor(b!) partial_out, Tensor(c!) partial_lse, "
      "Tensor(d!) piece_counters, Tensor? q_scale, "
      "Tensor? k_scale, Tensor? v_scale, float scale, float softcap, "
      "int query_tokens, int max_units, int num_ctas) -> ()");
  m.def("decode_plan_layout(int max_units, int max_ctas) -> int[]");
  m.def("decode_plan_layout_fields() -> str[]");
  m.def("decode_plan_header_fields() -> str[]");
  m.def("decode_plan_item_fields() -> str[]");
  m.def(
      "decode_workspace_sizes(int mode, int max_batch, int num_kv_heads, "
      "int max_kv_tokens, int ctas_offered, int split_tiles) -> int[]");
  m.def("decode_workspace_sizes_fields() -> str[]");
  m.def("decode_ctas_per_sm(int head_size, int kv_elem_bytes) -> int");
  m.def(
      "plan_prefill(Tensor query_start_loc, Tensor seq_lens, Tensor(a!) plan, "
      "int num_q_heads, int num_kv_heads, int max_batch, int max_tiles) -> ()");
  m.def(
      "prefill_plan_layout(int max_tokens, int max_batch, int num_q_heads, "
      "int num_kv_heads) -> int[]");
  m.def("prefill_plan_layout_fields() -> str[]");
  m.def("prefill_plan_header_fields() -> str[]");
  m.def(
      "prefill_attention(Tensor q, Tensor key_cache, Tensor value_cache, "
      "Tensor block_table, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor plan, Tensor(a!) out, Tensor? q_scale, Tensor? k_scale, "
      "Tensor? v_scale, float scale, float softcap, int window) -> ()");
  m.def(
      "fused_moe_fp8(Tensor hidden_states, Tensor? a1_scale, Tensor w13, "
      "Tensor w13_scale, Tensor w2, Tensor w2_scale, Tensor? a2_scale, "
      "Tensor topk_weights, Tensor topk_ids, Tensor? expert_map, "
      "Tensor? shared_output, Tensor(a!) out, Tensor(b!) workspace, "
      "int expert_offset, int global_num_experts, bool block_wise, "
      "bool apply_router_weight_on_input) -> ()");
  m.def(
      "moe_tiling(int num_tokens, int topk, int num_local_experts, "
      "int num_experts, int hidden_size, int intermediate_size, int num_sms, "
      "bool block_wise=False) -> int[]");
  m.def("moe_tiling_fields() -> str[]");
  m.def(
      "moe_workspace_bytes(int max_tokens, int topk, int num_local_experts, "
      "int hidden_size, int intermediate_size) -> int");
  m.def("kernel_limits() -> str[]");
}

STABLE_TORCH_LIBRARY_IMPL(_hpc_C, CUDA, m) {
  m.impl("rope_norm_store_kv", TORCH_BOX(&hpc::rope_norm_store_kv));
  m.impl("plan_decode", TORCH_BOX(&hpc::plan_decode));
  m.impl("decode_attention", TORCH_BOX(&hpc::decode_attention));
  m.impl("plan_prefill", TORCH_BOX(&hpc::plan_prefill));
  m.impl("prefill_attention", TORCH_BOX(&hpc::prefill_attention));
  m.impl("fused_moe_fp8", TORCH_BOX(&hpc::fused_moe_fp8));
}

STABLE_TORCH_LIBRARY_IMPL(_hpc_C, CPU, m) {
  m.impl("plan_decode", TORCH_BOX(&hpc::plan_decode));
  m.impl("plan_prefill", TORCH_BOX(&hpc::plan_prefill));
}

// The ops without tensor arguments have no device to dispatch on;
// CompositeExplicitAutograd serves them for every backend.
STABLE_TORCH_LIBRARY_IMPL(_hpc_C, CompositeExplicitAutograd, m) {
  m.impl("decode_plan_layout", TORCH_BOX(&hpc::decode_plan_layout));
  m.impl("decode_plan_layout_fields",
         TORCH_BOX(&hpc::decode_plan_layout_fields));
  m.impl("decode_plan_header_fields",
         TORCH_BOX(&hpc::decode_plan_header_fields));
  m.impl("decode_plan_item_fields", TORCH_BOX(&hpc::decode_plan_item_fields));
  m.impl("decode_workspace_sizes", TORCH_BOX(&hpc::decode_workspace_sizes));
  m.impl("decode_workspace_sizes_fields",
         TORCH_BOX(&hpc::decode_workspace_sizes_fields));
  m.impl("decode_ctas_per_sm", TORCH_BOX(&hpc::decode_ctas_per_sm));
  m.impl("prefill_plan_layout", TORCH_BOX(&hpc::prefill_plan_layout));
  m.impl("prefill_plan_layout_fields",
         TORCH_BOX(&hpc::prefill_plan_layout_fields));
  m.impl("prefill_plan_header_fields",
         TORCH_BOX(&hpc::prefill_plan_header_fields));
  m.impl("moe_tiling", TORCH_BOX(&hpc::moe_tiling));
  m.impl("moe_tiling_fields", TORCH_BOX(&hpc::moe_tiling_fields));
  m.impl("moe_workspace_bytes", TORCH_BOX(&hpc::moe_workspace_bytes));
  m.impl("kernel_limits", TORCH_BOX(&hpc::kernel_limits));
}

PyMODINIT_FUNC PyInit__hpc_C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hpc_C", nullptr, 0,
                               nullptr};
  return PyModule_Create(&module);
}
