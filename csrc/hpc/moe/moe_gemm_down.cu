// Down GEMM instantiations (own translation unit: builds in parallel with
// the gate-up GEMM's).
#include "moe/moe_gemm.h"
#include "moe/moe_gemm_launch.cuh"

namespace hpc {
namespace moe {

void launch_down_gemm(const MoeParams& p, cudaStream_t stream) {
  launch_gemm<false>(p, stream);
}

}  // namespace moe
}  // namespace hpc
