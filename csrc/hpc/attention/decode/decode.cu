// Host side of split-KV decode attention: TMA descriptors over the paged
// cache and head-size dispatch.
#include <stdexcept>
#include <string>

#include "attention/decode/decode.h"
#include "attention/decode/decode_kernel.cuh"
#include "common/pdl.cuh"
#include "common/tma_desc.h"

namespace hpc {
namespace decode {

namespace {

// One box = one cache block of one KV head and one <= 128-byte chunk of the
// head dimension, swizzled as TileLayout expects.
CUtensorMap paged_cache_map(const PagedCacheView& view, ElemType type,
                            int head_dim, int block_size, int num_kv_heads) {
  const int elem_bytes = type == ElemType::kFp8E4m3 ? 1 : 2;
  const int row_bytes =
      head_dim * elem_bytes < 128 ? head_dim * elem_bytes : 128;
  const CUtensorMapDataType dtype =
      type == ElemType::kFp8E4m3 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
      : type == ElemType::kBf16  ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const uint64_t dims[4] = {static_cast<uint64_t>(head_dim),
                            static_cast<uint64_t>(block_size),
                            static_cast<uint64_t>(num_kv_heads),
                            static_cast<uint64_t>(view.num_blocks)};
  const uint64_t strides[3] = {
      static_cast<uint64_t>(view.token_stride) * elem_bytes,
      static_cast<uint64_t>(view.head_stride) * elem_bytes,
      static_cast<uint64_t>(view.block_stride) * elem_bytes};
  const uint32_t box[4] = {static_cast<uint32_t>(row_bytes / elem_bytes),
                           static_cast<uint32_t>(block_size), 1, 1};
  return make_tensor_map_4d(view.data, dtype, dims, strides, box,
                            row_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                             : CU_TENSOR_MAP_SWIZZLE_64B);
}

template <int kHeadDim>
int ctas_per_sm(ElemType kv_type) {
  return kv_type == ElemType::kFp8E4m3 ? SmemPlan<kHeadDim, 1>::kCtasPerSm
                                       : SmemPlan<kHeadDim, 2>::kCtasPerSm;
}

}  // namespace

int decode_ctas_per_sm(int head_dim, ElemType kv_type) {
  switch (head_dim) {
    case 64:
      return ctas_per_sm<64>(kv_type);
    case 128:
      return ctas_per_sm<128>(kv_type);
    case 256:
      return ctas_per_sm<256>(kv_type);
    default:
      throw std::invalid_argument("decode: unsupported head size " +
                                  std::to_string(head_dim));
  }
}

void decode_attention(const DecodeParams& params, int head_dim,
                      ElemType kv_type, const PagedCacheView& k_cache,
                      const PagedCacheView& v_cache, int grid,
                      cudaStream_t stream) {
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
