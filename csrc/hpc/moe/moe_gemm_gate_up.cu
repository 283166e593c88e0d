// Gate-up GEMM instantiations (own translation unit: builds in parallel
// with the down GEMM's).
#include "moe/moe_gemm.h"
#include "moe/moe_gemm_launch.cuh"

namespace hpc {
namespace moe {

void launch_gate_up_gemm(const MoeParams& p, cudaStream_t stream) {
  launch_gemm<true>(p, stream);
}

}  // namespace moe
}  // namespace hpc
