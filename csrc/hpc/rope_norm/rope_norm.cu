// Host dispatch of the fused prologue: picks the instantiation for the model
// dtype and head size and launches it with programmatic dependent launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "common/pdl.cuh"
#include "rope_norm/rope_norm.h"
#include "rope_norm/rope_norm_kernel.cuh"

namespace hpc {

namespace {

// Heads each lane group handles: two independent 16-byte loads in flight per
// thread hide HBM latency better than one, at a modest register cost.
constexpr int kItemsPerGroup = 2;

template <typename T, int kHeadDim>
void launch_typed(const RopeNormParams& params, cudaStream_t stream) {
  constexpr int kItemsPerBlock =
      rope_norm::kThreadsPerBlock / (kHeadDim / kVecElems) * kItemsPerGroup;
  const int64_t items = static_cast<int64_t>(params.num_tokens) *
                        (params.num_q_heads + 2 * params.num_kv_heads);
  const int64_t blocks = (items + kItemsPerBlock - 1) / kItemsPerBlock;
  if (blocks == 0) return;
  if (blocks > INT32_MAX)
    throw std::invalid_argument("rope_norm: too many tokens");
  launch_with_pdl(rope_norm::rope_norm_kernel<T, kHeadDim, kItemsPerGroup>,
                  dim3(static_cast<unsigned>(blocks)),
                  dim3(rope_norm::kThreadsPerBlock), 0, stream, params);
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
