// Template dispatch of the decode kernel for one head size; included by the
// per-head-size translation units so that they compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include <cute/numeric/numeric_types.hpp>

#include "attention/decode/decode.h"
#include "attention/decode/decode_config.cuh"
#include "attention/decode/decode_kernel.cuh"
#include "common/pdl.cuh"
#include "common/smem_config.h"

namespace hpc {
namespace decode {

template <int kHeadDim, class Element, int kRows>
void launch_config(const DecodeParams& params, const CUtensorMap& k_map,
                   const CUtensorMap& v_map, int grid, cudaStream_t stream) {
  using Config = DecodeConfig<kHeadDim, Element, kRows>;
  auto kernel = decode_kernel<Config>;
  configure_smem(kernel, Config::kSmemBytes, "decode_attention");
  launch_with_pdl(kernel, dim3(grid), dim3(kWgmmaThreads), Config::kSmemBytes,
                  stream, params, k_map, v_map);
}

// The swap-AB kernel's N: the unit's rows rounded up to 8, 16, 32 or 64.
template <int kHeadDim, class Element>
void launch_rows(const DecodeParams& params, const CUtensorMap& k_map,
                 const CUtensorMap& v_map, int grid, cudaStream_t stream) {
  if (params.rows <= 8) {
    launch_config<kHeadDim, Element, 8>(params, k_map, v_map, grid, stream);
  } else if (params.rows <= 16) {
    launch_config<kHeadDim, Element, 16>(params, k_map, v_map, grid, stream);
  } else if (params.rows <= 32) {
    launch_config<kHeadDim, Element, 32>(params, k_map, v_map, grid, stream);
  } else {
    launch_config<kHeadDim, Element, 64>(params, k_map, v_map, grid, stream);
  }
}

// The MMAs run in the cache's type: bf16, fp16 or E4M3.
template <int kHeadDim>
void launch_decode_kernel(const DecodeParams& params, ElemType kv_type,
                          const CUtensorMap& k_map, const CUtensorMap& v_map,
                          int grid, cudaStream_t stream) {
  switch (kv_type) {
    case ElemType::kBf16:
      return launch_rows<kHeadDim, cute::bfloat16_t>(params, k_map, v_map, grid,
                                                     stream);
    case ElemType::kFp16:
      return launch_rows<kHeadDim, cute::half_t>(params, k_map, v_map, grid,
                                                 stream);
    case ElemType::kFp8E4m3:
      return launch_rows<kHeadDim, cute::float_e4m3_t>(params, k_map, v_map,
                                                       grid, stream);
  }
}

}  // namespace decode
}  // namespace hpc
