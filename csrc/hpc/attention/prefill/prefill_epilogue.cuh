// Epilogue of the paged prefill kernel: O / row sum (times the V scale of
// an FP8 cache) into the output rows of the tile's (token, query head)
// pairs, bf16 or fp16. Each thread stores its column pairs directly; a quad
// covers 16 contiguous bytes of a row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include <cute/tensor.hpp>

#include "attention/common/online_softmax.cuh"
#include "attention/common/packed_pair.cuh"
#include "attention/prefill/prefill_mainloop.cuh"
#include "attention/prefill/prefill_params.h"

namespace hpc {
namespace prefill {

template <class Config, class FragO>
__device__ void store_tile(const PrefillParams& p, const RowInfo& rows,
                           FragO& acc_o, typename Config::Softmax& softmax) {
  using namespace cute;
  float inv_sum[2], lse[2];
  softmax.finish(inv_sum, lse);
  const float v_scale = p.v_scale ? *p.v_scale : 1.f;
  const bool bf16 = p.out_type == ElemType::kBf16;
  uint16_t* row_out[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    inv_sum[h] *= v_scale;
    row_out[h] = static_cast<uint16_t*>(p.out) +
                 static_cast<int64_t>(rows.token[h]) * p.out_token_stride +
                 static_cast<int64_t>(rows.head[h]) * p.out_head_stride;
  }
  // Values 2j and 2j + 1 are adjacent columns of one row.
#pragma unroll
  for (int i = 0; i < size(acc_o); i += 2) {
    const int h = attention::row_half_of(i);
    if (!rows.live[h]) continue;
    const int col = attention::fragment_column(i, threadIdx.x % 32);
    const float x = acc_o(i) * inv_sum[h];
    const float y = acc_o(i + 1) * inv_sum[h];
    *reinterpret_cast<uint32_t*>(row_out[h] + col) =
        bf16 ? attention::pack2<cute::bfloat16_t>(x, y)
             : attention::pack2<cute::half_t>(x, y);
  }
}

}  // namespace prefill
}  // namespace hpc
