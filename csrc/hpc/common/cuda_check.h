// Error checking for CUDA runtime calls and kernel launches in host code that
// does not include torch headers.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace hpc {

inline void cuda_check(cudaError_t status, const char* what, const char* file,
                       int line) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed at " + file + ":" +
                             std::to_string(line) + ": " +
                             cudaGetErrorString(status));
  }
}

}  // namespace hpc

#define HPC_CUDA_CHECK(expr) \
  ::hpc::cuda_check((expr), #expr, __FILE__, __LINE__)
