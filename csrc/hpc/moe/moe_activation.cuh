// The gated activation of the MoE MLP: h = SiLU(gate) * up.
#pragma once

#include <cuda_runtime.h>

namespace hpc {
namespace moe {

__device__ __forceinline__ float silu(float x) {
  return x / (1.f + __expf(-x));
}

}  // namespace moe
}  // namespace hpc
