// at::Tensor adapter of the fused prologue.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "ops.h"
#include "rope_norm/rope_norm.h"

namespace hpc {

namespace {

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

bool is_index(const at::Tensor& t) {
  return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong;
}

}  // namespace

void rope_norm_store_kv(const at::Tensor& qkv, const at::Tensor& positions,
                        const at::Tensor& slot_mapping,
                        const at::Tensor& cos_sin_cache, at::Tensor& key_cache,
                        at::Tensor& value_cache, at::Tensor& q_out,
                        const std::optional<at::Tensor>& q_scale,
                        const std::optional<at::Tensor>& q_norm_weight,
                        const std::optional<at::Tensor>& k_norm_weight,
                        const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale, double eps,
                        int64_t norm_policy, bool is_neox) {
  TORCH_CHECK(qkv.is_cuda() && qkv.dim() == 2 && qkv.stride(1) == 1);
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 ||
              qkv.scalar_type() == at::kHalf);
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes());
  TORCH_CHECK(key_cache.strides() == value_cache.strides());
  TORCH_CHECK(key_cache.stride(3) == 1 && q_out.is_contiguous());
  TORCH_CHECK(is_index(positions) && is_index(slot_mapping));
  TORCH_CHECK(aligned16(qkv) && aligned16(key_cache) &&
              aligned16(value_cache) && aligned16(q_out) &&
              aligned16(cos_sin_cache));

  const at::cuda::CUDAGuard device_guard(qkv.device());
  RopeNormParams p{};
  p.qkv = qkv.data_ptr();
  p.qkv_row_stride = qkv.stride(0);
  p.dtype = qkv.scalar_type() == at::kBFloat16 ? ScalarType::kBFloat16
                                               : ScalarType::kFloat16;
  p.positions = positions.data_ptr();
  p.positions_are_int64 = positions.scalar_type() == at::kLong;
  p.slot_mapping = slot_mapping.data_ptr();
  p.slots_are_int64 = slot_mapping.scalar_type() == at::kLong;

  p.cos_sin_cache = cos_sin_cache.data_ptr();
  p.cos_sin_is_fp32 = cos_sin_cache.scalar_type() == at::kFloat;
  TORCH_CHECK(p.cos_sin_is_fp32 ||
              cos_sin_cache.scalar_type() == qkv.scalar_type());
  p.rotary_dim = static_cast<int>(cos_sin_cache.size(1));
  p.max_position = static_cast<int>(cos_sin_cache.size(0));
  p.is_neox = is_neox;

  p.norm_policy = static_cast<QkNormPolicy>(norm_policy);
  p.eps = static_cast<float>(eps);
  if (p.norm_policy != QkNormPolicy::kNone) {
    TORCH_CHECK(q_norm_weight.has_value() && k_norm_weight.has_value());
    TORCH_CHECK(aligned16(*q_norm_weight) && aligned16(*k_norm_weight));
    TORCH_CHECK(q_norm_weight->scalar_type() == k_norm_weight->scalar_type());
    p.q_norm_weight = q_norm_weight->data_ptr();
    p.k_norm_weight = k_norm_weight->data_ptr();
    p.norm_weight_is_fp32 = q_norm_weight->scalar_type() == at::kFloat;
  }

  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.cache_block_stride = key_cache.stride(0);
  p.cache_token_stride = key_cache.stride(1);
  p.cache_head_stride = key_cache.stride(2);
  p.block_size = static_cast<int>(key_cache.size(1));
  p.cache_is_fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  if (p.cache_is_fp8) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value());
    p.k_scale = k_scale->data_ptr<float>();
    p.v_scale = v_scale->data_ptr<float>();
  } else {
    TORCH_CHECK(key_cache.scalar_type() == qkv.scalar_type());
  }

  p.q_out = q_out.data_ptr();
  p.q_out_is_fp8 = q_out.scalar_type() == at::kFloat8_e4m3fn;
  if (p.q_out_is_fp8) {
    TORCH_CHECK(q_scale.has_value() && q_scale->is_contiguous());
    p.q_scale = q_scale->data_ptr<float>();
  }

  p.num_tokens = static_cast<int>(qkv.size(0));
  p.num_q_heads = static_cast<int>(q_out.size(1));
  p.num_kv_heads = static_cast<int>(key_cache.size(2));
  p.head_dim = static_cast<int>(key_cache.size(3));
  TORCH_CHECK(qkv.size(1) ==
              static_cast<int64_t>(p.num_q_heads + 2 * p.num_kv_heads) *
                  p.head_dim);

  launch_rope_norm(p, c10::cuda::getCurrentCUDAStream());
}

}  // namespace hpc
