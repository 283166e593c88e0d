// The gated activation of the MoE MLP: h = SiLU(gate) * up.
#pragma once

#include <cuda_runtime.h>

namespace hpc {
namespace moe {

__device__ __forceinline__ float silu(float x) {
  // The fast division: an IEEE one branches to a slow path for tiny and
  // huge operands. (For x < -88 the denominator is infinite: h = -0.)
  return __fdividef(x, 1.f + __expf(-x));
}

}  // namespace moe
}  // namespace hpc
