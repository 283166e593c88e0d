// Launchers of the grouped FP8 GEMMs of the fused MoE pipeline.
#pragma once

#include <cuda_runtime.h>

#include "moe/moe_params.h"

namespace hpc {
namespace moe {

// Gate-up GEMM with SiLU-and-mul + FP8 quantization of the intermediate.
void launch_gate_up_gemm(const MoeParams& p, cudaStream_t stream);
// Down GEMM: one 16-bit row per (token, expert) pair.
void launch_down_gemm(const MoeParams& p, cudaStream_t stream);

}  // namespace moe
}  // namespace hpc
