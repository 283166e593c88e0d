// Marks functions that host planners and device kernels both evaluate, so a
// rule is written once and the two sides agree bit for bit.
#pragma once

#ifdef __CUDACC__
  #define HPC_HOST_DEVICE __host__ __device__ __forceinline__
#else
  #define HPC_HOST_DEVICE inline
#endif
