// Host side of paged prefill attention: the tensor maps over Q and the
// paged cache, and head-size dispatch.
#include <stdexcept>
#include <string>

#include "attention/common/paged_kv_tma.h"
#include "attention/prefill/prefill.h"
#include "common/device_info.h"

namespace hpc {
namespace prefill {

namespace {

// Q as (channel, query head, token): one box is one chunk of channels of
// the group's query heads for tile_tokens tokens, landing as the tile's rows
// in (token, head) order.
CUtensorMap query_map(const void* q, ElemType type, int64_t token_stride,
                      int64_t head_stride, int num_tokens, int num_q_heads,
                      int head_dim, int group, int tile_tokens) {
  const uint64_t dims[4] = {static_cast<uint64_t>(head_dim),
                            static_cast<uint64_t>(num_q_heads),
                            static_cast<uint64_t>(num_tokens), 1};
  const int64_t strides[3] = {head_stride, token_stride,
                              token_stride * num_tokens};
  return attention::head_chunk_map(q, type, dims, strides,
                                   static_cast<uint32_t>(group),
                                   static_cast<uint32_t>(tile_tokens));
}

}  // namespace

void prefill_attention(const PrefillParams& params, const void* q,
                       int64_t q_token_stride, int64_t q_head_stride,
                       int num_q_heads, int head_dim, ElemType kv_type,
                       const PagedCacheView& k_cache,
                       const PagedCacheView& v_cache, cudaStream_t stream) {
  if (kv_type != ElemType::kFp8E4m3 && params.q_type != kv_type) {
    throw std::invalid_argument(
        "prefill_attention: queries must have the 16-bit cache's dtype");
  }
  PrefillSources src{};
  src.q_map = query_map(q, params.q_type, q_token_stride, q_head_stride,
                        params.num_tokens, num_q_heads, head_dim, params.group,
                        params.tile_tokens);
  src.k_map = attention::paged_cache_map(
      k_cache, kv_type, head_dim, params.block_size, params.num_kv_heads);
  src.v_map = attention::paged_cache_map(
      v_cache, kv_type, head_dim, params.block_size, params.num_kv_heads);
  const int grid = current_device_info().sm_count;
  switch (head_dim) {
    case 64:
      return launch_prefill_kernel<64>(params, src, kv_type, grid, stream);
    case 128:
      return launch_prefill_kernel<128>(params, src, kv_type, grid, stream);
    case 256:
      return launch_prefill_kernel<256>(params, src, kv_type, grid, stream);
    default:
      throw std::invalid_argument("prefill_attention: unsupported head size " +
                                  std::to_string(head_dim));
  }
}

}  // namespace prefill
}  // namespace hpc
