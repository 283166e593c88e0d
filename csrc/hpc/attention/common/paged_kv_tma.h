// Host side of the paged-KV TMA access shared by the attention kernels: one
// 4-D tensor map over a strided paged cache, (head-dim chunk, token in
// block, KV head, block id), whose box is one cache block of one KV head and
// one <= 128-byte chunk of the head dimension. The block id is the last
// coordinate, so one map serves every block of the cache.
#pragma once

#include <cuda.h>

#include "common/elem_type.h"
#include "common/paged_cache_view.h"

namespace hpc {
namespace attention {

// Bytes of one swizzled shared-memory row of a chunk: the head dimension's
// bytes, capped at 128 (the 128- or 64-byte swizzle).
inline int paged_chunk_row_bytes(int head_dim, ElemType type) {
  const int bytes = head_dim * (type == ElemType::kFp8E4m3 ? 1 : 2);
  return bytes < 128 ? bytes : 128;
}

CUtensorMap paged_cache_map(const PagedCacheView& view, ElemType type,
                            int head_dim, int block_size, int num_kv_heads);

}  // namespace attention
}  // namespace hpc
