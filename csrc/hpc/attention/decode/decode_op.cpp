// at::Tensor adapter of split-KV decode attention. Inputs were validated by
// vllm/_hpc_ops.py; the checks here guard the kernels' invariants.
#include <ATen/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "attention/decode/decode.h"
#include "common/device_info.h"
#include "common/tensor_elem_type.h"
#include "ops.h"

namespace hpc {

namespace {

constexpr const char* kOp = "decode_attention";

decode::PagedCacheView cache_view(const at::Tensor& cache) {
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1);
  return {cache.data_ptr(), cache.size(0), cache.stride(0), cache.stride(1),
          cache.stride(2)};
}

const float* optional_scalar(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1 &&
              t->is_cuda());
  return t->data_ptr<float>();
}

}  // namespace

void decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                      const at::Tensor& value_cache,
                      const at::Tensor& block_table, const at::Tensor& kv_lens,
                      const at::Tensor& plan, at::Tensor& out,
                      at::Tensor& partial_out, at::Tensor& partial_lse,
                      at::Tensor& piece_counters,
                      const std::optional<at::Tensor>& q_scale,
                      const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale, double scale,
                      double softcap, int64_t window, int64_t query_tokens,
                      int64_t max_units, int64_t num_ctas) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 3 && q.stride(2) == 1);
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.sizes() == q.sizes());
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes());
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type());
  TORCH_CHECK(block_table.scalar_type() == at::kInt &&
              block_table.stride(1) == 1);
  TORCH_CHECK(kv_lens.scalar_type() == at::kInt && kv_lens.is_contiguous());
  TORCH_CHECK(plan.scalar_type() == at::kInt && partial_out.is_contiguous() &&
              partial_lse.is_contiguous());

  const at::cuda::CUDAGuard device_guard(q.device());
  const int batch = static_cast<int>(kv_lens.numel());
  const int num_kv_heads = static_cast<int>(key_cache.size(2));
  const int head_dim = static_cast<int>(key_cache.size(3));
  decode::DecodeParams p{};
  p.q = q.data_ptr();
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.q_type = elem_type_of(q, kOp);
  if (p.q_type == decode::ElemType::kFp8E4m3) {
    TORCH_CHECK(q_scale.has_value() && q_scale->stride(1) == 1);
    p.q_scale = q_scale->data_ptr<float>();
    p.q_scale_token_stride = q_scale->stride(0);
  }
  p.out = out.data_ptr();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.out_type = elem_type_of(out, kOp);
  TORCH_CHECK(p.out_type != decode::ElemType::kFp8E4m3);
  p.block_table = block_table.data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.kv_lens = kv_lens.data_ptr<int32_t>();
  p.block_size = static_cast<int>(key_cache.size(1));
  p.plan = plan.data_ptr<int32_t>();
  p.layout = {static_cast<int>(max_units), static_cast<int>(num_ctas)};
  TORCH_CHECK(plan.numel() >= p.layout.size());
  p.partial_out = partial_out.data_ptr<float>();
  p.partial_lse = partial_lse.data_ptr<float>();
  TORCH_CHECK(piece_counters.scalar_type() == at::kInt &&
              piece_counters.numel() >= max_units);
  p.piece_counters = piece_counters.data_ptr<int32_t>();
  p.batch = batch;
  p.num_kv_heads = num_kv_heads;
  p.group = static_cast<int>(q.size(1)) / num_kv_heads;
  p.query_tokens = static_cast<int>(query_tokens);
  p.rows = p.group * p.query_tokens;
  TORCH_CHECK(p.rows <= 64 && q.size(0) == batch * query_tokens);
  // The workspace sizes both for its largest row count; a step with fewer
  // query tokens uses a prefix.
  TORCH_CHECK(partial_out.numel() == partial_lse.numel() * head_dim,
              "decode_attention: partial_out must hold head_size floats per "
              "partial_lse entry");
  p.scale = static_cast<float>(scale);
  p.k_scale = optional_scalar(k_scale);
  p.v_scale = optional_scalar(v_scale);
  p.softcap = static_cast<float>(softcap);
  p.window = static_cast<int>(window);
  if (batch == 0) return;

  decode::decode_attention(p, head_dim, elem_type_of(key_cache, kOp),
                           cache_view(key_cache), cache_view(value_cache),
                           static_cast<int>(num_ctas),
                           at::cuda::getCurrentCUDAStream());
}

int64_t decode_ctas_per_sm(int64_t head_size, int64_t kv_elem_bytes) {
  TORCH_CHECK(kv_elem_bytes == 1 || kv_elem_bytes == 2);
  return decode::decode_ctas_per_sm(static_cast<int>(head_size),
                                    kv_elem_bytes == 1
                                        ? decode::ElemType::kFp8E4m3
                                        : decode::ElemType::kBf16);
}

}  // namespace hpc
