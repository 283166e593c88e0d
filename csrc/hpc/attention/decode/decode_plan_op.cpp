// at::Tensor adapter of the split-KV decode planner (host implementation).
#include <ATen/Tensor.h>
#include <c10/util/Exception.h>

#include "attention/decode/decode_plan.h"
#include "ops.h"

namespace hpc {

void plan_decode(const at::Tensor& kv_lens, at::Tensor& plan,
                 int64_t num_kv_heads, int64_t query_tokens, int64_t num_ctas,
                 int64_t max_units, int64_t min_split_tiles,
                 int64_t fixed_split_tiles) {
  TORCH_CHECK(kv_lens.device().is_cpu() && plan.device().is_cpu());
  TORCH_CHECK(kv_lens.scalar_type() == at::kInt && kv_lens.is_contiguous());
  TORCH_CHECK(plan.scalar_type() == at::kInt && plan.is_contiguous());
  const decode::PlanLayout layout{static_cast<int>(max_units),
                                  static_cast<int>(num_ctas)};
  TORCH_CHECK(plan.numel() >= layout.size());
  decode::plan_decode_host(
      kv_lens.data_ptr<int32_t>(), static_cast<int>(kv_lens.numel()),
      static_cast<int>(num_kv_heads), static_cast<int>(query_tokens),
      static_cast<int>(num_ctas), static_cast<int>(min_split_tiles),
      static_cast<int>(fixed_split_tiles), layout, plan.data_ptr<int32_t>());
}

}  // namespace hpc
