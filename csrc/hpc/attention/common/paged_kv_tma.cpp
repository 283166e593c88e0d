#include "attention/common/paged_kv_tma.h"

#include <cstdint>

#include "common/tma_desc.h"

namespace hpc {
namespace attention {

CUtensorMap paged_cache_map(const PagedCacheView& view, ElemType type,
                            int head_dim, int block_size, int num_kv_heads) {
  const int elem_bytes = type == ElemType::kFp8E4m3 ? 1 : 2;
  const int row_bytes = paged_chunk_row_bytes(head_dim, type);
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

}  // namespace attention
}  // namespace hpc
