// Stable-ABI adapter of the fused prologue.
#include <cstdint>

#include "common/stable_tensor.h"
#include "kernel_limits_text.h"
#include "ops.h"
#include "rope_norm/rope_norm.h"

namespace hpc {

namespace {

constexpr const char* kOp = "rope_norm_store_kv";

bool aligned16(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

bool is_index(const Tensor& t) {
  return t.scalar_type() == Dtype::Int || t.scalar_type() == Dtype::Long;
}

}  // namespace

void rope_norm_store_kv(const Tensor& qkv, const Tensor& positions,
                        const Tensor& slot_mapping, const Tensor& cos_sin_cache,
                        Tensor& key_cache, Tensor& value_cache, Tensor& q_out,
                        const std::optional<Tensor>& q_scale,
                        const std::optional<Tensor>& q_norm_weight,
                        const std::optional<Tensor>& k_norm_weight,
                        const std::optional<Tensor>& k_scale,
                        const std::optional<Tensor>& v_scale, double eps,
                        int64_t norm_policy, bool is_neox) {
  STD_TORCH_CHECK(qkv.is_cuda() && qkv.dim() == 2 && qkv.stride(1) == 1, kOp,
                  ": qkv must be a 2-dim CUDA tensor, contiguous in its last "
                  "dim");
  STD_TORCH_CHECK(
      qkv.scalar_type() == Dtype::BFloat16 || qkv.scalar_type() == Dtype::Half,
      kOp, ": qkv must be bfloat16 or float16");
  STD_TORCH_CHECK(
      key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(), kOp,
      ": key_cache must have 4 dims and the shape of value_cache");
  STD_TORCH_CHECK(key_cache.strides() == value_cache.strides(), kOp,
                  ": key_cache and value_cache must have the same strides");
  STD_TORCH_CHECK(key_cache.stride(3) == 1, kOp,
                  ": key_cache must be contiguous in its last dim");
  STD_TORCH_CHECK(q_out.is_contiguous(), kOp, ": q_out must be contiguous");
  STD_TORCH_CHECK(is_index(positions) && is_index(slot_mapping), kOp,
                  ": positions and slot_mapping must be int32 or int64");
  STD_TORCH_CHECK(aligned16(qkv) && aligned16(key_cache) &&
                      aligned16(value_cache) && aligned16(q_out) &&
                      aligned16(cos_sin_cache),
                  kOp,
                  ": qkv, the caches, q_out and cos_sin_cache must be "
                  "16-byte aligned");

  const DeviceGuard device_guard(qkv.get_device_index());
  RopeNormParams p{};
  p.qkv = qkv.const_data_ptr();
  p.qkv_row_stride = qkv.stride(0);
  p.dtype = qkv.scalar_type() == Dtype::BFloat16 ? ScalarType::kBFloat16
                                                 : ScalarType::kFloat16;
  p.positions = positions.const_data_ptr();
  p.positions_are_int64 = positions.scalar_type() == Dtype::Long;
  p.slot_mapping = slot_mapping.const_data_ptr();
  p.slots_are_int64 = slot_mapping.scalar_type() == Dtype::Long;

  p.cos_sin_cache = cos_sin_cache.const_data_ptr();
  p.cos_sin_is_fp32 = cos_sin_cache.scalar_type() == Dtype::Float;
  STD_TORCH_CHECK(
      p.cos_sin_is_fp32 || cos_sin_cache.scalar_type() == qkv.scalar_type(),
      kOp, ": cos_sin_cache must be float32 or qkv's dtype");
  p.rotary_dim = static_cast<int>(cos_sin_cache.size(1));
  p.max_position = static_cast<int>(cos_sin_cache.size(0));
  p.is_neox = is_neox;

  p.norm_policy = static_cast<QkNormPolicy>(norm_policy);
  p.eps = static_cast<float>(eps);
  if (p.norm_policy != QkNormPolicy::kNone) {
    STD_TORCH_CHECK(q_norm_weight.has_value() && k_norm_weight.has_value(), kOp,
                    ": a norm policy needs q_norm_weight and "
                    "k_norm_weight");
    STD_TORCH_CHECK(aligned16(*q_norm_weight) && aligned16(*k_norm_weight), kOp,
                    ": the norm weights must be 16-byte aligned");
    STD_TORCH_CHECK(
        q_norm_weight->scalar_type() == k_norm_weight->scalar_type(), kOp,
        ": q_norm_weight and k_norm_weight must have the same dtype");
    p.q_norm_weight = q_norm_weight->const_data_ptr();
    p.k_norm_weight = k_norm_weight->const_data_ptr();
    p.norm_weight_is_fp32 = q_norm_weight->scalar_type() == Dtype::Float;
  }

  p.key_cache = key_cache.mutable_data_ptr();
  p.value_cache = value_cache.mutable_data_ptr();
  p.cache_block_stride = key_cache.stride(0);
  p.cache_token_stride = key_cache.stride(1);
  p.cache_head_stride = key_cache.stride(2);
  p.block_size = static_cast<int>(key_cache.size(1));
  STD_TORCH_CHECK(limits::is_block_size(p.block_size), kOp,
                  ": the cache's block size must be one of ",
                  limits::joined(limits::kBlockSizes), ", got ", p.block_size);
  p.cache_is_fp8 = key_cache.scalar_type() == Dtype::Float8_e4m3fn;
  if (p.cache_is_fp8) {
    STD_TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), kOp,
                    ": an FP8 cache needs k_scale and v_scale");
    p.k_scale = k_scale->const_data_ptr<float>();
    p.v_scale = v_scale->const_data_ptr<float>();
  } else {
    STD_TORCH_CHECK(key_cache.scalar_type() == qkv.scalar_type(), kOp,
                    ": a 16-bit key_cache must have qkv's dtype");
  }

  p.q_out = q_out.mutable_data_ptr();
  p.q_out_is_fp8 = q_out.scalar_type() == Dtype::Float8_e4m3fn;
  if (p.q_out_is_fp8) {
    STD_TORCH_CHECK(q_scale.has_value() && q_scale->is_contiguous(), kOp,
                    ": an FP8 q_out needs a contiguous q_scale");
    p.q_scale = q_scale->mutable_data_ptr<float>();
  }

  p.num_tokens = static_cast<int>(qkv.size(0));
  p.num_q_heads = static_cast<int>(q_out.size(1));
  p.num_kv_heads = static_cast<int>(key_cache.size(2));
  p.head_dim = static_cast<int>(key_cache.size(3));
  STD_TORCH_CHECK(
      qkv.size(1) ==
          static_cast<int64_t>(p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim,
      kOp, ": qkv rows must hold the Q, K and V heads");

  launch_rope_norm(p, current_stream(qkv));
}

}  // namespace hpc
