// Warpgroup-level helpers of the wgmma kernels: a batch of wgmma over the K
// blocks of its operands, and a consumer warp's release of a pipeline
// stage.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cute/tensor.hpp>

namespace hpc {
namespace attention {

// Issues C (+)= A B over the K blocks of A and B as one wgmma batch.
template <class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma_batch(Mma& mma, const TA& a, const TB& b,
                                            TC& c, bool zero_init) {
  using namespace cute;
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
#pragma unroll
  for (int k = 0; k < size<2>(a); ++k) {
    gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
}

// A consumer warp is done with the buffer behind the empty barrier `bar`.
__device__ __forceinline__ void release(uint64_t* bar) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) cutlass::arch::ClusterBarrier::arrive(bar);
}

}  // namespace attention
}  // namespace hpc
