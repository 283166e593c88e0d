// Named hardware barriers (bar.sync ids) of the attention kernels, one enum
// per kernel so that ids never collide inside a kernel. Id 0 is
// __syncthreads.
#pragma once

namespace hpc {
namespace attention {

// Paged prefill (prefill_kernel.cuh): the two consumer warpgroups.
enum class PrefillBarrier : int {
  kConsumers = 1,   // both consumer warpgroups (256 threads)
  kWarpgroup0Turn,  // consumer warpgroup 0 may issue its wgmma
  kWarpgroup1Turn,  // consumer warpgroup 1 may issue its wgmma
};

// Swap-AB decode (decode_kernel.cuh).
enum class DecodeBarrier : int {
  kWarpgroup0 = 1,  // consumer warpgroup 0 (128 threads)
  kWarpgroup1,      // consumer warpgroup 1
  kConsumers,       // both consumer warpgroups (256 threads)
};

}  // namespace attention
}  // namespace hpc
