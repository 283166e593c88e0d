// Host entry point of the fused FP8 MoE pipeline (no torch).
#pragma once

#include <cuda_runtime.h>

#include "moe/moe_params.h"

namespace hpc {
namespace moe {

// Route, quantize (16-bit inputs), gate-up GEMM, down GEMM and reduce, or
// for a few tokens the decode path's gate-up and down kernels, each
// launched with programmatic dependent launch on `stream`.
void fused_moe_fp8(const MoeParams& params, cudaStream_t stream);

}  // namespace moe
}  // namespace hpc
