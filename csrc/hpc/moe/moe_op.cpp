// Stable-ABI adapter of the fused FP8 MoE pipeline. The argument checks a
// caller may run are vllm/_hpc_ops_validation.py's (the hot path skips them);
// the checks here guard the kernels' invariants.
#include <compare>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/device_info.h"
#include "common/field_names.h"
#include "common/stable_tensor.h"
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
moe::ScaleView weight_scale(const Tensor& scale, const char* name,
                            bool block_wise) {
  STD_TORCH_CHECK(scale.scalar_type() == Dtype::Float && scale.is_contiguous(),
                  kOp, ": ", name, " must be contiguous float32");
  if (!block_wise) return {scale.const_data_ptr<float>(), 1, 0, 0};
  STD_TORCH_CHECK(scale.dim() == 3, kOp, ": block-wise ", name,
                  " must have 3 dims");
  return {scale.const_data_ptr<float>(), scale.stride(0), scale.stride(1),
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
std::vector<NamedValue> tiling_fields(const moe::MoeTiling& t) {
  return {{"token_tile", t.token_tile},
          {"max_tiles", t.max_tiles},
          {"gate_up_rows", t.gate_up_rows},
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

// What a call's tiling depends on.
struct TilingShape {
  int num_tokens, topk, num_local_experts, num_experts, hidden, inter, num_sms;
  bool block_wise;
  auto operator<=>(const TilingShape&) const = default;
};

// The tiling of a call shape, computed and checked on the shape's first
// call: the MoE layers of a step share their token count, so the layers
// after the first look it up.
moe::MoeTiling tiling_for(const TilingShape& s) {
  static std::mutex mutex;
  static std::map<TilingShape, moe::MoeTiling> tilings;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = tilings.find(s);
  if (found != tilings.end()) return found->second;
  const moe::MoeTiling t =
      moe::moe_tiling(s.num_tokens, s.topk, s.num_local_experts, s.num_experts,
                      s.hidden, s.inter, s.num_sms, s.block_wise);
  const char* error = moe::tiling_error(t, s.num_tokens, s.topk, s.block_wise);
  STD_TORCH_CHECK(error == nullptr, kOp, ": ", error);
  return tilings.emplace(s, t).first->second;
}

}  // namespace

std::vector<int64_t> moe_tiling(int64_t num_tokens, int64_t topk,
                                int64_t num_local_experts, int64_t num_experts,
                                int64_t hidden_size, int64_t intermediate_size,
                                int64_t num_sms, bool block_wise) {
  return values_of(tiling_fields(tiling_for(
      {static_cast<int>(num_tokens), static_cast<int>(topk),
       static_cast<int>(num_local_experts), static_cast<int>(num_experts),
       static_cast<int>(hidden_size), static_cast<int>(intermediate_size),
       static_cast<int>(num_sms), block_wise})));
}

std::vector<std::string> moe_tiling_fields() {
  return names_of(tiling_fields(moe::MoeTiling{}));
}

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
                   bool apply_router_weight_on_input) {
  STD_TORCH_CHECK(
      hidden_states.is_cuda() && hidden_states.dim() == 2 &&
          hidden_states.stride(1) == 1,
      kOp,
      ": hidden_states must be a 2-dim CUDA tensor, contiguous in its "
      "last dim");
  STD_TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous() && w13.dim() == 3 &&
                      w2.dim() == 3,
                  kOp, ": w13 and w2 must be contiguous with 3 dims");
  STD_TORCH_CHECK(w13.scalar_type() == Dtype::Float8_e4m3fn &&
                      w2.scalar_type() == Dtype::Float8_e4m3fn,
                  kOp, ": w13 and w2 must be float8_e4m3fn");
  STD_TORCH_CHECK(topk_weights.scalar_type() == Dtype::Float &&
                      topk_weights.is_contiguous(),
                  kOp, ": topk_weights must be contiguous float32");
  STD_TORCH_CHECK(topk_ids.is_contiguous(), kOp,
                  ": topk_ids must be contiguous");
  STD_TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1, kOp,
                  ": out must have 2 dims, contiguous in its last dim");
  STD_TORCH_CHECK(
      workspace.is_contiguous() && workspace.scalar_type() == Dtype::Byte, kOp,
      ": workspace must be contiguous uint8");

  const DeviceGuard device_guard(hidden_states.get_device_index());
  moe::MoeParams p{};
  p.num_tokens = static_cast<int>(hidden_states.size(0));
  p.topk = static_cast<int>(topk_ids.size(1));
  p.num_experts = static_cast<int>(w13.size(0));
  p.hidden = static_cast<int>(w13.size(2));
  p.inter = static_cast<int>(w2.size(2));
  STD_TORCH_CHECK(w13.size(1) == 2 * p.inter && w2.size(1) == p.hidden, kOp,
                  ": w13 must be [E, 2I, H] and w2 [E, H, I]");
  p.block_wise = block_wise;

  p.input = hidden_states.const_data_ptr();
  p.input_stride = hidden_states.stride(0);
  p.input_type = elem_type_of(hidden_states, kOp);
  if (a1_scale.has_value()) {
    STD_TORCH_CHECK(a1_scale->scalar_type() == Dtype::Float, kOp,
                    ": a1_scale must be float32");
    p.a1_scale = a1_scale->const_data_ptr<float>();
    p.a1_scale_stride = a1_scale->dim() == 2 ? a1_scale->stride(0) : 0;
  }
  STD_TORCH_CHECK(p.input_type != ElemType::kFp8E4m3 || p.a1_scale != nullptr,
                  kOp, ": FP8 hidden_states need a1_scale");
  p.w13 = static_cast<const uint8_t*>(w13.const_data_ptr());
  p.w13_scale = weight_scale(w13_scale, "w13_scale", block_wise);
  p.w2 = static_cast<const uint8_t*>(w2.const_data_ptr());
  p.w2_scale = weight_scale(w2_scale, "w2_scale", block_wise);
  if (a2_scale.has_value()) p.a2_scale = a2_scale->const_data_ptr<float>();
  STD_TORCH_CHECK(block_wise || p.a2_scale != nullptr, kOp,
                  ": per-tensor weights need a2_scale");

  p.topk_weights = topk_weights.const_data_ptr<float>();
  p.topk_ids = topk_ids.const_data_ptr();
  p.topk_ids_int64 = topk_ids.scalar_type() == Dtype::Long;
  if (expert_map.has_value()) {
    STD_TORCH_CHECK(expert_map->scalar_type() == Dtype::Int, kOp,
                    ": expert_map must be int32");
    p.expert_map = expert_map->const_data_ptr<int32_t>();
  }
  p.expert_offset = static_cast<int>(expert_offset);
  p.router_weight_on_input = apply_router_weight_on_input;
  if (shared_output.has_value()) {
    STD_TORCH_CHECK(shared_output->scalar_type() == out.scalar_type() &&
                        shared_output->stride(1) == 1,
                    kOp,
                    ": shared_output must have out's dtype, contiguous in its "
                    "last dim");
    p.shared_output = shared_output->const_data_ptr();
    p.shared_stride = shared_output->stride(0);
  }
  p.out = out.mutable_data_ptr();
  p.out_stride = out.stride(0);
  p.out_type = elem_type_of(out, kOp);
  STD_TORCH_CHECK(p.out_type != ElemType::kFp8E4m3, kOp,
                  ": out must be bfloat16 or float16");

  p.tiling =
      tiling_for({p.num_tokens, p.topk, p.num_experts,
                  static_cast<int>(global_num_experts), p.hidden, p.inter,
                  current_device_info().sm_count, p.block_wise});
  // Offsets for this call's token count fit in a workspace sized for more.
  p.layout = layout_for(p.num_tokens, p.topk, p.num_experts, p.hidden, p.inter);
  STD_TORCH_CHECK(workspace.numel() >= p.layout.bytes(), kOp,
                  ": workspace is smaller than moe_workspace_bytes for this "
                  "call");
  p.workspace = workspace.mutable_data_ptr<uint8_t>();
  moe::fused_moe_fp8(p, current_stream(hidden_states));
}

}  // namespace hpc
