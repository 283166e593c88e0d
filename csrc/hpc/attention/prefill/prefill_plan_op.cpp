// Stable-ABI adapters of the prefill tile planner: the host planner for CPU
// lengths, the GPU planner for CUDA lengths, and the plan's layout and
// header fields. The checks guard memory safety; PrefillWorkspace
// (vllm/v1/attention/ops/hpc_attn_workspace.py) validates the arguments.
#include <limits>
#include <string>
#include <vector>

#include "attention/prefill/prefill_plan.h"
#include "common/field_names.h"
#include "common/stable_tensor.h"
#include "kernel_limits.h"
#include "ops.h"

namespace hpc {

namespace {

constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
// Packed tiles keep the KV head in 8 bits and the m-block above them.
constexpr int64_t kMaxKvHeads = limits::kPrefillMaxKvHeads;
constexpr int64_t kMaxMBlocks = int64_t{1} << 23;

// The header's fields by name, in PlanHeader order: plan readers index the
// header by these names, so a field added to PlanHeader must be named here.
constexpr FieldName<prefill::PlanHeader> kHeaderNames[] = {
    {prefill::kNumTiles, "num_tiles"},
    {prefill::kTileTokens, "tile_tokens"},
    {prefill::kNumKvHeads, "num_kv_heads"},
    {prefill::kBatch, "batch"},
    {prefill::kMaxBatch, "max_batch"},
    {prefill::kMaxTiles, "max_tiles"},
    {prefill::kCostShift, "cost_shift"},
};

static_assert(names_every_field(kHeaderNames, prefill::kHeaderFields),
              "kHeaderNames must name every PlanHeader field, in order");

// prefill_plan_layout's tile capacity, offsets and size by name, written
// once: the values and the names (prefill_plan_layout_fields) come from here.
std::vector<NamedValue> layout_entries(int64_t max_tiles,
                                       const prefill::PlanLayout& layout) {
  return {{"max_tiles", max_tiles},
          {"request_first_item", layout.request_first_item()},
          {"tiles", layout.tiles()},
          {"size", layout.size()}};
}

void check_heads(int64_t num_q_heads, int64_t num_kv_heads) {
  STD_TORCH_CHECK(num_kv_heads >= 1 && num_kv_heads <= kMaxKvHeads,
                  "prefill: num_kv_heads must be in 1..", kMaxKvHeads, ", got ",
                  num_kv_heads);
  STD_TORCH_CHECK(num_q_heads >= 1 && num_q_heads % num_kv_heads == 0,
                  "prefill: num_q_heads (", num_q_heads,
                  ") must be a positive multiple of num_kv_heads (",
                  num_kv_heads, ")");
  STD_TORCH_CHECK(num_q_heads / num_kv_heads <= limits::kMaxGqaRatio,
                  "prefill: num_q_heads / num_kv_heads must be at most ",
                  limits::kMaxGqaRatio, ", got ", num_q_heads / num_kv_heads);
}

}  // namespace

void plan_prefill(const Tensor& query_start_loc, const Tensor& seq_lens,
                  Tensor& plan, int64_t num_q_heads, int64_t num_kv_heads,
                  int64_t max_batch, int64_t max_tiles) {
  check_heads(num_q_heads, num_kv_heads);
  STD_TORCH_CHECK(query_start_loc.device() == plan.device() &&
                      seq_lens.device() == plan.device(),
                  "plan_prefill: query_start_loc, seq_lens and plan must be "
                  "on one device");
  STD_TORCH_CHECK(query_start_loc.scalar_type() == Dtype::Int &&
                      query_start_loc.is_contiguous(),
                  "plan_prefill: query_start_loc must be contiguous int32");
  STD_TORCH_CHECK(
      seq_lens.scalar_type() == Dtype::Int && seq_lens.is_contiguous(),
      "plan_prefill: seq_lens must be contiguous int32");
  STD_TORCH_CHECK(plan.scalar_type() == Dtype::Int && plan.is_contiguous(),
                  "plan_prefill: plan must be contiguous int32");
  STD_TORCH_CHECK(max_batch >= 0 && max_batch < kIntMax && max_tiles >= 0 &&
                      max_tiles <= kIntMax,
                  "plan_prefill: max_batch and max_tiles must be in [0, 2^31)");
  const int64_t batch = seq_lens.numel();
  STD_TORCH_CHECK(query_start_loc.numel() == batch + 1,
                  "plan_prefill: query_start_loc needs batch + 1 = ", batch + 1,
                  " entries, got ", query_start_loc.numel());
  STD_TORCH_CHECK(batch <= max_batch, "plan_prefill: batch ", batch,
                  " exceeds max_batch ", max_batch);
  const prefill::PlanLayout layout{static_cast<int>(max_batch),
                                   static_cast<int>(max_tiles)};
  STD_TORCH_CHECK(plan.numel() >= layout.size(), "plan_prefill: plan has ",
                  plan.numel(), " elements; the layout needs ", layout.size());

  prefill::PlanArgs args{};
  args.batch = static_cast<int>(batch);
  args.group = static_cast<int>(num_q_heads / num_kv_heads);
  args.num_kv_heads = static_cast<int>(num_kv_heads);
  if (plan.is_cpu()) {
    prefill::plan_prefill_host(query_start_loc.const_data_ptr<int32_t>(),
                               seq_lens.const_data_ptr<int32_t>(), args, layout,
                               plan.mutable_data_ptr<int32_t>());
    return;
  }
  STD_TORCH_CHECK(plan.is_cuda(),
                  "plan_prefill: plan must be a CPU or CUDA tensor");
  const DeviceGuard device_guard(plan.get_device_index());
  prefill::plan_prefill_device(query_start_loc.const_data_ptr<int32_t>(),
                               seq_lens.const_data_ptr<int32_t>(), args, layout,
                               plan.mutable_data_ptr<int32_t>(),
                               current_stream(plan));
}

std::vector<int64_t> prefill_plan_layout(int64_t max_tokens, int64_t max_batch,
                                         int64_t num_q_heads,
                                         int64_t num_kv_heads) {
  check_heads(num_q_heads, num_kv_heads);
  STD_TORCH_CHECK(max_tokens >= 0 && max_tokens <= kIntMax && max_batch >= 0 &&
                      max_batch < kIntMax,
                  "prefill_plan_layout: max_tokens and max_batch must be in "
                  "[0, 2^31), got ",
                  max_tokens, " and ", max_batch);
  const int group = static_cast<int>(num_q_heads / num_kv_heads);
  const int tile_tokens = prefill::tile_tokens_of(group);
  STD_TORCH_CHECK((max_tokens + tile_tokens - 1) / tile_tokens < kMaxMBlocks,
                  "prefill_plan_layout: max_tokens ", max_tokens,
                  " makes more m-blocks than a tile entry holds");
  const int64_t max_tiles =
      prefill::max_plan_tiles(max_tokens, static_cast<int>(max_batch), group,
                              static_cast<int>(num_kv_heads));
  STD_TORCH_CHECK(max_tiles <= kIntMax, "prefill_plan_layout: ", max_tiles,
                  " tiles do not fit an int32 plan");
  return values_of(layout_entries(
      max_tiles, prefill::PlanLayout{static_cast<int>(max_batch),
                                     static_cast<int>(max_tiles)}));
}

std::vector<std::string> prefill_plan_layout_fields() {
  return names_of(layout_entries(0, prefill::PlanLayout{0, 0}));
}

std::vector<std::string> prefill_plan_header_fields() {
  return field_names(kHeaderNames);
}

}  // namespace hpc
