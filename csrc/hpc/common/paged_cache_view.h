// A K or V cache as a strided [num_blocks, block_size, num_kv_heads,
// head_size] view (element strides; the head dimension is contiguous), as
// the host sides of the attention kernels take it.
#pragma once

#include <cstdint>

namespace hpc {

struct PagedCacheView {
  const void* data;
  int64_t num_blocks;
  int64_t block_stride;
  int64_t token_stride;
  int64_t head_stride;
};

}  // namespace hpc
