// Shared-memory addressing the kernels need beside CuTe's: the aligned start
// of a dynamic buffer, and a byte store by shared-window address.
//
// Both keep accesses in the shared state space. A pointer rebuilt from an
// integer (an alignment mask, a swizzle applied to a generic address) loses
// it, and every access through such a pointer becomes a generic load or
// store, and a proxy fence after generic stores a full MEMBAR.ALL.CTA.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hpc {

// The first kAlign-aligned byte of the dynamic shared-memory buffer `raw`,
// by pointer arithmetic on `raw` itself.
template <int kAlign>
__device__ __forceinline__ uint8_t* align_shared(uint8_t* raw) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  return raw + (kAlign - addr % kAlign) % kAlign;
}

// Stores one byte at shared-window address `addr`.
__device__ __forceinline__ void store_shared_byte(uint32_t addr,
                                                  uint8_t value) {
  asm volatile("st.shared.u8 [%0], %1;" ::"r"(addr),
               "h"(static_cast<uint16_t>(value)));
}

}  // namespace hpc
