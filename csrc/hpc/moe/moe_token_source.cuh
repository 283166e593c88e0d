// Where the grouped GEMMs and the decode path find their B operand's FP8
// rows and scales: the (quantized) input for gate-up, the quantized
// intermediate for down.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moe/moe_params.h"

namespace hpc {
namespace moe {

// Token rows of the B operand and the rows their activation scales are
// indexed by: the gate-up GEMM gathers input tokens, the down GEMM reads the
// intermediate by row.
template <bool kGateUp>
struct TokenSource {
  const uint8_t* base;
  int64_t stride;  // bytes between rows
  ScaleView scale;

  __device__ static TokenSource make(const MoeParams& p) {
    TokenSource s;
    const float* input_scale =
        reinterpret_cast<const float*>(p.workspace + p.layout.input_scale());
    if constexpr (kGateUp) {
      const bool fp8_input = p.input_type == ElemType::kFp8E4m3;
      s.base = fp8_input ? static_cast<const uint8_t*>(p.input)
                         : p.workspace + p.layout.input_q();
      s.stride = fp8_input ? p.input_stride : p.hidden;
      const int64_t groups = p.hidden / kScaleBlock;
      if (p.block_wise) {
        s.scale = fp8_input ? ScaleView{p.a1_scale, p.a1_scale_stride, 1, 0}
                            : ScaleView{input_scale, groups, 1, 0};
      } else if (p.a1_scale) {
        s.scale = ScaleView{p.a1_scale, 0, 0, 0};  // static
      } else {
        s.scale = ScaleView{input_scale, groups, 0, 0};  // per token
      }
    } else {
      s.base = p.workspace + p.layout.inter_q();
      s.stride = p.inter;
      s.scale = p.block_wise
                    ? ScaleView{reinterpret_cast<const float*>(
                                    p.workspace + p.layout.inter_scale()),
                                ceil_div(p.inter, kScaleBlock), 1, 0}
                    : ScaleView{p.a2_scale, 0, 0, 0};
    }
    return s;
  }

  // Row of the B source (and of its scales) for a tile's row
  // (moe_tiles.cuh): the row's token for gate-up, the row itself for down.
  __device__ static int64_t row_of(const MoeParams& p, int row) {
    if constexpr (kGateUp) {
      if (p.tiling.slot_tiles) return row / p.topk;
      const int32_t* row_slot =
          reinterpret_cast<const int32_t*>(p.workspace + p.layout.row_slot());
      return row_slot[row] / p.topk;
    } else {
      return row;
    }
  }
};

}  // namespace moe
}  // namespace hpc
