// GPU prefill tile planner: one CTA evaluates prefill_plan.h for the whole
// batch. Passes, each spread over the block:
//   1. request_first_item: an exclusive prefix sum of the requests' m-block
//      counts, in chunks of blockDim.x requests, and the largest KV length;
//   2. a shared-memory histogram of the items' cost buckets;
//   3. a descending exclusive scan of the histogram (longest bucket first);
//   4. the scatter: each item takes a rank in its bucket from a shared
//      atomic cursor and writes its tile for every KV head.
// Items are dealt to threads round-robin, and a thread finds an item's
// request by binary search over request_first_item. No host synchronisation
// and no allocation, so the launch is CUDA-graph capturable; lengths may
// change between replays.
#include <cuda_runtime.h>

#include "attention/prefill/prefill_plan.h"
#include "common/cuda_check.h"
#include "common/pdl.cuh"

namespace hpc {
namespace prefill {
namespace {

constexpr int kPlannerThreads = 1024;
constexpr unsigned kFullMask = 0xffffffffu;

// Exclusive prefix sum over the block of one value per thread; `total`
// receives the sum of all values. blockDim.x must be a multiple of 32, and
// every thread of the block must call it.
__device__ int64_t block_scan(int64_t value, int64_t* warp_totals,
                              int64_t* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  int64_t inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t below = __shfl_up_sync(kFullMask, inclusive, d);
    if (lane >= d) inclusive += below;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int64_t sum = lane < num_warps ? warp_totals[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int64_t below = __shfl_up_sync(kFullMask, sum, d);
      if (lane >= d) sum += below;
    }
    if (lane < num_warps) warp_totals[lane] = sum;
  }
  __syncthreads();
  const int64_t warps_before = warp == 0 ? 0 : warp_totals[warp - 1];
  *total = warp_totals[num_warps - 1];
  __syncthreads();  // warp_totals is reused by the next call
  return warps_before + inclusive - value;
}

// The request owning flat item x < first_item[batch]: the largest b with
// first_item[b] <= x (requests without items share their successor's
// start, so the largest such b is the one that owns x).
__device__ int find_request(const int32_t* first_item, int batch, int x) {
  int lo = 0;
  int hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (first_item[mid] <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Leaves an empty plan and stops the launch: the workspace is too small for
// these lengths, and nothing past its end may be written.
__device__ void overflow(int32_t* plan) {
  plan[kNumTiles] = 0;
  __threadfence();
  __trap();
}

__global__ void __launch_bounds__(kPlannerThreads)
    plan_prefill_kernel(const int32_t* __restrict__ query_start_loc,
                        const int32_t* __restrict__ seq_lens,
                        const PlanArgs args, const PlanLayout layout,
                        int32_t* __restrict__ plan) {
  __shared__ int count[kCostBuckets];
  __shared__ int base[kCostBuckets];
  __shared__ int cursor[kCostBuckets];
  __shared__ int64_t warp_totals[32];
  __shared__ int max_kv_len;

  // This grid is launched in stream order after whatever wrote the lengths.
  // The attention kernel that follows (launched with PDL) may start its
  // prologue now; it reads the plan only after its griddepcontrol.wait,
  // which waits for this grid to finish.
  pdl_launch_dependents();

  const int tid = threadIdx.x;
  if (args.batch > layout.max_batch) {
    if (tid == 0) overflow(plan);
    return;
  }
  for (int k = tid; k < kCostBuckets; k += blockDim.x) {
    count[k] = 0;
    cursor[k] = 0;
  }
  if (tid == 0) max_kv_len = 0;
  __syncthreads();

  const int tile_tokens = tile_tokens_of(args.group);
  const int heads = args.num_kv_heads;
  int32_t* first_item = plan + layout.request_first_item();

  // 1. Prefix sum of m-blocks over the requests, chunk by chunk.
  int64_t items = 0;  // the same in every thread
  int local_max = 0;
  for (int chunk = 0; chunk < args.batch; chunk += blockDim.x) {
    const int b = chunk + tid;
    int blocks = 0;
    if (b < args.batch) {
      blocks = request_m_blocks(query_start_loc[b + 1] - query_start_loc[b],
                                tile_tokens);
      local_max = max(local_max, seq_lens[b]);
    }
    int64_t chunk_items;
    const int64_t before = block_scan(blocks, warp_totals, &chunk_items);
    if (b < args.batch) first_item[b] = static_cast<int32_t>(items + before);
    items += chunk_items;
  }
  local_max = __reduce_max_sync(kFullMask, local_max);
  if ((tid & 31) == 0) atomicMax(&max_kv_len, local_max);
  if (items * heads > layout.max_tiles) {
    if (tid == 0) overflow(plan);
    return;
  }
  if (tid == 0) first_item[args.batch] = static_cast<int32_t>(items);
  __syncthreads();  // first_item and max_kv_len are complete

  const int num_items = static_cast<int>(items);
  const int shift = cost_shift(max_kv_len);
  auto bucket_of = [&](int b, int m) {
    const int q_len = query_start_loc[b + 1] - query_start_loc[b];
    return tile_cost(q_len, seq_lens[b], m, tile_tokens) >> shift;
  };

  // 2. Histogram of the buckets.
  for (int x = tid; x < num_items; x += blockDim.x) {
    const int b = find_request(first_item, args.batch, x);
    atomicAdd(&count[bucket_of(b, x - first_item[b])], 1);
  }
  __syncthreads();

  // 3. base[k] = items in buckets above k: an exclusive scan over the
  // buckets in descending order, each thread taking a run of them.
  const int per_thread = (kCostBuckets + blockDim.x - 1) / blockDim.x;
  const int r_begin = min(kCostBuckets, tid * per_thread);
  const int r_end = min(kCostBuckets, r_begin + per_thread);
  int run = 0;
  for (int r = r_begin; r < r_end; ++r) run += count[kCostBuckets - 1 - r];
  int64_t all_items;
  int above = static_cast<int>(block_scan(run, warp_totals, &all_items));
  for (int r = r_begin; r < r_end; ++r) {
    base[kCostBuckets - 1 - r] = above;
    above += count[kCostBuckets - 1 - r];
  }
  __syncthreads();

  // 4. Scatter, KV-head-major inside each bucket.
  int32_t* tiles = plan + layout.tiles();
  for (int x = tid; x < num_items; x += blockDim.x) {
    const int b = find_request(first_item, args.batch, x);
    const int m = x - first_item[b];
    const int bucket = bucket_of(b, m);
    const int rank = atomicAdd(&cursor[bucket], 1);
    const int n = count[bucket];
    const int first = base[bucket] * heads + rank;
    for (int h = 0; h < heads; ++h) {
      pack_tile(tiles + 2 * static_cast<int64_t>(first + h * n), b, m, h);
    }
  }

  if (tid == 0) {
    plan[kNumTiles] = num_items * heads;
    plan[kTileTokens] = tile_tokens;
    plan[kNumKvHeads] = heads;
    plan[kBatch] = args.batch;
    plan[kMaxBatch] = layout.max_batch;
    plan[kMaxTiles] = layout.max_tiles;
    plan[kCostShift] = shift;
    plan[kHeaderSize - 1] = 0;
  }
}

}  // namespace

void plan_prefill_device(const int32_t* query_start_loc,
                         const int32_t* seq_lens, const PlanArgs& args,
                         const PlanLayout& layout, int32_t* plan,
                         cudaStream_t stream) {
  plan_prefill_kernel<<<1, kPlannerThreads, 0, stream>>>(
      query_start_loc, seq_lens, args, layout, plan);
  HPC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace prefill
}  // namespace hpc
