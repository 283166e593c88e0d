// Host-side shared-memory configuration of a kernel before its launch.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "common/device_info.h"

namespace hpc {

// Lets `kernel` take `bytes` of dynamic shared memory (throws, naming `op`,
// if the device has less) and asks for all of the SM's unified L1/shared
// storage as shared memory, so that several CTAs' buffers fit side by side.
template <typename Kernel>
void configure_smem(Kernel kernel, int bytes, const char* op) {
  const DeviceInfo& device = current_device_info();
  if (bytes > device.max_smem_per_block) {
    throw std::invalid_argument(
        std::string(op) + ": needs " + std::to_string(bytes) +
        " bytes of shared memory per block, the device offers " +
        std::to_string(device.max_smem_per_block));
  }
  HPC_CUDA_CHECK(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  HPC_CUDA_CHECK(cudaFuncSetAttribute(
      kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
      cudaSharedmemCarveoutMaxShared));
}

}  // namespace hpc
