// Host side of the paged-KV TMA access shared by the attention kernels: one
// 4-D tensor map over a strided paged cache, (head-dim chunk, token in
// block, KV head, block id), whose box is one cache block of one KV head and
// one <= 128-byte chunk of the head dimension. The block id is the last
// coordinate, so one map serves every block of the cache.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/elem_type.h"
#include "common/paged_cache_view.h"

namespace hpc {
namespace attention {

// Bytes of one swizzled shared-memory row of a chunk: the head dimension's
// bytes, capped at 128 (the 128- or 64-byte swizzle).
inline int paged_chunk_row_bytes(int head_dim, ElemType type) {
  const int bytes = head_dim * elem_bytes(type);
  return bytes < 128 ? bytes : 128;
}

// A 4-D map whose innermost dimension is the head dimension: `dims`
// innermost first (dims[0] = head_dim), `strides` of dims 1..3 in elements;
// a box is one chunk of the head dimension (paged_chunk_row_bytes) by
// box1 x box2 x 1, landing with the chunk's swizzle.
CUtensorMap head_chunk_map(const void* base, ElemType type,
                           const uint64_t (&dims)[4],
                           const int64_t (&strides)[3], uint32_t box1,
                           uint32_t box2);

CUtensorMap paged_cache_map(const PagedCacheView& view, ElemType type,
                            int head_dim, int block_size, int num_kv_heads);

}  // namespace attention
}  // namespace hpc
