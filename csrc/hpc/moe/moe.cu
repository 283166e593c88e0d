// Host side of the fused FP8 MoE pipeline: the stages in stream order, each
// chained to the previous one with programmatic dependent launch. A few
// tokens take the decode path; more, route + grouped GEMMs + reduce (a
// small batch without the route: slot tiles, moe_tiles.cuh).
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "common/device_info.h"
#include "common/pdl.cuh"
#include "common/smem_config.h"
#include "kernel_limits.h"
#include "moe/moe.h"
#include "moe/moe_decode_down.cuh"
#include "moe/moe_decode_gate_up.cuh"
#include "moe/moe_gemm.h"
#include "moe/moe_quantize.cuh"
#include "moe/moe_reduce.cuh"
#include "moe/moe_route.cuh"

namespace hpc {
namespace moe {

namespace {

void launch_quantize(const MoeParams& p, cudaStream_t stream) {
  if (!quantize_stage_runs(p)) return;
  // At most one resident wave (moe_quantize_kernel loops over the rest).
  static const int ctas_per_sm = [] {
    int n = 0;
    HPC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, moe_quantize_kernel, kQuantWarps * 32, 0));
    return std::max(n, 1);
  }();
  const int64_t ctas = ceil_div(p.num_tokens, kQuantTokensPerCta);
  const int64_t resident =
      int64_t(ctas_per_sm) * current_device_info().sm_count;
  launch_with_pdl(moe_quantize_kernel, dim3(std::min(ctas, resident)),
                  dim3(kQuantWarps * 32), 0, stream, p);
}

// gate-up (quantizing a 16-bit input itself) -> down.
void launch_decode(const MoeParams& p, cudaStream_t stream) {
  // A gate-up warp holds the weight scales of its K groups, one per lane.
  if (p.hidden / kScaleBlock > 32 * kDecodeWarps) {
    throw std::invalid_argument("fused_moe_fp8: hidden size too large");
  }
  const int gate_up_smem = gate_up_smem_layout(p.num_tokens, p.hidden).bytes();
  const int down_smem = DownSmemLayout{p.topk, p.inter}.bytes();
  configure_smem(moe_decode_gate_up_kernel, gate_up_smem, "fused_moe_fp8");
  configure_smem(moe_decode_down_kernel, down_smem, "fused_moe_fp8");
  launch_with_pdl(moe_decode_gate_up_kernel,
                  dim3(p.inter / kDecodeColumns, p.num_tokens * p.topk),
                  dim3(kDecodeThreads), gate_up_smem, stream, p);
  launch_with_pdl(moe_decode_down_kernel,
                  dim3(p.num_tokens, p.hidden / kDecodeDownRows),
                  dim3(kDecodeThreads), down_smem, stream, p);
}

}  // namespace

void fused_moe_fp8(const MoeParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return;
  if (p.hidden % limits::kMoeHiddenAlign != 0 ||
      p.inter % limits::kMoeIntermediateAlign != 0 ||
      (p.block_wise && p.inter % kScaleBlock != 0)) {
    throw std::invalid_argument("fused_moe_fp8: unsupported hidden/inter size");
  }
  if (p.topk < 1 || p.topk > kMaxTopk) {
    throw std::invalid_argument("fused_moe_fp8: topk must be in [1, " +
                                std::to_string(kMaxTopk) + "]");
  }
  if (p.tiling.decode) {
    launch_decode(p, stream);
    return;
  }
  if (!p.tiling.slot_tiles) {
    const dim3 grid(
        static_cast<unsigned>(route_ctas(int64_t(p.num_tokens) * p.topk)));
    if (grid.x > 1) {
      launch_with_pdl(moe_route_count_kernel, grid, dim3(kRouteThreads),
                      p.num_experts * sizeof(int), stream, p);
    }
    launch_with_pdl(moe_route_place_kernel, grid, dim3(kRouteThreads),
                    3 * p.num_experts * sizeof(int), stream, p);
  }
  launch_quantize(p, stream);
  launch_gate_up_gemm(p, stream);
  launch_down_gemm(p, stream);
  launch_with_pdl(moe_reduce_kernel,
                  dim3(p.num_tokens, static_cast<unsigned>(
                                         ceil_div(p.hidden, kReduceChannels))),
                  dim3(kReduceThreads), 0, stream, p);
}

}  // namespace moe
}  // namespace hpc
