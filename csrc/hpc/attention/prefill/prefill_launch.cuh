// Template dispatch of the prefill kernel for one head size; included by the
// per-head-size translation units so that they compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include <cute/numeric/numeric_types.hpp>

#include "attention/prefill/prefill.h"
#include "attention/prefill/prefill_config.cuh"
#include "attention/prefill/prefill_kernel.cuh"
#include "common/pdl.cuh"
#include "common/smem_config.h"

namespace hpc {
namespace prefill {

template <class Config>
void launch_config(const PrefillParams& params, const PrefillSources& src,
                   int grid, cudaStream_t stream) {
  auto kernel = prefill_kernel<Config>;
  configure_smem(kernel, Config::kSmemBytes, "prefill_attention");
  launch_with_pdl(kernel, dim3(grid), dim3(kPrefillThreads), Config::kSmemBytes,
                  stream, params, src);
}

// The MMAs run in the cache's type: bf16, fp16 or E4M3.
template <int kHeadDim>
void launch_prefill_kernel(const PrefillParams& params,
                           const PrefillSources& src, ElemType kv_type,
                           int grid, cudaStream_t stream) {
  switch (kv_type) {
    case ElemType::kBf16:
      return launch_config<PrefillConfig<kHeadDim, cute::bfloat16_t>>(
          params, src, grid, stream);
    case ElemType::kFp16:
      return launch_config<PrefillConfig<kHeadDim, cute::half_t>>(params, src,
                                                                  grid, stream);
    case ElemType::kFp8E4m3:
      return launch_config<PrefillConfig<kHeadDim, cute::float_e4m3_t>>(
          params, src, grid, stream);
  }
}

}  // namespace prefill
}  // namespace hpc
