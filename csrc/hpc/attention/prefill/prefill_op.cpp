// Stable-ABI adapter of paged prefill attention. The argument checks a
// caller may run are vllm/_hpc_ops_validation.py's (the hot path skips them);
// the checks here guard the kernel's memory accesses.
#include "attention/prefill/prefill.h"
#include "common/stable_tensor.h"
#include "kernel_limits_text.h"
#include "ops.h"

namespace hpc {

namespace {

constexpr const char* kOp = "prefill_attention";

}  // namespace

void prefill_attention(const Tensor& q, const Tensor& key_cache,
                       const Tensor& value_cache, const Tensor& block_table,
                       const Tensor& query_start_loc, const Tensor& seq_lens,
                       const Tensor& plan, Tensor& out,
                       const std::optional<Tensor>& q_scale,
                       const std::optional<Tensor>& k_scale,
                       const std::optional<Tensor>& v_scale, double scale,
                       double softcap, int64_t window) {
  STD_TORCH_CHECK(q.is_cuda() && q.dim() == 3 && q.stride(2) == 1, kOp,
                  ": q must be a 3-dim CUDA tensor, contiguous in its last "
                  "dim");
  const torch::stable::Device device = q.device();
  STD_TORCH_CHECK(out.device() == device && out.dim() == 3 &&
                      out.stride(2) == 1 && out.sizes() == q.sizes(),
                  kOp,
                  ": out must have q's device and shape, contiguous in its "
                  "last dim");
  STD_TORCH_CHECK(key_cache.device() == device &&
                      value_cache.device() == device &&
                      key_cache.sizes() == value_cache.sizes() &&
                      key_cache.scalar_type() == value_cache.scalar_type(),
                  kOp,
                  ": key_cache and value_cache must have q's device and one "
                  "shape and dtype");
  STD_TORCH_CHECK(block_table.device() == device && block_table.dim() == 2 &&
                      block_table.scalar_type() == Dtype::Int &&
                      block_table.stride(1) == 1,
                  kOp,
                  ": block_table must be a 2-dim int32 tensor on q's device, "
                  "contiguous in its last dim");
  STD_TORCH_CHECK(seq_lens.device() == device &&
                      seq_lens.scalar_type() == Dtype::Int &&
                      seq_lens.is_contiguous(),
                  kOp, ": seq_lens must be contiguous int32 on q's device");
  const int64_t batch = seq_lens.numel();
  STD_TORCH_CHECK(
      query_start_loc.device() == device &&
          query_start_loc.scalar_type() == Dtype::Int &&
          query_start_loc.is_contiguous() &&
          query_start_loc.numel() == batch + 1,
      kOp,
      ": query_start_loc must be contiguous int32 on q's device with "
      "one entry more than seq_lens");
  STD_TORCH_CHECK(block_table.size(0) >= batch, kOp,
                  ": block_table needs a row per seq_lens entry");
  STD_TORCH_CHECK(plan.device() == device && plan.scalar_type() == Dtype::Int &&
                      plan.is_contiguous() &&
                      plan.numel() >= prefill::kHeaderSize,
                  kOp,
                  ": plan must be contiguous int32 on q's device, at least "
                  "a header long");

  const PagedCacheView k_view = cache_view(key_cache, kOp);
  const PagedCacheView v_view = cache_view(value_cache, kOp);
  const int num_q_heads = static_cast<int>(q.size(1));
  const int num_kv_heads = static_cast<int>(key_cache.size(2));
  const int head_dim = static_cast<int>(key_cache.size(3));
  STD_TORCH_CHECK(q.size(2) == head_dim, kOp,
                  ": q's head size must be the caches'");
  STD_TORCH_CHECK(num_kv_heads >= 1 && num_q_heads % num_kv_heads == 0, kOp,
                  ": q's heads must be a multiple of the caches' KV heads");
  const int group = num_q_heads / num_kv_heads;
  STD_TORCH_CHECK(group >= 1 && group <= limits::kMaxGqaRatio, kOp,
                  ": the GQA ratio must be in 1..", limits::kMaxGqaRatio,
                  ", got ", group);

  const DeviceGuard device_guard(q.get_device_index());
  prefill::PrefillParams p{};
  p.q_type = elem_type_of(q, kOp);
  if (p.q_type == ElemType::kFp8E4m3) {
    STD_TORCH_CHECK(q_scale.has_value() && q_scale->device() == device &&
                        q_scale->scalar_type() == Dtype::Float &&
                        q_scale->dim() == 2 && q_scale->size(0) >= q.size(0) &&
                        q_scale->size(1) == num_q_heads &&
                        q_scale->stride(1) == 1,
                    kOp,
                    ": an FP8 q needs a float32 q_scale [tokens, heads] on "
                    "q's device, contiguous in its last dim");
    p.q_scale = q_scale->const_data_ptr<float>();
    p.q_scale_token_stride = q_scale->stride(0);
  }
  p.out = out.mutable_data_ptr();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.out_type = elem_type_of(out, kOp);
  STD_TORCH_CHECK(p.out_type != ElemType::kFp8E4m3, kOp,
                  ": out must be bfloat16 or float16");
  p.query_start_loc = query_start_loc.const_data_ptr<int32_t>();
  p.seq_lens = seq_lens.const_data_ptr<int32_t>();
  p.block_table = block_table.const_data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.block_size = static_cast<int>(key_cache.size(1));
  STD_TORCH_CHECK(limits::is_block_size(p.block_size), kOp,
                  ": the cache's block size must be one of ",
                  limits::joined(limits::kBlockSizes), ", got ", p.block_size);
  p.plan = plan.const_data_ptr<int32_t>();
  p.num_tokens = static_cast<int>(q.size(0));
  p.num_kv_heads = num_kv_heads;
  p.group = group;
  p.tile_tokens = prefill::tile_tokens_of(group);
  p.scale = static_cast<float>(scale);
  p.k_scale = optional_scale(k_scale, device, kOp, "k_scale");
  p.v_scale = optional_scale(v_scale, device, kOp, "v_scale");
  p.softcap = static_cast<float>(softcap);
  p.window = static_cast<int>(window);
  const ElemType kv_type = elem_type_of(key_cache, kOp);
  STD_TORCH_CHECK(kv_type != ElemType::kFp8E4m3 ||
                      (p.k_scale != nullptr && p.v_scale != nullptr),
                  kOp, ": an FP8 cache needs k_scale and v_scale");
  if (q.size(0) == 0) return;

  prefill::prefill_attention(p, q.const_data_ptr(), q.stride(0), q.stride(1),
                             num_q_heads, head_dim, kv_type, k_view, v_view,
                             current_stream(q));
}

}  // namespace hpc
