// The decode kernel for head size 256 (one translation unit per head size).
#include "attention/decode/decode_launch.cuh"

namespace hpc {
namespace decode {

template void launch_decode_kernel<256>(const DecodeParams&, ElemType,
                                        const CUtensorMap&, const CUtensorMap&,
                                        int, cudaStream_t);

}  // namespace decode
}  // namespace hpc
