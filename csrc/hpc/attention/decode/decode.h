// Host entry points of split-KV decode attention (no torch).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode/decode_params.h"
#include "common/paged_cache_view.h"

namespace hpc {
namespace decode {

using hpc::PagedCacheView;

// The decode kernel (which also merges split units), launched with PDL on
// `stream`. `grid` is the CTA count the plan was sized for (layout.max_ctas).
void decode_attention(const DecodeParams& params, int head_dim,
                      ElemType kv_type, const PagedCacheView& k_cache,
                      const PagedCacheView& v_cache, int grid,
                      cudaStream_t stream);

// Persistent decode CTAs that fit on one SM (one for every supported head
// size and cache type); plans should offer SM count x this many CTAs.
int decode_ctas_per_sm(int head_dim);

// Per head size (decode_hd<D>.cu): the decode kernel alone.
template <int kHeadDim>
void launch_decode_kernel(const DecodeParams& params, ElemType kv_type,
                          const CUtensorMap& k_map, const CUtensorMap& v_map,
                          int grid, cudaStream_t stream);

}  // namespace decode
}  // namespace hpc
