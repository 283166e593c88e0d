// Host entry points of paged prefill attention (no torch).
#pragma once

#include <cuda_runtime.h>

#include "attention/prefill/prefill_params.h"
#include "common/paged_cache_view.h"

namespace hpc {
namespace prefill {

// The prefill kernel over a plan written by plan_prefill_*; one persistent
// CTA per SM, launched with PDL on `stream`. `kv_type`: the cache's element
// type; Q's is params.q_type.
void prefill_attention(const PrefillParams& params, const void* q,
                       int64_t q_token_stride, int64_t q_head_stride,
                       int num_q_heads, int head_dim, ElemType kv_type,
                       const PagedCacheView& k_cache,
                       const PagedCacheView& v_cache, cudaStream_t stream);

// Per head size (prefill_hd<D>.cu): the prefill kernel alone, on `grid`
// persistent CTAs.
template <int kHeadDim>
void launch_prefill_kernel(const PrefillParams& params,
                           const PrefillSources& src, ElemType kv_type,
                           int grid, cudaStream_t stream);

}  // namespace prefill
}  // namespace hpc
