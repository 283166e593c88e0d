// CUDA driver functions by name, through the runtime, so that the library
// does not link against libcuda.
#pragma once

#include <cuda_runtime.h>

namespace hpc {

// The driver function `name` at API version `version` (e.g. 12000), or
// nullptr where the installed driver does not have it.
inline void* driver_entry_point(const char* name, int version) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult status;
  if (cudaGetDriverEntryPointByVersion(name, &ptr, version, cudaEnableDefault,
                                       &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // a failed query is not the caller's error
    return nullptr;
  }
  return ptr;
}

}  // namespace hpc
