// Two floats as one register of a 16-bit MMA type, the form wgmma's A
// fragments, stmatrix and 32-bit stores take.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include <cute/numeric/numeric_types.hpp>

namespace hpc {
namespace attention {

// `lo` in the low half. Element: cute::bfloat16_t or cute::half_t.
template <class Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<Element, cute::bfloat16_t>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

}  // namespace attention
}  // namespace hpc
