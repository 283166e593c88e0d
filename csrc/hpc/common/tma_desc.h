// Host-side creation of TMA tensor descriptors. The driver entry point is
// fetched through the runtime, so the extension does not link libcuda.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace hpc {

// A rank-4 tiled descriptor. dims/box are innermost first; strides_bytes are
// the byte strides of dims 1..3 (dim 0 is contiguous).
CUtensorMap make_tensor_map_4d(const void* base, CUtensorMapDataType dtype,
                               const uint64_t (&dims)[4],
                               const uint64_t (&strides_bytes)[3],
                               const uint32_t (&box)[4],
                               CUtensorMapSwizzle swizzle);

}  // namespace hpc
