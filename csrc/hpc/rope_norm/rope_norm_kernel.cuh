// Device code of the fused prologue.
//
// Work decomposition: tokens are cut into tiles of consecutive tokens that
// persistent CTAs take in turn. In each CTA one producer warp moves a tile's
// packed QKV rows, and each token's cos/sin row, into a ring of shared-memory
// stages with the bulk-copy engine (cp.async.bulk completing on mbarriers), so
// several tiles of HBM reads are in flight without holding them in registers.
// The consumer warps process a tile as (token, head) pairs, one per "head
// group" of head_dim / 8 lanes: each lane holds 8 contiguous channels,
// reductions (RMSNorm, FP8 amax) are shuffles inside the group, the NeoX
// rotation partner of a lane is another lane of the group, and results go
// straight to the outputs with 16-byte stores. Work is indexed by token, never
// by request, so prefill and decode batches of the same size cost the same.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cute/arch/copy_sm90_tma.hpp>

#include "common/pdl.cuh"
#include "common/vec.cuh"
#include "rope_norm/rope_norm.h"

namespace hpc {
namespace rope_norm {

__device__ __forceinline__ int64_t load_index(const void* ptr, bool is_int64,
                                              int i) {
  return is_int64 ? static_cast<const int64_t*>(ptr)[i]
                  : static_cast<int64_t>(static_cast<const int32_t*>(ptr)[i]);
}

// Sum over the kLanes lanes of a head group (aligned groups inside a warp).
template <int kLanes>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

template <int kLanes>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// RMSNorm of the head held by a lane group, in place where `apply` is set.
// Every lane of the warp must call this (the sum is a group shuffle); lanes of
// V heads pass apply = false and keep their values.
template <int kLanes>
__device__ __forceinline__ void rms_norm(float (&x)[kVecElems],
                                         const float* weight, float eps,
                                         bool apply) {
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) sum_sq += x[i] * x[i];
  sum_sq = group_sum<kLanes>(sum_sq);
  if (!apply) return;
  const float inv_rms = rsqrtf(sum_sq / (kLanes * kVecElems) + eps);
  const float4 w0 = reinterpret_cast<const float4*>(weight)[0];
  const float4 w1 = reinterpret_cast<const float4*>(weight)[1];
  const float w[kVecElems] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) x[i] = x[i] * inv_rms * w[i];
}

// Reads the 8 cos and 8 sin values a lane needs from one cos/sin row (cos
// half then sin half). NeoX lanes pair channel c with c + rotary_dim / 2 at
// frequency c mod (rotary_dim / 2); GPT-J lanes rotate (2i, 2i + 1) at
// frequency i, so only 4 of the values are used.
template <typename C>
__device__ __forceinline__ void read_cos_sin(const C* row, int rotary_dim,
                                             bool is_neox, int first,
                                             float (&cos_v)[kVecElems],
                                             float (&sin_v)[kVecElems]) {
  const int half = rotary_dim / 2;
  if (is_neox) {
    const int freq = first < half ? first : first - half;
#pragma unroll
    for (int i = 0; i < kVecElems; ++i) {
      cos_v[i] = to_float(row[freq + i]);
      sin_v[i] = to_float(row[half + freq + i]);
    }
  } else {
    const int freq = first / 2;
#pragma unroll
    for (int i = 0; i < kVecElems / 2; ++i) {
      cos_v[i] = to_float(row[freq + i]);
      sin_v[i] = to_float(row[half + freq + i]);
    }
  }
}

// Rotates the lane's channels in place. Every lane of the warp must call this
// (the NeoX partner exchange is a shuffle); `rotates` says whether this
// lane's channels lie inside rotary_dim for a Q/K head.
template <int kLanes>
__device__ __forceinline__ void apply_rope(float (&x)[kVecElems],
                                           const RopeNormParams& p, int lane,
                                           bool rotates,
                                           const float (&cos_v)[kVecElems],
                                           const float (&sin_v)[kVecElems]) {
  const int half = p.rotary_dim / 2;
  const int first = lane * kVecElems;
  if (p.is_neox) {
    // Channel c < half pairs with c + half; both halves are whole lanes
    // because rotary_dim is a multiple of 16.
    const int lane_shift = half / kVecElems;
    const bool low = first < half;
    const int partner = first < p.rotary_dim
                            ? (low ? lane + lane_shift : lane - lane_shift)
                            : lane;
    const int src = (threadIdx.x % 32) - lane + partner;
    float other[kVecElems];
#pragma unroll
    for (int i = 0; i < kVecElems; ++i) {
      other[i] = __shfl_sync(0xffffffffu, x[i], src);
    }
    if (!rotates) return;
    const float sign = low ? -1.f : 1.f;
#pragma unroll
    for (int i = 0; i < kVecElems; ++i) {
      x[i] = x[i] * cos_v[i] + sign * other[i] * sin_v[i];
    }
  } else if (rotates) {
#pragma unroll
    for (int i = 0; i < kVecElems / 2; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      x[2 * i] = a * cos_v[i] - b * sin_v[i];
      x[2 * i + 1] = b * cos_v[i] + a * sin_v[i];
    }
  }
}

// Shared memory of the token-tile pipeline: `stages` buffers, each holding
//   [tile_tokens x row_bytes]      packed QKV rows
//   [tile_tokens x cos_sin_bytes]  cos/sin rows at the tokens' positions
//   [tile_tokens x 8]              each token's K/V cache offset (-1: padding)
// Offsets inside a stage are 16-byte aligned: row and cos/sin sizes are
// multiples of 16.
struct TileLayout {
  int tile_tokens;    // <= 32: one producer lane per token
  int row_bytes;      // (num_q_heads + 2 * num_kv_heads) * head_dim * 2
  int cos_sin_bytes;  // rotary_dim * sizeof(cos/sin element)
  int stages;         // <= kMaxStages
  int num_tiles;

  __host__ __device__ int cos_sin_offset() const {
    return tile_tokens * row_bytes;
  }
  __host__ __device__ int cache_offsets_offset() const {
    return tile_tokens * (row_bytes + cos_sin_bytes);
  }
  // Rounded up so that every stage starts 128-byte aligned, as the bulk
  // copies into it require (16 bytes at least).
  __host__ __device__ int stage_bytes() const {
    const int bytes = cache_offsets_offset() +
                      tile_tokens * static_cast<int>(sizeof(int64_t));
    return (bytes + 127) / 128 * 128;
  }
  __host__ __device__ int bytes() const { return stages * stage_bytes(); }
};

constexpr int kMaxStages = 4;
constexpr int kMaxTileTokens = 32;
constexpr int kConsumerWarps = 8;
constexpr int kThreadsPerBlock = 32 * (1 + kConsumerWarps);
// Resident CTAs per SM: 24 consumer warps per SM hide the latency of the
// per-head shuffle chains; the register cap this sets (~70) is spill-free.
constexpr int kCtasPerSm = 3;

// Producer side (warp 0): for each of the CTA's tiles, waits for a free stage,
// then moves the QKV rows (lane 0) and each token's cos/sin row (one lane per
// token) into it with the bulk-copy engine, and records where each token's
// K/V rows go in the cache (the slot arithmetic is done once per token here,
// not once per head and lane by the consumers).
// Positions and slots of the next tile are loaded while the current one is
// issued, so the warp never waits on them serially.
template <typename T>
__device__ __forceinline__ void produce_tiles(const RopeNormParams& p,
                                              const TileLayout& layout,
                                              uint8_t* smem, uint64_t* full,
                                              uint64_t* empty) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  const int lane = threadIdx.x % 32;
  auto token_index = [&](int tile) {
    const int token = tile * layout.tile_tokens + lane;
    return lane < layout.tile_tokens && token < p.num_tokens ? token : -1;
  };
  auto load_position = [&](int token) -> int64_t {
    if (token < 0) return 0;
    // Clamped so a stale position of a padding token cannot read outside
    // the cos/sin cache.
    const int64_t position =
        load_index(p.positions, p.positions_are_int64, token);
    return min(max(position, int64_t{0}),
               static_cast<int64_t>(p.max_position - 1));
  };
  auto load_slot = [&](int token) -> int64_t {
    return token < 0 ? -1
                     : load_index(p.slot_mapping, p.slots_are_int64, token);
  };

  int tile = blockIdx.x;
  int token = token_index(tile);
  int64_t position = load_position(token);
  int64_t slot = load_slot(token);
  for (int i = 0; tile < layout.num_tiles; ++i, tile += gridDim.x) {
    const int next_token = token_index(tile + gridDim.x);
    const int64_t next_position = load_position(next_token);
    const int64_t next_slot = load_slot(next_token);

    const int stage = i % layout.stages;
    Barrier::wait(&empty[stage], ((i / layout.stages) & 1) ^ 1);
    uint8_t* buffer = smem + stage * layout.stage_bytes();
    const int first = tile * layout.tile_tokens;
    const int tokens = min(layout.tile_tokens, p.num_tokens - first);
    if (lane == 0) {
      Barrier::expect_transaction(
          &full[stage], tokens * (layout.row_bytes + layout.cos_sin_bytes));
      const T* rows = static_cast<const T*>(p.qkv) + first * p.qkv_row_stride;
      if (p.qkv_row_stride * static_cast<int64_t>(sizeof(T)) ==
          layout.row_bytes) {
        cute::SM90_BULK_COPY_G2S::copy(rows, &full[stage], buffer,
                                       tokens * layout.row_bytes);
      } else {
        for (int t = 0; t < tokens; ++t) {
          cute::SM90_BULK_COPY_G2S::copy(
              rows + t * p.qkv_row_stride, &full[stage],
              buffer + t * layout.row_bytes, layout.row_bytes);
        }
      }
    }
    __syncwarp();  // the expected bytes are set before any copy can land
    if (token >= 0) {
      reinterpret_cast<int64_t*>(buffer + layout.cache_offsets_offset())[lane] =
          slot < 0 ? -1
                   : (slot / p.block_size) * p.cache_block_stride +
                         (slot % p.block_size) * p.cache_token_stride;
      cute::SM90_BULK_COPY_G2S::copy(
          static_cast<const uint8_t*>(p.cos_sin_cache) +
              position * layout.cos_sin_bytes,
          &full[stage],
          buffer + layout.cos_sin_offset() + lane * layout.cos_sin_bytes,
          layout.cos_sin_bytes);
    }
    // The arrive releases the offset stores of the whole warp (ordered before
    // it by the warp barrier) to the consumers that wait on this phase.
    __syncwarp();
    if (lane == 0) Barrier::arrive(&full[stage]);

    token = next_token;
    position = next_position;
    slot = next_slot;
  }
}

// Consumer side: one tile, already in shared memory. A head group handles
// one (token, head) pair per step; every group runs the same number of steps
// so the shuffles inside norm, rope and amax always see converged warps
// (idle groups compute on stale data and store nothing).
template <typename T, int kHeadDim>
__device__ __forceinline__ void process_tile(
    const RopeNormParams& p, const TileLayout& layout, const uint8_t* buffer,
    int first_token, int tokens, const float* norm_weights, float k_scale_inv,
    float v_scale_inv) {
  constexpr int kLanes = kHeadDim / kVecElems;
  constexpr int kGroups = 32 * kConsumerWarps / kLanes;
  const int consumer = threadIdx.x - 32;
  const int lane = consumer % kLanes;
  const int first_channel = lane * kVecElems;
  const int heads_per_token = p.num_q_heads + 2 * p.num_kv_heads;
  const int tasks = tokens * heads_per_token;
  const int64_t* cache_offsets =
      reinterpret_cast<const int64_t*>(buffer + layout.cache_offsets_offset());

  // (t, head) of this group's task, advanced by kGroups tasks per step
  // without a division per step.
  const int group = consumer / kLanes;
  int step_t = group / heads_per_token;
  int step_head = group % heads_per_token;
  for (int base = 0; base < tasks; base += kGroups) {
    if (base > 0) {
      step_head += kGroups;
      while (step_head >= heads_per_token) {
        step_head -= heads_per_token;
        ++step_t;
      }
    }
    const bool active = base + group < tasks;
    const int t = active ? step_t : 0;
    const int head = active ? step_head : 0;
    const bool is_q = head < p.num_q_heads;
    const bool is_v = head >= p.num_q_heads + p.num_kv_heads;
    const bool rotates = active && !is_v && first_channel < p.rotary_dim;

    float x[kVecElems];
    const uint4 raw = *reinterpret_cast<const uint4*>(
        buffer + t * layout.row_bytes +
        (head * kHeadDim + first_channel) * static_cast<int>(sizeof(T)));
    unpack8(reinterpret_cast<const T*>(&raw), x);

    float cos_v[kVecElems], sin_v[kVecElems];
    if (rotates) {
      const uint8_t* row =
          buffer + layout.cos_sin_offset() + t * layout.cos_sin_bytes;
      if (p.cos_sin_is_fp32) {
        read_cos_sin(reinterpret_cast<const float*>(row), p.rotary_dim,
                     p.is_neox, first_channel, cos_v, sin_v);
      } else {
        read_cos_sin(reinterpret_cast<const T*>(row), p.rotary_dim, p.is_neox,
                     first_channel, cos_v, sin_v);
      }
    }
    // Norm and rope work in place on Q/K heads; V heads pass through
    // unchanged. Warps holding only V heads (or idle groups) skip both: the
    // vote is warp-uniform, so the shuffles inside stay converged.
    if (__any_sync(0xffffffffu, active && !is_v)) {
      const float* w = norm_weights + (is_q ? 0 : kHeadDim) + first_channel;
      if (p.norm_policy == QkNormPolicy::kNormThenRope) {
        rms_norm<kLanes>(x, w, p.eps, !is_v);
      }
      apply_rope<kLanes>(x, p, lane, rotates, cos_v, sin_v);
      if (p.norm_policy == QkNormPolicy::kRopeThenNorm) {
        rms_norm<kLanes>(x, w, p.eps, !is_v);
      }
    }

    // FP8 Q: per-token-per-head scale from the head's amax. The reduction
    // runs on every lane (p.q_out_is_fp8 is uniform) before any branch on the
    // head kind.
    float amax = 0.f;
    if (p.q_out_is_fp8) {
#pragma unroll
      for (int e = 0; e < kVecElems; ++e) amax = fmaxf(amax, fabsf(x[e]));
      amax = group_max<kLanes>(amax);
    }
    if (!active) continue;

    const int token = first_token + t;
    if (is_q) {
      const int64_t row = static_cast<int64_t>(token) * p.num_q_heads + head;
      const int64_t offset = row * kHeadDim + first_channel;
      if (p.q_out_is_fp8) {
        store8_fp8(static_cast<uint8_t*>(p.q_out) + offset, x,
                   amax > 0.f ? kFp8E4m3Max / amax : 0.f);
        if (lane == 0) p.q_scale[row] = amax / kFp8E4m3Max;
      } else {
        store8(static_cast<T*>(p.q_out) + offset, x);
      }
      continue;
    }
    const int64_t token_offset = cache_offsets[t];
    if (token_offset < 0) continue;  // padding token: no cache write
    const int kv_head = head - p.num_q_heads - (is_v ? p.num_kv_heads : 0);
    const int64_t offset =
        token_offset + kv_head * p.cache_head_stride + first_channel;
    void* cache = is_v ? p.value_cache : p.key_cache;
    if (p.cache_is_fp8) {
      store8_fp8(static_cast<uint8_t*>(cache) + offset, x,
                 is_v ? v_scale_inv : k_scale_inv);
    } else {
      store8(static_cast<T*>(cache) + offset, x);
    }
  }
}

// Persistent CTAs: warp 0 produces token tiles into a ring of shared-memory
// stages, the other warps consume them, so the next tiles' HBM reads are
// always in flight while the current one is computed and stored.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreadsPerBlock, kCtasPerSm)
    rope_norm_kernel(const __grid_constant__ RopeNormParams p,
                     const TileLayout layout) {
  static_assert(kHeadDim / kVecElems <= 32 && 32 % (kHeadDim / kVecElems) == 0,
                "a head must fit in a warp");
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ uint64_t empty[kMaxStages];

  // Q then K norm weights as fp32. They are model parameters, not outputs of
  // the previous kernel, so they load before the PDL wait.
  __shared__ __align__(16) float norm_weights[2 * kHeadDim];
  if (p.norm_policy != QkNormPolicy::kNone) {
    for (int i = threadIdx.x; i < 2 * kHeadDim; i += blockDim.x) {
      const void* weight = i < kHeadDim ? p.q_norm_weight : p.k_norm_weight;
      const int c = i % kHeadDim;
      norm_weights[i] = p.norm_weight_is_fp32
                            ? static_cast<const float*>(weight)[c]
                            : to_float(static_cast<const T*>(weight)[c]);
    }
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < layout.stages; ++s) {
      Barrier::init(&full[s], 1);
      Barrier::init(&empty[s], kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // Inputs may be produced by the previous kernel (the QKV projection).
  pdl_wait_for_producer();
  pdl_launch_dependents();

  if (threadIdx.x < 32) {
    produce_tiles<T>(p, layout, smem, full, empty);
    return;
  }
  const float k_scale_inv = p.cache_is_fp8 ? 1.f / *p.k_scale : 1.f;
  const float v_scale_inv = p.cache_is_fp8 ? 1.f / *p.v_scale : 1.f;
  int i = 0;
  for (int tile = blockIdx.x; tile < layout.num_tiles; tile += gridDim.x, ++i) {
    const int stage = i % layout.stages;
    Barrier::wait(&full[stage], (i / layout.stages) & 1);
    const int first = tile * layout.tile_tokens;
    process_tile<T, kHeadDim>(p, layout, smem + stage * layout.stage_bytes(),
                              first,
                              min(layout.tile_tokens, p.num_tokens - first),
                              norm_weights, k_scale_inv, v_scale_inv);
    __syncwarp();
    if (threadIdx.x % 32 == 0) Barrier::arrive(&empty[stage]);
  }
}

}  // namespace rope_norm
}  // namespace hpc
