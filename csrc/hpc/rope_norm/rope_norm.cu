// Host dispatch of the fused prologue: sizes the token tiles from the device
// and the head configuration, picks the instantiation for the model dtype and
// head size, and launches it with programmatic dependent launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "common/device_info.h"
#include "common/pdl.cuh"
#include "rope_norm/rope_norm.h"
#include "rope_norm/rope_norm_kernel.cuh"

namespace hpc {

namespace {

// Bytes of one tile and of a CTA's ring of stages. Three CTAs per SM with
// rings of about 64 KB keep ~190 KB of reads in flight per SM, far above what
// saturating HBM needs, while small batches still spread over many SMs.
constexpr int kTileBytesTarget = 32 * 1024;
constexpr int kRingBytesTarget = 64 * 1024;
constexpr int kTilesPerCta = 4;
using rope_norm::kCtasPerSm;

rope_norm::TileLayout plan_tiles(const RopeNormParams& p,
                                 const DeviceInfo& device) {
  rope_norm::TileLayout layout{};
  const int heads = p.num_q_heads + 2 * p.num_kv_heads;
  const int head_bytes = p.head_dim * 2;
  const int target_ctas = kCtasPerSm * device.sm_count;
  layout.cos_sin_bytes = p.rotary_dim * (p.cos_sin_is_fp32 ? 4 : 2);
  const int per_token = heads * head_bytes + layout.cos_sin_bytes + 8;
  // As many tokens as fit the target, but small enough that every CTA gets
  // several tiles while there are tokens to spread: a CTA's ring only
  // overlaps loads with compute across tiles.
  const int spread = (p.num_tokens + kTilesPerCta * target_ctas - 1) /
                     (kTilesPerCta * target_ctas);
  layout.tile_tokens =
      std::min({std::max(1, kTileBytesTarget / per_token), std::max(1, spread),
                rope_norm::kMaxTileTokens});
  const int token_tiles =
      (p.num_tokens + layout.tile_tokens - 1) / layout.tile_tokens;
  // Too few token tiles to fill the device: split each token's heads over
  // several CTAs, but never below one consumer step's worth of heads.
  const int heads_per_step =
      32 * rope_norm::kConsumerWarps / (p.head_dim / rope_norm::kLaneElems);
  const int max_chunks = (heads + heads_per_step - 1) / heads_per_step;
  const int chunks =
      std::clamp(target_ctas / token_tiles, 1, std::max(1, max_chunks));
  layout.heads_per_tile = (heads + chunks - 1) / chunks;
  layout.head_chunks =
      (heads + layout.heads_per_tile - 1) / layout.heads_per_tile;
  layout.row_bytes = layout.heads_per_tile * head_bytes;
  layout.num_tiles = token_tiles * layout.head_chunks;

  layout.stages = std::clamp(kRingBytesTarget / layout.stage_bytes(), 2,
                             rope_norm::kMaxStages);
  // Never more stages than the CTA has tiles to fill them with.
  const int ctas = std::min(layout.num_tiles, target_ctas);
  const int tiles_per_cta = (layout.num_tiles + ctas - 1) / ctas;
  layout.stages = std::max(1, std::min(layout.stages, tiles_per_cta));
  if (layout.bytes() > device.max_smem_per_block) {
    throw std::invalid_argument(
        "rope_norm: one token's QKV row (" + std::to_string(per_token) +
        " bytes) exceeds the device's shared memory per block");
  }
  return layout;
}

template <typename T, int kHeadDim>
void launch_typed(const RopeNormParams& params, cudaStream_t stream) {
  if (params.num_tokens == 0) return;
  const DeviceInfo& device = current_device_info();
  const rope_norm::TileLayout layout = plan_tiles(params, device);
  auto kernel = rope_norm::rope_norm_kernel<T, kHeadDim>;
  const int smem = layout.bytes();
  if (smem > 48 * 1024) {
    HPC_CUDA_CHECK(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  const int ctas = std::min(layout.num_tiles, kCtasPerSm * device.sm_count);
  launch_with_pdl(kernel, dim3(ctas), dim3(rope_norm::kThreadsPerBlock), smem,
                  stream, params, layout);
}

template <typename T>
void dispatch_head_dim(const RopeNormParams& params, cudaStream_t stream) {
  switch (params.head_dim) {
    case 64:
      return launch_typed<T, 64>(params, stream);
    case 128:
      return launch_typed<T, 128>(params, stream);
    case 256:
      return launch_typed<T, 256>(params, stream);
    default:
      throw std::invalid_argument("rope_norm: unsupported head_dim " +
                                  std::to_string(params.head_dim));
  }
}

}  // namespace

void launch_rope_norm(const RopeNormParams& params, cudaStream_t stream) {
  if (params.dtype == ScalarType::kBFloat16) {
    dispatch_head_dim<__nv_bfloat16>(params, stream);
  } else {
    dispatch_head_dim<__half>(params, stream);
  }
}

}  // namespace hpc
