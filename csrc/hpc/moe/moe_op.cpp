// at::Tensor adapter of the fused FP8 MoE pipeline. Inputs were validated by
// vllm/_hpc_ops.py; the checks here guard the kernels' invariants.
#include <ATen/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <string>
#include <utility>
#include <vector>

#include "common/device_info.h"
#include "common/tensor_elem_type.h"
#include "moe/moe.h"
#include "moe/moe_tiling.h"
#include "ops.h"

namespace hpc {

namespace {

constexpr const char* kOp = "fused_moe_fp8";

moe::MoeWorkspaceLayout layout_for(int64_t tokens, int64_t topk,
                                   int64_t experts, int64_t hidden,
                                   int64_t inter) {
  return {tokens, static_cast<int>(topk), static_cast<int>(experts),
          static_cast<int>(hidden), static_cast<int>(inter)};
}

// Per-tensor [E] scales broadcast over blocks; block-wise [E, N/128, K/128].
moe::ScaleView weight_scale(const at::Tensor& scale, bool block_wise) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous());
  if (!block_wise) return {scale.data_ptr<float>(), 1, 0, 0};
  TORCH_CHECK(scale.dim() == 3);
  return {scale.data_ptr<float>(), scale.stride(0), scale.stride(1),
          scale.stride(2)};
}

}  // namespace

int64_t moe_workspace_bytes(int64_t max_tokens, int64_t topk,
                            int64_t num_local_experts, int64_t hidden_size,
                            int64_t intermediate_size) {
  return layout_for(max_tokens, topk, num_local_experts, hidden_size,
                    intermediate_size)
      .bytes();
}

namespace {

// The tiling's fields by name, written once: moe_tiling returns the values
// and moe_tiling_fields the names, in this order.
std::vector<std::pair<const char*, int64_t>> tiling_fields(
    const moe::MoeTiling& t) {
  return {{"token_tile", t.token_tile},
          {"max_tiles", t.max_tiles},
          {"gate_up_blocks", t.gate_up_blocks},
          {"gate_up_split", t.gate_up_split},
          {"gate_up_group", t.gate_up_group},
          {"gate_up_ctas_per_sm", t.gate_up_ctas_per_sm},
          {"down_blocks", t.down_blocks},
          {"down_group", t.down_group},
          {"down_ctas_per_sm", t.down_ctas_per_sm},
          {"decode", t.decode},
          {"slot_tiles", t.slot_tiles},
          {"evict_first_weights", t.evict_first_weights}};
}

}  // namespace

std::vector<int64_t> moe_tiling(int64_t num_tokens, int64_t topk,
                                int64_t num_local_experts, int64_t num_experts,
                                int64_t hidden_size, int64_t intermediate_size,
                                int64_t num_sms, bool block_wise) {
  const moe::MoeTiling t = moe::moe_tiling(
      static_cast<int>(num_tokens), static_cast<int>(topk),
      static_cast<int>(num_local_experts), static_cast<int>(num_experts),
      static_cast<int>(hidden_size), static_cast<int>(intermediate_size),
      static_cast<int>(num_sms), block_wise);
  std::vector<int64_t> values;
  for (const auto& field : tiling_fields(t)) values.push_back(field.second);
  return values;
}

std::vector<std::string> moe_tiling_fields() {
  std::vector<std::string> names;
  for (const auto& field : tiling_fields(moe::MoeTiling{})) {
    names.emplace_back(field.first);
  }
  return names;
}

void fused_moe_fp8(const at::Tensor& hidden_states,
                   const std::optional<at::Tensor>& a1_scale,
                   const at::Tensor& w13, const at::Tensor& w13_scale,
                   const at::Tensor& w2, const at::Tensor& w2_scale,
                   const std::optional<at::Tensor>& a2_scale,
                   const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                   const std::optional<at::Tensor>& expert_map,
                   const std::optional<at::Tensor>& shared_output,
                   at::Tensor& out, at::Tensor& workspace,
                   int64_t expert_offset, int64_t global_num_experts,
                   bool block_wise, bool apply_router_weight_on_input) {
  TORCH_CHECK(hidden_states.is_cuda() && hidden_states.dim() == 2 &&
              hidden_states.stride(1) == 1);
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous() && w13.dim() == 3 &&
              w2.dim() == 3);
  TORCH_CHECK(w13.scalar_type() == at::kFloat8_e4m3fn &&
              w2.scalar_type() == at::kFloat8_e4m3fn);
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat &&
              topk_weights.is_contiguous() && topk_ids.is_contiguous());
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1);
  TORCH_CHECK(workspace.is_contiguous() &&
              workspace.scalar_type() == at::kByte);

  const at::cuda::CUDAGuard device_guard(hidden_states.device());
  moe::MoeParams p{};
  p.num_tokens = static_cast<int>(hidden_states.size(0));
  p.topk = static_cast<int>(topk_ids.size(1));
  p.num_experts = static_cast<int>(w13.size(0));
  p.hidden = static_cast<int>(w13.size(2));
  p.inter = static_cast<int>(w2.size(2));
  TORCH_CHECK(w13.size(1) == 2 * p.inter && w2.size(1) == p.hidden);
  p.block_wise = block_wise;

  p.input = hidden_states.data_ptr();
  p.input_stride = hidden_states.stride(0);
  p.input_type = elem_type_of(hidden_states, kOp);
  if (a1_scale.has_value()) {
    TORCH_CHECK(a1_scale->scalar_type() == at::kFloat);
    p.a1_scale = a1_scale->data_ptr<float>();
    p.a1_scale_stride = a1_scale->dim() == 2 ? a1_scale->stride(0) : 0;
  }
  TORCH_CHECK(p.input_type != ElemType::kFp8E4m3 || p.a1_scale != nullptr);
  p.w13 = static_cast<const uint8_t*>(w13.data_ptr());
  p.w13_scale = weight_scale(w13_scale, block_wise);
  p.w2 = static_cast<const uint8_t*>(w2.data_ptr());
  p.w2_scale = weight_scale(w2_scale, block_wise);
  if (a2_scale.has_value()) p.a2_scale = a2_scale->data_ptr<float>();
  TORCH_CHECK(block_wise || p.a2_scale != nullptr);

  p.topk_weights = topk_weights.data_ptr<float>();
  p.topk_ids = topk_ids.data_ptr();
  p.topk_ids_int64 = topk_ids.scalar_type() == at::kLong;
  if (expert_map.has_value()) {
    TORCH_CHECK(expert_map->scalar_type() == at::kInt);
    p.expert_map = expert_map->data_ptr<int32_t>();
  }
  p.expert_offset = static_cast<int>(expert_offset);
  p.router_weight_on_input = apply_router_weight_on_input;
  if (shared_output.has_value()) {
    TORCH_CHECK(shared_output->scalar_type() == out.scalar_type() &&
                shared_output->stride(1) == 1);
    p.shared_output = shared_output->data_ptr();
    p.shared_stride = shared_output->stride(0);
  }
  p.out = out.data_ptr();
  p.out_stride = out.stride(0);
  p.out_type = elem_type_of(out, kOp);
  TORCH_CHECK(p.out_type != ElemType::kFp8E4m3);

  p.tiling = moe::moe_tiling(
      p.num_tokens, p.topk, p.num_experts, static_cast<int>(global_num_experts),
      p.hidden, p.inter, current_device_info().sm_count, p.block_wise);
  // Offsets for this call's token count fit in a workspace sized for more.
  p.layout = layout_for(p.num_tokens, p.topk, p.num_experts, p.hidden, p.inter);
  TORCH_CHECK(workspace.numel() >= p.layout.bytes());
  p.workspace = static_cast<uint8_t*>(workspace.data_ptr());
  moe::fused_moe_fp8(p, at::cuda::getCurrentCUDAStream());
}

}  // namespace hpc
