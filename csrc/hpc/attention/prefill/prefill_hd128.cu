// Prefill kernels for head size 128 (one translation unit per head size).
#include "attention/prefill/prefill_launch.cuh"

namespace hpc {
namespace prefill {

template void launch_prefill_kernel<128>(const PrefillParams&,
                                         const PrefillSources&, ElemType, int,
                                         cudaStream_t);

}  // namespace prefill
}  // namespace hpc
