// Host side of the grouped FP8 GEMMs: the weights' tensor maps, the grid and
// the instantiation for the call's token tile (moe_tiling.h).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <stdexcept>

#include "common/pdl.cuh"
#include "common/smem_config.h"
#include "common/tma_desc.h"
#include "moe/moe_gemm_kernel.cuh"
#include "moe/moe_params.h"

namespace hpc {
namespace moe {

// Boxes of a warpgroup's rows x 128 bytes, 128-byte swizzle (the wgmma
// K-major atom). w13 [E, 2I, H] is viewed as [E][gate|up][I][H] so that a
// box past I is zero-filled instead of reading the up rows; w2 [E, H, I] as
// [E][1][H][I].
template <bool kGateUp, class Config>
CUtensorMap weight_tensor_map(const MoeParams& p) {
  const uint64_t H = p.hidden, I = p.inter, E = p.num_experts;
  const uint32_t box[4] = {kTileK, Config::kWgRows, 1, 1};
  if constexpr (kGateUp) {
    const uint64_t dims[4] = {H, I, 2, E};
    const uint64_t strides[3] = {H, I * H, 2 * I * H};
    return make_tensor_map_4d(p.w13, CU_TENSOR_MAP_DATA_TYPE_UINT8, dims,
                              strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
  } else {
    const uint64_t dims[4] = {I, H, 1, E};
    const uint64_t strides[3] = {I, H * I, H * I};
    return make_tensor_map_4d(p.w2, CU_TENSOR_MAP_DATA_TYPE_UINT8, dims,
                              strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
  }
}

// The intermediate [rows, I] as the down GEMM's token rows: boxes of
// kTokens rows x 128 bytes, 128-byte swizzle; rows past the call's slots
// and k past I are zero-filled (stale rows below them: zero scales).
template <int kTokens>
CUtensorMap inter_rows_tensor_map(const MoeParams& p) {
  const uint64_t I = p.inter, rows = uint64_t(p.num_tokens) * p.topk;
  const uint64_t dims[4] = {I, rows, 1, 1};
  const uint64_t strides[3] = {I, rows * I, rows * I};
  const uint32_t box[4] = {kTileK, kTokens, 1, 1};
  return make_tensor_map_4d(p.workspace + p.layout.inter_q(),
                            CU_TENSOR_MAP_DATA_TYPE_UINT8, dims, strides, box,
                            CU_TENSOR_MAP_SWIZZLE_128B);
}

template <bool kGateUp, class Config>
void launch_gemm_config(const MoeParams& p, cudaStream_t stream) {
  auto kernel = moe_gemm_kernel<kGateUp, Config>;
  const CUtensorMap weights = weight_tensor_map<kGateUp, Config>(p);
  // Narrow tiles: Config::kCtasPerSm CTAs side by side.
  configure_smem(kernel, Config::kBytes, "fused_moe_fp8");
  const MoeTiling& t = p.tiling;
  // x: group of column blocks x K split (gate-up) or group of row blocks
  // (down), y: token tile. The CTAs launch x first: a tile's CTAs together
  // (the tiles of an expert follow each other, sharing its weights in L2),
  // and those past this call's tiles, which only exit, after every working
  // one. (max_tiles bounds the tiles; a small or skewed batch needs far
  // fewer.)
  const dim3 grid(kGateUp ? gate_up_ctas_per_tile(t) : down_ctas_per_tile(t),
                  t.max_tiles);
  // A split gate-up tile's CTAs (consecutive in x) form a cluster.
  const dim3 cluster(kGateUp ? t.gate_up_split : 1, 1);
  // The down GEMM's routed tiles read their token rows by TMA; the others
  // ignore the second map (the weights' stands in).
  const CUtensorMap token_rows = !kGateUp && !t.slot_tiles
                                     ? inter_rows_tensor_map<Config::kTokens>(p)
                                     : weights;
  launch_with_pdl_clustered(kernel, grid, dim3(Config::kThreads),
                            Config::kBytes, stream, cluster, p, weights,
                            token_rows);
}

// The instantiation for a token tile at `kCtasPerSm` and the call's
// scaling (moe_tiling.h: gemm_scaling()).
template <bool kGateUp, int kTokens, int kCtasPerSm>
void launch_gemm_scaled(const MoeParams& p, cudaStream_t stream) {
  constexpr GemmScaling kBlockWise =
      gemm_scaling(kGateUp, kTokens, kCtasPerSm, true);
  constexpr GemmScaling kPerTensor =
      gemm_scaling(kGateUp, kTokens, kCtasPerSm, false);
  if constexpr (kBlockWise != kPerTensor) {
    if (p.block_wise) {
      return launch_gemm_config<kGateUp,
                                GemmConfig<kTokens, kCtasPerSm, kBlockWise>>(
          p, stream);
    }
  }
  launch_gemm_config<kGateUp, GemmConfig<kTokens, kCtasPerSm, kPerTensor>>(
      p, stream);
}

// The instantiation for a token tile at the CTAs per SM the tiling chose
// for this GEMM: its block-wise count, its per-tensor one, or three 8-token
// CTAs (checked by fused_moe_fp8(): tiling_error()).
template <bool kGateUp, int kTokens>
void launch_gemm_tile(const MoeParams& p, int ctas_per_sm,
                      cudaStream_t stream) {
  constexpr int kBlockWise = gemm_ctas_per_sm(kGateUp, kTokens, true);
  constexpr int kPerTensor = gemm_ctas_per_sm(kGateUp, kTokens, false);
  if constexpr (kPerTensor != kBlockWise) {
    if (ctas_per_sm == kPerTensor) {
      return launch_gemm_scaled<kGateUp, kTokens, kPerTensor>(p, stream);
    }
  }
  if constexpr (kTokens == kMinTokenTile) {
    if (gemm_dense_min_tile(kTokens, ctas_per_sm)) {
      return launch_gemm_scaled<kGateUp, kTokens, kDenseMinTileCtasPerSm>(
          p, stream);
    }
  }
  launch_gemm_scaled<kGateUp, kTokens, kBlockWise>(p, stream);
}

template <bool kGateUp>
void launch_gemm(const MoeParams& p, cudaStream_t stream) {
  const MoeTiling& t = p.tiling;
  const int ctas_per_sm = kGateUp ? t.gate_up_ctas_per_sm : t.down_ctas_per_sm;
  switch (t.token_tile) {
    case 8:
      return launch_gemm_tile<kGateUp, 8>(p, ctas_per_sm, stream);
    case 16:
      return launch_gemm_tile<kGateUp, 16>(p, ctas_per_sm, stream);
    case 32:
      return launch_gemm_tile<kGateUp, 32>(p, ctas_per_sm, stream);
    case 64:
      return launch_gemm_tile<kGateUp, 64>(p, ctas_per_sm, stream);
    case kThreeQuarterTokenTile:
      if constexpr (kGateUp) {
        if (t.gate_up_rows == kWideWgRows) {
          return launch_gemm_config<
              kGateUp, GemmConfig<kThreeQuarterTokenTile, 1,
                                  GemmScaling::kPerTensor, kWideWgRows>>(
              p, stream);
        }
      }
      return launch_gemm_tile<kGateUp, kThreeQuarterTokenTile>(p, ctas_per_sm,
                                                               stream);
    case 128:
      return launch_gemm_tile<kGateUp, 128>(p, ctas_per_sm, stream);
    default:
      throw std::invalid_argument("fused_moe_fp8: unsupported token tile");
  }
}

}  // namespace moe
}  // namespace hpc
