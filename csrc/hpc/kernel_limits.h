// What the kernels accept, stated once. The op adapters, launchers and
// planners ask for these by name; kernel_limits hands them to Python by name
// (kernel_limits_text.h; vllm/_hpc_ops.py reads them from the library), so a
// limit is widened here and nowhere else. Device code includes this header, so
// it holds constants only.
#pragma once

namespace hpc {
namespace limits {

// Attention (prologue, decode, prefill).
constexpr int kHeadSizes[] = {64, 128, 256};
constexpr int kBlockSizes[] = {16, 32, 64};
constexpr int kMaxGqaRatio = 16;          // query heads per KV head
constexpr int kDecodeTileTokens = 64;     // KV tokens per decode tile
constexpr int kMaxDecodeQueryTokens = 8;  // query tokens per decode request
constexpr int kMaxDecodeRows = 64;        // query tokens x GQA ratio
constexpr int kPrefillMaxKvHeads =
    256;  // a packed tile keeps the head in 8 bits

// FP8 MoE.
constexpr int kMoeBlockShape[] = {128, 128};  // block-wise weight scales
constexpr int kMoeMaxTopk = 16;
constexpr int kMoeHiddenAlign = 128;       // hidden_size is a multiple
constexpr int kMoeIntermediateAlign = 64;  // intermediate_size (per-tensor)

template <int N>
constexpr bool one_of(const int (&values)[N], int x) {
  for (int v : values) {
    if (v == x) return true;
  }
  return false;
}

constexpr bool is_head_size(int x) { return one_of(kHeadSizes, x); }
constexpr bool is_block_size(int x) { return one_of(kBlockSizes, x); }

}  // namespace limits
}  // namespace hpc
