#include "common/tma_desc.h"

#include <cuda_runtime.h>

#include <mutex>
#include <stdexcept>
#include <string>

#include "common/driver_entry.h"

namespace hpc {

namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType,
                                   cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion,
                                   CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = driver_entry_point("cuTensorMapEncodeTiled", 12000);
    if (ptr == nullptr) {
      throw std::runtime_error("cuTensorMapEncodeTiled is not available");
    }
    fn = reinterpret_cast<EncodeTiledFn>(ptr);
  });
  return fn;
}

}  // namespace

CUtensorMap make_tensor_map_4d(const void* base, CUtensorMapDataType dtype,
                               const uint64_t (&dims)[4],
                               const uint64_t (&strides_bytes)[3],
                               const uint32_t (&box)[4],
                               CUtensorMapSwizzle swizzle) {
  CUtensorMap map;
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult rc = encode_tiled()(
      &map, dtype, 4, const_cast<void*>(base), dims, strides_bytes, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (rc != CUDA_SUCCESS) {
    throw std::runtime_error("cuTensorMapEncodeTiled failed with error " +
                             std::to_string(static_cast<int>(rc)));
  }
  return map;
}

}  // namespace hpc
