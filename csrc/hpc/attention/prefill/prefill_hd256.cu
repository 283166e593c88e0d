// Prefill kernels for head size 256 (one translation unit per head size).
#include "attention/prefill/prefill_launch.cuh"

namespace hpc {
namespace prefill {

template void launch_prefill_kernel<256>(const PrefillParams&,
                                         const PrefillSources&, ElemType, int,
                                         cudaStream_t);

}  // namespace prefill
}  // namespace hpc
