// Host side of the fused FP8 MoE pipeline: launch configuration of each
// stage and the PDL chain.
#include <stdexcept>

#include "common/cuda_check.h"
#include "common/pdl.cuh"
#include "moe/moe.h"
#include "moe/moe_kernels.cuh"

namespace hpc {
namespace moe {

namespace {

template <bool kGateUp, int kCols>
void launch_gemm(const MoeParams& p, int n_total, cudaStream_t stream) {
  constexpr int kRowsB = kGateUp ? 2 * kCols : kCols;
  constexpr int kSmem = kGemmStages * (kTileM + kRowsB) * kRowPitch;
  auto kernel = moe_gemm_kernel<kGateUp, kCols>;
  HPC_CUDA_CHECK(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  // Tiles of 64 rows per expert: at most ceil(rows / 64) + experts; CTAs
  // past the planned tiles return at once.
  const int rows = p.num_tokens * p.topk;
  const int tiles = (rows + kTileM - 1) / kTileM + p.num_experts;
  launch_with_pdl(kernel, dim3(tiles, n_total / kCols), dim3(kGemmThreads),
                  kSmem, stream, p);
}

}  // namespace

void fused_moe_fp8(const MoeParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return;
  if (p.hidden % kScaleBlock != 0 || p.inter % 64 != 0 ||
      (p.block_wise && p.inter % kScaleBlock != 0)) {
    throw std::invalid_argument("fused_moe_fp8: unsupported hidden/inter size");
  }
  launch_with_pdl(moe_route_kernel, dim3(1), dim3(kRouteThreads),
                  2 * p.num_experts * sizeof(int), stream, p);
  if (p.input_type == ElemType::kBf16) {
    launch_with_pdl(moe_quantize_kernel<__nv_bfloat16>,
                    dim3((p.num_tokens + kQuantWarps - 1) / kQuantWarps),
                    dim3(kQuantWarps * 32), 0, stream, p);
  } else if (p.input_type == ElemType::kFp16) {
    launch_with_pdl(moe_quantize_kernel<__half>,
                    dim3((p.num_tokens + kQuantWarps - 1) / kQuantWarps),
                    dim3(kQuantWarps * 32), 0, stream, p);
  }
  // Block-wise: a CTA owns whole 1 x 128 groups of the intermediate.
  if (p.block_wise) {
    launch_gemm<true, 128>(p, p.inter, stream);
  } else {
    launch_gemm<true, 64>(p, p.inter, stream);
  }
  launch_gemm<false, 128>(p, p.hidden, stream);
  launch_with_pdl(moe_reduce_kernel, dim3(p.num_tokens), dim3(kReduceThreads),
                  0, stream, p);
}

}  // namespace moe
}  // namespace hpc
