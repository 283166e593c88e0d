// at::Tensor adapter of paged prefill attention. Inputs were validated by
// vllm/_hpc_ops.py; the checks here guard the kernel's memory accesses.
#include <ATen/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "attention/prefill/prefill.h"
#include "common/tensor_elem_type.h"
#include "ops.h"

namespace hpc {

namespace {

constexpr const char* kOp = "prefill_attention";

PagedCacheView cache_view(const at::Tensor& cache) {
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1 && cache.is_cuda());
  return {cache.data_ptr(), cache.size(0), cache.stride(0), cache.stride(1),
          cache.stride(2)};
}

const float* optional_scalar(const std::optional<at::Tensor>& t,
                             const at::Device& device) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1 &&
              t->device() == device);
  return t->data_ptr<float>();
}

}  // namespace

void prefill_attention(const at::Tensor& q, const at::Tensor& key_cache,
                       const at::Tensor& value_cache,
                       const at::Tensor& block_table,
                       const at::Tensor& query_start_loc,
                       const at::Tensor& seq_lens, const at::Tensor& plan,
                       at::Tensor& out,
                       const std::optional<at::Tensor>& q_scale,
                       const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& v_scale, double scale,
                       double softcap, int64_t window) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 3 && q.stride(2) == 1);
  const at::Device device = q.device();
  TORCH_CHECK(out.device() == device && out.dim() == 3 && out.stride(2) == 1 &&
              out.sizes() == q.sizes());
  TORCH_CHECK(key_cache.device() == device && value_cache.device() == device &&
              key_cache.sizes() == value_cache.sizes() &&
              key_cache.scalar_type() == value_cache.scalar_type());
  TORCH_CHECK(block_table.device() == device && block_table.dim() == 2 &&
              block_table.scalar_type() == at::kInt &&
              block_table.stride(1) == 1);
  TORCH_CHECK(seq_lens.device() == device &&
              seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous());
  const int64_t batch = seq_lens.numel();
  TORCH_CHECK(query_start_loc.device() == device &&
              query_start_loc.scalar_type() == at::kInt &&
              query_start_loc.is_contiguous() &&
              query_start_loc.numel() == batch + 1);
  TORCH_CHECK(block_table.size(0) >= batch);
  TORCH_CHECK(plan.device() == device && plan.scalar_type() == at::kInt &&
              plan.is_contiguous() && plan.numel() >= prefill::kHeaderSize);

  const PagedCacheView k_view = cache_view(key_cache);
  const PagedCacheView v_view = cache_view(value_cache);
  const int num_q_heads = static_cast<int>(q.size(1));
  const int num_kv_heads = static_cast<int>(key_cache.size(2));
  const int head_dim = static_cast<int>(key_cache.size(3));
  TORCH_CHECK(q.size(2) == head_dim);
  TORCH_CHECK(num_kv_heads >= 1 && num_q_heads % num_kv_heads == 0);
  const int group = num_q_heads / num_kv_heads;
  TORCH_CHECK(group >= 1 && group <= 16);

  const at::cuda::CUDAGuard device_guard(device);
  prefill::PrefillParams p{};
  p.q_type = elem_type_of(q, kOp);
  if (p.q_type == ElemType::kFp8E4m3) {
    TORCH_CHECK(q_scale.has_value() && q_scale->device() == device &&
                q_scale->scalar_type() == at::kFloat && q_scale->dim() == 2 &&
                q_scale->size(0) >= q.size(0) &&
                q_scale->size(1) == num_q_heads && q_scale->stride(1) == 1);
    p.q_scale = q_scale->data_ptr<float>();
    p.q_scale_token_stride = q_scale->stride(0);
  }
  p.out = out.data_ptr();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.out_type = elem_type_of(out, kOp);
  TORCH_CHECK(p.out_type != ElemType::kFp8E4m3);
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.block_size = static_cast<int>(key_cache.size(1));
  p.plan = plan.data_ptr<int32_t>();
  p.num_tokens = static_cast<int>(q.size(0));
  p.num_kv_heads = num_kv_heads;
  p.group = group;
  p.tile_tokens = prefill::tile_tokens_of(group);
  p.scale = static_cast<float>(scale);
  p.k_scale = optional_scalar(k_scale, device);
  p.v_scale = optional_scalar(v_scale, device);
  p.softcap = static_cast<float>(softcap);
  p.window = static_cast<int>(window);
  const ElemType kv_type = elem_type_of(key_cache, kOp);
  TORCH_CHECK(kv_type != ElemType::kFp8E4m3 ||
              (p.k_scale != nullptr && p.v_scale != nullptr));
  if (q.size(0) == 0) return;

  prefill::prefill_attention(p, q.data_ptr(), q.stride(0), q.stride(1),
                             num_q_heads, head_dim, kv_type, k_view, v_view,
                             at::cuda::getCurrentCUDAStream());
}

}  // namespace hpc
