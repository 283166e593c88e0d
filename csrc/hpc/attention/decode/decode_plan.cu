// GPU split-KV decode planner: one CTA evaluates decode_plan.h for all units
// with two block-wide prefix sums (granule offsets, partial rows), then one
// binary search and one work-item resolution per CTA slot, so its cost is
// O(batch + CTAs) with no serial walk and no inter-CTA waiting. Lengths may
// change between CUDA-graph replays.
#include <cuda_runtime.h>

#include "attention/decode/decode_plan.h"
#include "common/pdl.cuh"

namespace hpc {
namespace decode {
namespace {

constexpr int kMaxPlannerThreads = 1024;

// Exclusive prefix sum of one int per thread over the block; `total`
// receives the block's sum. Every thread of the block must call it.
__device__ int block_exclusive_sum(int value, int* warp_sums, int* total) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int num_warps = (blockDim.x + 31) / 32;
  int inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int sum = lane < num_warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int other = __shfl_up_sync(0xffffffffu, sum, offset);
      if (lane >= offset) sum += other;
    }
    if (lane < num_warps) warp_sums[lane] = sum;  // inclusive over warps
  }
  __syncthreads();
  const int before = warp == 0 ? 0 : warp_sums[warp - 1];
  *total = warp_sums[num_warps - 1];
  __syncthreads();  // warp_sums may be reused by the next call
  return before + inclusive - value;
}

// The unit holding granule x: the largest u with offset[u] <= x.
__device__ int find_unit(const int32_t* offset, int num_units, int x) {
  int lo = 0, hi = num_units - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offset[mid] <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__global__ void __launch_bounds__(kMaxPlannerThreads)
    plan_decode_kernel(const int32_t* __restrict__ kv_lens,
                       const PlanArgs request, const PlanLayout layout,
                       int32_t* __restrict__ plan) {
  __shared__ int warp_sums[32];
  __shared__ int max_unit_tiles;
  if (threadIdx.x == 0) max_unit_tiles = 0;
  __syncthreads();
  pdl_launch_dependents();
  pdl_wait_for_producer();  // lengths may be written by the previous kernel

  const int num_units = request.batch * request.num_kv_heads;
  const int per_thread = (num_units + blockDim.x - 1) / blockDim.x;
  const int u_begin =
      min(num_units, static_cast<int>(threadIdx.x) * per_thread);
  const int u_end = min(num_units, u_begin + per_thread);
  auto tiles_of = [&](int u) {
    return unit_tiles(kv_lens[u % request.batch], request.query_tokens,
                      request.window);
  };

  // The step's cut (the host planner's step_cut): the balanced plan's CTAs
  // from the tiles and the longest unit, then its unit-aligned form.
  int local = 0;
  int local_max_tiles = 0;
  for (int u = u_begin; u < u_end; ++u) {
    local += tiles_of(u);
    local_max_tiles = max(local_max_tiles, tiles_of(u));
  }
  atomicMax(&max_unit_tiles, local_max_tiles);
  int tiles_total = 0;  // (block_exclusive_sum's barriers order the maximum)
  block_exclusive_sum(local, warp_sums, &tiles_total);
  const int balanced_ctas = ctas_used(
      tiles_total, request.ctas_offered,
      balanced_min_tiles(request, max_unit_tiles), SplitMode::kBalanced);
  PlanArgs args = request;
  if (request.mode == SplitMode::kBalanced && balanced_ctas > 0) {
    const int l0 = (tiles_total + balanced_ctas - 1) / balanced_ctas;
    const int split = aligned_split_tiles(l0, balanced_ctas, [&](int s) {
      int mine = 0;
      for (int u = u_begin; u < u_end; ++u) mine += (tiles_of(u) + s - 1) / s;
      int pieces = 0;
      block_exclusive_sum(mine, warp_sums, &pieces);
      return static_cast<int64_t>(pieces);
    });
    if (split > 0) {
      args.mode = SplitMode::kBatchInvariant;
      args.split_tiles = split;
      args.ctas_offered = balanced_ctas;
    }
  }
  auto granules_of = [&](int u) {
    return unit_granules(tiles_of(u), args.mode, args.split_tiles);
  };

  int32_t* offset = plan + layout.unit_granule_offset();
  local = 0;
  for (int u = u_begin; u < u_end; ++u) local += granules_of(u);
  int total = 0;
  int running = block_exclusive_sum(local, warp_sums, &total);
  for (int u = u_begin; u < u_end; ++u) {
    offset[u] = running;
    running += granules_of(u);
  }
  if (threadIdx.x == 0) offset[num_units] = total;
  const int num_ctas =
      ctas_used(total, args.ctas_offered,
                balanced_min_tiles(args, max_unit_tiles), args.mode);
  __syncthreads();  // every offset is visible to the block

  int32_t* num_pieces = plan + layout.unit_num_pieces();
  int32_t* first_partial = plan + layout.unit_first_partial();
  auto pieces_of = [&](int u) {
    return num_ctas == 0 ? 0
                         : unit_pieces(offset[u], offset[u + 1] - offset[u],
                                       total, num_ctas, args.mode);
  };
  local = 0;
  for (int u = u_begin; u < u_end; ++u) {
    const int pieces = pieces_of(u);
    if (pieces > 1) local += pieces;
  }
  int partials = 0;
  running = block_exclusive_sum(local, warp_sums, &partials);
  for (int u = u_begin; u < u_end; ++u) {
    const int pieces = pieces_of(u);
    num_pieces[u] = pieces;
    first_partial[u] = pieces > 1 ? running : -1;
    if (pieces > 1) running += pieces;
  }

  __syncthreads();  // every unit's pieces and partial row are visible

  // One thread per CTA slot: its range, first unit and first work item.
  // Every slot is rewritten, so that a slot idle in this plan never keeps
  // the work of an earlier, larger one.
  int32_t* begin = plan + layout.cta_granule_begin();
  int32_t* first_unit = plan + layout.cta_first_unit();
  const ItemSource source{
      plan,        layout,    kv_lens,          args.batch, args.query_tokens,
      args.window, args.mode, args.split_tiles, total,      num_ctas};
  for (int c = threadIdx.x; c < layout.max_ctas; c += blockDim.x) {
    if (c >= num_ctas) {
      store_cta_item(plan, layout, c, nullptr);
      continue;
    }
    const int x = static_cast<int>(cta_begin(c, total, num_ctas));
    const int end = static_cast<int>(cta_begin(c + 1, total, num_ctas));
    int u = find_unit(offset, num_units, x);
    begin[c] = x;
    first_unit[c] = u;
    if (x < end) {
      WorkItem item;
      resolve_item(source, c, x, end, u, item);
      store_cta_item(plan, layout, c, &item);
    } else {
      store_cta_item(plan, layout, c, nullptr);
    }
  }
  if (threadIdx.x == 0) {
    begin[num_ctas] = total;
    plan[kNumUnits] = num_units;
    plan[kTotalGranules] = total;
    plan[kNumCtas] = num_ctas;
    plan[kNumPartials] = partials;
    plan[kSplitTiles] =
        args.mode == SplitMode::kBatchInvariant ? args.split_tiles : 0;
    plan[kQueryTokens] = args.query_tokens;
    plan[kMode] = static_cast<int32_t>(args.mode);
    plan[kWindow] = args.window;
  }
}

}  // namespace

void plan_decode_device(const int32_t* kv_lens, const PlanArgs& args,
                        const PlanLayout& layout, int32_t* plan,
                        cudaStream_t stream) {
  const int num_units = args.batch * args.num_kv_heads;
  int threads = ((num_units + 31) / 32) * 32;
  if (threads < 128) threads = 128;
  if (threads > kMaxPlannerThreads) threads = kMaxPlannerThreads;
  launch_with_pdl(plan_decode_kernel, dim3(1), dim3(threads), 0, stream,
                  kv_lens, args, layout, plan);
}

}  // namespace decode
}  // namespace hpc
