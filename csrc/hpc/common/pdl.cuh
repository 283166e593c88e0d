// Programmatic dependent launch (PDL).
//
// A kernel launched with `launch_with_pdl` may start while the previous kernel
// in the stream is still draining. It must call `pdl_wait_for_producer()`
// before it reads anything the producer wrote, and calls
// `pdl_launch_dependents()` as soon as the next kernel may begin its own
// prologue (the dependent still waits for this grid's memory to be visible in
// its own `pdl_wait_for_producer()`).
#pragma once

#include <cuda_runtime.h>

#include "common/cuda_check.h"

namespace hpc {

__device__ __forceinline__ void pdl_wait_for_producer() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// `cluster`: thread-block cluster dimensions; (1, 1, 1) launches without.
template <typename... KernelArgs, typename... Args>
void launch_with_pdl_clustered(void (*kernel)(KernelArgs...), dim3 grid,
                               dim3 block, size_t smem_bytes,
                               cudaStream_t stream, dim3 cluster,
                               Args&&... args) {
  cudaLaunchAttribute attribute[2];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  attribute[1].id = cudaLaunchAttributeClusterDimension;
  attribute[1].val.clusterDim.x = cluster.x;
  attribute[1].val.clusterDim.y = cluster.y;
  attribute[1].val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = cluster.x * cluster.y * cluster.z > 1 ? 2 : 1;
  HPC_CUDA_CHECK(
      cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

template <typename... KernelArgs, typename... Args>
void launch_with_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                     size_t smem_bytes, cudaStream_t stream, Args&&... args) {
  launch_with_pdl_clustered(kernel, grid, block, smem_bytes, stream,
                            dim3(1, 1, 1), std::forward<Args>(args)...);
}

}  // namespace hpc
