// Stable-ABI adapter of the split-KV decode planner: the host
// implementation for CPU lengths, the GPU planner for CUDA lengths.
#include <string>
#include <vector>

#include "attention/decode/decode_plan.h"
#include "common/field_names.h"
#include "common/stable_tensor.h"
#include "ops.h"

namespace hpc {
namespace {

// The plan's header and first-item descriptor fields by name, in enum order:
// plan readers index them by these names.
constexpr FieldName<decode::PlanHeader> kHeaderNames[] = {
    {decode::kNumUnits, "num_units"},
    {decode::kTotalGranules, "total_granules"},
    {decode::kNumCtas, "num_ctas"},
    {decode::kNumPartials, "num_partials"},
    {decode::kSplitTiles, "split_tiles"},
    {decode::kQueryTokens, "query_tokens"},
    {decode::kMode, "mode"},
    {decode::kWindow, "window"},
};
static_assert(names_every_field(kHeaderNames, decode::kHeaderSize),
              "kHeaderNames must name every PlanHeader field, in order");

constexpr FieldName<decode::CtaItemField> kItemNames[] = {
    {decode::kItemUnit, "unit"},
    {decode::kItemKvLen, "kv_len"},
    {decode::kItemTileBegin, "tile_begin"},
    {decode::kItemTileEnd, "tile_end"},
    {decode::kItemPieces, "pieces"},
    {decode::kItemFirstPartial, "first_partial"},
    {decode::kItemPartialRow, "partial_row"},
    {decode::kItemMergers, "mergers"},
};
static_assert(names_every_field(kItemNames, decode::kItemWords),
              "kItemNames must name every CtaItemField, in order");

// decode_plan_layout's offsets and size by name, written once: the values
// and the names (decode_plan_layout_fields) come from this list.
std::vector<NamedValue> layout_entries(const decode::PlanLayout& layout) {
  return {{"header", decode::kHeaderSize},
          {"unit_granule_offset", layout.unit_granule_offset()},
          {"unit_num_pieces", layout.unit_num_pieces()},
          {"unit_first_partial", layout.unit_first_partial()},
          {"cta_granule_begin", layout.cta_granule_begin()},
          {"cta_first_unit", layout.cta_first_unit()},
          {"cta_first_item", layout.cta_first_item()},
          {"size", layout.size()}};
}

// decode_workspace_sizes' values by name.
std::vector<NamedValue> size_entries(const decode::WorkspaceSizes& sizes) {
  return {{"plan_ctas", sizes.plan_ctas}, {"max_partials", sizes.max_partials}};
}

}  // namespace

void plan_decode(const Tensor& kv_lens, Tensor& plan, int64_t num_kv_heads,
                 int64_t query_tokens, int64_t window, int64_t num_ctas,
                 int64_t max_units, int64_t min_split_tiles, int64_t mode,
                 int64_t split_tiles, int64_t group, int64_t kv_elem_bytes) {
  STD_TORCH_CHECK(kv_lens.device() == plan.device(),
                  "plan_decode: kv_lens and plan must be on one device");
  STD_TORCH_CHECK(
      kv_lens.scalar_type() == Dtype::Int && kv_lens.is_contiguous(),
      "plan_decode: kv_lens must be contiguous int32");
  STD_TORCH_CHECK(plan.scalar_type() == Dtype::Int && plan.is_contiguous(),
                  "plan_decode: plan must be contiguous int32");
  STD_TORCH_CHECK(mode >= 0 && mode <= 2,
                  "plan_decode: mode must be 0, 1 or 2");
  STD_TORCH_CHECK(group >= 1, "plan_decode: group must be >= 1");
  STD_TORCH_CHECK(kv_elem_bytes == 1 || kv_elem_bytes == 2,
                  "plan_decode: kv_elem_bytes must be 1 or 2");
  const decode::PlanLayout layout{static_cast<int>(max_units),
                                  static_cast<int>(num_ctas)};
  STD_TORCH_CHECK(plan.numel() >= layout.size(),
                  "plan_decode: plan is smaller than its layout for max_units "
                  "and num_ctas");
  decode::PlanArgs args{};
  args.batch = static_cast<int>(kv_lens.numel());
  args.num_kv_heads = static_cast<int>(num_kv_heads);
  args.query_tokens = static_cast<int>(query_tokens);
  args.window = static_cast<int>(window);
  args.ctas_offered = static_cast<int>(num_ctas);
  args.min_split_tiles = static_cast<int>(min_split_tiles);
  args.mode = static_cast<decode::SplitMode>(mode);
  args.split_tiles = static_cast<int>(split_tiles);
  args.group = static_cast<int>(group);
  args.kv_elem_bytes = static_cast<int>(kv_elem_bytes);
  STD_TORCH_CHECK(args.batch * args.num_kv_heads <= layout.max_units,
                  "plan_decode: batch x num_kv_heads exceeds max_units");
  if (kv_lens.is_cpu()) {
    decode::plan_decode_host(kv_lens.const_data_ptr<int32_t>(), args, layout,
                             plan.mutable_data_ptr<int32_t>());
    return;
  }
  STD_TORCH_CHECK(kv_lens.is_cuda(),
                  "plan_decode: kv_lens must be a CPU or CUDA tensor");
  const DeviceGuard device_guard(kv_lens.get_device_index());
  decode::plan_decode_device(kv_lens.const_data_ptr<int32_t>(), args, layout,
                             plan.mutable_data_ptr<int32_t>(),
                             current_stream(kv_lens));
}

std::vector<int64_t> decode_plan_layout(int64_t max_units, int64_t max_ctas) {
  STD_TORCH_CHECK(max_units >= 0 && max_ctas >= 0,
                  "decode_plan_layout: max_units and max_ctas must be >= 0");
  return values_of(layout_entries(decode::PlanLayout{
      static_cast<int>(max_units), static_cast<int>(max_ctas)}));
}

std::vector<std::string> decode_plan_layout_fields() {
  return names_of(layout_entries(decode::PlanLayout{0, 0}));
}

std::vector<int64_t> decode_workspace_sizes(int64_t mode, int64_t max_batch,
                                            int64_t num_kv_heads,
                                            int64_t max_kv_tokens,
                                            int64_t ctas_offered,
                                            int64_t split_tiles) {
  STD_TORCH_CHECK(mode >= 0 && mode <= 2,
                  "decode_workspace_sizes: mode must be 0, 1 or 2");
  STD_TORCH_CHECK(max_batch > 0 && num_kv_heads > 0 && max_kv_tokens > 0 &&
                      ctas_offered > 0,
                  "decode_workspace_sizes: max_batch, num_kv_heads, "
                  "max_kv_tokens and ctas_offered must be positive");
  STD_TORCH_CHECK(split_tiles > 0 || static_cast<decode::SplitMode>(mode) !=
                                         decode::SplitMode::kBatchInvariant,
                  "decode_workspace_sizes: the batch-invariant mode needs "
                  "split_tiles > 0");
  return values_of(size_entries(decode::workspace_sizes(
      static_cast<decode::SplitMode>(mode), max_batch, num_kv_heads,
      max_kv_tokens, ctas_offered, split_tiles)));
}

std::vector<std::string> decode_workspace_sizes_fields() {
  return names_of(size_entries(decode::WorkspaceSizes{}));
}

std::vector<std::string> decode_plan_header_fields() {
  return field_names(kHeaderNames);
}

std::vector<std::string> decode_plan_item_fields() {
  return field_names(kItemNames);
}

}  // namespace hpc
