#include "attention/common/paged_kv_tma.h"

#include <cstdint>

#include "common/tma_desc.h"

namespace hpc {
namespace attention {

CUtensorMap head_chunk_map(const void* base, ElemType type,
                           const uint64_t (&dims)[4],
                           const int64_t (&strides)[3], uint32_t box1,
                           uint32_t box2) {
  const int bytes = elem_bytes(type);
  const int row_bytes = paged_chunk_row_bytes(static_cast<int>(dims[0]), type);
  const CUtensorMapDataType dtype =
      type == ElemType::kFp8E4m3 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
      : type == ElemType::kBf16  ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const uint64_t stride_bytes[3] = {static_cast<uint64_t>(strides[0]) * bytes,
                                    static_cast<uint64_t>(strides[1]) * bytes,
                                    static_cast<uint64_t>(strides[2]) * bytes};
  const uint32_t box[4] = {static_cast<uint32_t>(row_bytes / bytes), box1, box2,
                           1};
  return make_tensor_map_4d(base, dtype, dims, stride_bytes, box,
                            row_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                             : CU_TENSOR_MAP_SWIZZLE_64B);
}

CUtensorMap paged_cache_map(const PagedCacheView& view, ElemType type,
                            int head_dim, int block_size, int num_kv_heads) {
  const uint64_t dims[4] = {static_cast<uint64_t>(head_dim),
                            static_cast<uint64_t>(block_size),
                            static_cast<uint64_t>(num_kv_heads),
                            static_cast<uint64_t>(view.num_blocks)};
  const int64_t strides[3] = {view.token_stride, view.head_stride,
                              view.block_stride};
  return head_chunk_map(view.data, type, dims, strides,
                        static_cast<uint32_t>(block_size), 1);
}

}  // namespace attention
}  // namespace hpc
