// Stable-ABI adapter of split-KV decode attention. The argument checks a
// caller may run are vllm/_hpc_ops_validation.py's (the hot path skips them);
// the checks here guard the kernels' invariants.
#include "attention/decode/decode.h"
#include "common/stable_tensor.h"
#include "kernel_limits_text.h"
#include "ops.h"

namespace hpc {

namespace {

constexpr const char* kOp = "decode_attention";

}  // namespace

void decode_attention(const Tensor& q, const Tensor& key_cache,
                      const Tensor& value_cache, const Tensor& block_table,
                      const Tensor& kv_lens, const Tensor& plan, Tensor& out,
                      Tensor& partial_out, Tensor& partial_lse,
                      Tensor& piece_counters,
                      const std::optional<Tensor>& q_scale,
                      const std::optional<Tensor>& k_scale,
                      const std::optional<Tensor>& v_scale, double scale,
                      double softcap, int64_t query_tokens, int64_t max_units,
                      int64_t num_ctas) {
  STD_TORCH_CHECK(q.is_cuda() && q.dim() == 3 && q.stride(2) == 1, kOp,
                  ": q must be a 3-dim CUDA tensor, contiguous in its last "
                  "dim");
  STD_TORCH_CHECK(
      out.dim() == 3 && out.stride(2) == 1 && out.sizes() == q.sizes(), kOp,
      ": out must have q's shape, contiguous in its last dim");
  STD_TORCH_CHECK(key_cache.sizes() == value_cache.sizes() &&
                      key_cache.scalar_type() == value_cache.scalar_type(),
                  kOp,
                  ": key_cache and value_cache must have one shape and dtype");
  STD_TORCH_CHECK(
      block_table.scalar_type() == Dtype::Int && block_table.stride(1) == 1,
      kOp, ": block_table must be int32, contiguous in its last dim");
  STD_TORCH_CHECK(
      kv_lens.scalar_type() == Dtype::Int && kv_lens.is_contiguous(), kOp,
      ": kv_lens must be contiguous int32");
  STD_TORCH_CHECK(plan.scalar_type() == Dtype::Int, kOp,
                  ": plan must be int32");
  STD_TORCH_CHECK(partial_out.is_contiguous() && partial_lse.is_contiguous(),
                  kOp, ": partial_out and partial_lse must be contiguous");

  const DeviceGuard device_guard(q.get_device_index());
  const int batch = static_cast<int>(kv_lens.numel());
  const int num_kv_heads = static_cast<int>(key_cache.size(2));
  const int head_dim = static_cast<int>(key_cache.size(3));
  decode::DecodeParams p{};
  p.q = q.const_data_ptr();
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.q_type = elem_type_of(q, kOp);
  if (p.q_type == decode::ElemType::kFp8E4m3) {
    STD_TORCH_CHECK(q_scale.has_value() && q_scale->stride(1) == 1, kOp,
                    ": an FP8 q needs q_scale, contiguous in its last dim");
    p.q_scale = q_scale->const_data_ptr<float>();
    p.q_scale_token_stride = q_scale->stride(0);
  }
  p.out = out.mutable_data_ptr();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.out_type = elem_type_of(out, kOp);
  STD_TORCH_CHECK(p.out_type != decode::ElemType::kFp8E4m3, kOp,
                  ": out must be bfloat16 or float16");
  p.block_table = block_table.const_data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.kv_lens = kv_lens.const_data_ptr<int32_t>();
  p.block_size = static_cast<int>(key_cache.size(1));
  STD_TORCH_CHECK(limits::is_block_size(p.block_size), kOp,
                  ": the cache's block size must be one of ",
                  limits::joined(limits::kBlockSizes), ", got ", p.block_size);
  p.plan = plan.const_data_ptr<int32_t>();
  p.layout = {static_cast<int>(max_units), static_cast<int>(num_ctas)};
  STD_TORCH_CHECK(
      plan.numel() >= p.layout.size(), kOp,
      ": plan is smaller than its layout for max_units and num_ctas");
  p.partial_out = partial_out.mutable_data_ptr<float>();
  p.partial_lse = partial_lse.mutable_data_ptr<float>();
  STD_TORCH_CHECK(
      piece_counters.scalar_type() == Dtype::Int &&
          piece_counters.numel() >= max_units,
      kOp, ": piece_counters must be int32 with at least max_units entries");
  p.piece_counters = piece_counters.mutable_data_ptr<int32_t>();
  p.batch = batch;
  p.num_kv_heads = num_kv_heads;
  p.group = static_cast<int>(q.size(1)) / num_kv_heads;
  STD_TORCH_CHECK(
      query_tokens >= 1 && query_tokens <= limits::kMaxDecodeQueryTokens, kOp,
      ": query_tokens must be in 1..", limits::kMaxDecodeQueryTokens, ", got ",
      query_tokens);
  p.query_tokens = static_cast<int>(query_tokens);
  p.rows = p.group * p.query_tokens;
  STD_TORCH_CHECK(p.rows <= limits::kMaxDecodeRows, kOp,
                  ": query_tokens x the GQA ratio must be at most ",
                  limits::kMaxDecodeRows, ", got ", p.rows);
  STD_TORCH_CHECK(q.size(0) == batch * query_tokens, kOp,
                  ": q must have query_tokens rows per kv_lens entry");
  // The workspace sizes both for its largest row count; a step with fewer
  // query tokens uses a prefix.
  STD_TORCH_CHECK(
      partial_out.numel() == partial_lse.numel() * head_dim,
      "decode_attention: partial_out must hold head_size floats per "
      "partial_lse entry");
  p.scale = static_cast<float>(scale);
  p.k_scale = optional_scale(k_scale, q.device(), kOp, "k_scale");
  p.v_scale = optional_scale(v_scale, q.device(), kOp, "v_scale");
  p.softcap = static_cast<float>(softcap);
  if (batch == 0) return;

  decode::decode_attention(p, head_dim, elem_type_of(key_cache, kOp),
                           cache_view(key_cache, kOp),
                           cache_view(value_cache, kOp),
                           static_cast<int>(num_ctas), current_stream(q));
}

int64_t decode_ctas_per_sm(int64_t head_size, int64_t kv_elem_bytes) {
  STD_TORCH_CHECK(kv_elem_bytes == 1 || kv_elem_bytes == 2,
                  "decode_ctas_per_sm: kv_elem_bytes must be 1 or 2");
  return decode::decode_ctas_per_sm(static_cast<int>(head_size));
}

}  // namespace hpc
