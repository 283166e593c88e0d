// The kernels' limits (kernel_limits.h) as text, for host code: the adapters'
// messages and kernel_limits.
#pragma once

#include <string>
#include <vector>

#include "kernel_limits.h"

namespace hpc {
namespace limits {

// "v1,v2,...", for messages and for named_limits.
template <int N>
std::string joined(const int (&values)[N]) {
  std::string s;
  for (int i = 0; i < N; ++i) {
    if (i > 0) s += ",";
    s += std::to_string(values[i]);
  }
  return s;
}
inline std::string joined(int value) { return std::to_string(value); }

// The limits by name, for kernel_limits: "name=v1,v2,...".
inline std::vector<std::string> named_limits() {
  const auto entry = [](const char* name, const std::string& values) {
    return std::string(name) + "=" + values;
  };
  return {
      entry("head_sizes", joined(kHeadSizes)),
      entry("block_sizes", joined(kBlockSizes)),
      entry("max_gqa_ratio", joined(kMaxGqaRatio)),
      entry("decode_tile_tokens", joined(kDecodeTileTokens)),
      entry("max_decode_query_tokens", joined(kMaxDecodeQueryTokens)),
      entry("max_decode_rows", joined(kMaxDecodeRows)),
      entry("prefill_max_kv_heads", joined(kPrefillMaxKvHeads)),
      entry("moe_block_shape", joined(kMoeBlockShape)),
      entry("moe_max_topk", joined(kMoeMaxTopk)),
      entry("moe_hidden_align", joined(kMoeHiddenAlign)),
      entry("moe_intermediate_align", joined(kMoeIntermediateAlign)),
  };
}

}  // namespace limits
}  // namespace hpc
