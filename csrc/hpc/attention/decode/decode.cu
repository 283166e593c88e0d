// Host side of split-KV decode attention: TMA descriptors over the paged
// cache and head-size dispatch.
#include <stdexcept>
#include <string>

#include "attention/decode/decode.h"

#include "attention/common/paged_kv_tma.h"
#include "attention/decode/decode_kernel.cuh"
#include "common/device_info.h"
#include "kernel_limits.h"

namespace hpc {
namespace decode {

namespace {

using attention::paged_cache_map;

}  // namespace

int decode_ctas_per_sm(int head_dim) {
  if (!limits::is_head_size(head_dim)) {
    throw std::invalid_argument("decode: unsupported head size " +
                                std::to_string(head_dim));
  }
  return kDecodeCtasPerSm;
}

void decode_attention(const DecodeParams& call, int head_dim, ElemType kv_type,
                      const PagedCacheView& k_cache,
                      const PagedCacheView& v_cache, int grid,
                      cudaStream_t stream) {
  DecodeParams params = call;
  params.grid_resident =
      grid <= kDecodeCtasPerSm * current_device_info().resident_sm_count;
  const CUtensorMap k_map = paged_cache_map(
      k_cache, kv_type, head_dim, params.block_size, params.num_kv_heads);
  const CUtensorMap v_map = paged_cache_map(
      v_cache, kv_type, head_dim, params.block_size, params.num_kv_heads);
  switch (head_dim) {
    case 64:
      launch_decode_kernel<64>(params, kv_type, k_map, v_map, grid, stream);
      break;
    case 128:
      launch_decode_kernel<128>(params, kv_type, k_map, v_map, grid, stream);
      break;
    case 256:
      launch_decode_kernel<256>(params, kv_type, k_map, v_map, grid, stream);
      break;
    default:
      throw std::invalid_argument("decode_attention: unsupported head size " +
                                  std::to_string(head_dim));
  }
}

}  // namespace decode
}  // namespace hpc
