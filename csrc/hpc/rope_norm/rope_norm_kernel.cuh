// Device code of the fused prologue.
//
// Work decomposition: tokens are cut into tiles of consecutive tokens that
// persistent CTAs take in turn. In each CTA one producer warp moves a tile's
// packed QKV rows, and each token's cos/sin row, into a ring of shared-memory
// stages with the bulk-copy engine (cp.async.bulk completing on mbarriers), so
// several tiles of HBM reads are in flight without holding them in registers.
// The consumer warps process a tile as (token, head) pairs, one per "head
// group" of head_dim / 16 lanes. Each lane holds two 8-channel chunks of the
// head, chosen so that NeoX rotation partners (c, c + rotary_dim / 2) sit in
// the same thread: rope needs no data exchange, and only the reductions
// (RMSNorm, FP8 amax) shuffle inside the group. Results go straight to the
// outputs with 16-byte stores. Small batches split a token's heads over
// several CTAs so that every SM gets work. Work is indexed by token, never by
// request, so prefill and decode batches of the same size cost the same.
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

// Reductions over the kLanes lanes of a head group (aligned groups inside a
// warp). Every lane of the warp must take part.
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

// The two 8-channel chunks of a head that one lane holds. Under NeoX the
// rotary chunks pair as (c, c + rotary_dim / 16) so each rotation partner is
// in the same thread; the chunks past rotary_dim pair up in order. GPT-J
// rotates inside each chunk, so a lane takes two neighbouring chunks.
struct LaneChunks {
  int lo;       // first chunk (channels lo * 8 .. lo * 8 + 7)
  int hi;       // second chunk
  bool rotary;  // both chunks lie inside rotary_dim
  int freq;     // first cos/sin frequency the lane uses

  __device__ LaneChunks(int lane, int rotary_dim, bool is_neox) {
    const int rotary_chunks = rotary_dim / kVecElems;
    if (is_neox) {
      const int half = rotary_chunks / 2;
      rotary = lane < half;
      lo = rotary ? lane : rotary_chunks + 2 * (lane - half);
      hi = rotary ? lane + half : lo + 1;
      freq = lo * kVecElems;
    } else {
      lo = 2 * lane;
      hi = lo + 1;
      rotary = lo < rotary_chunks;  // rotary_chunks is even
      freq = lo * kVecElems / 2;
    }
  }
};

constexpr int kLaneElems = 2 * kVecElems;  // channels held by one lane

// RMSNorm of the head held by a lane group, in place where `apply` is set.
// Lanes of V heads pass apply = false and keep their values.
template <int kLanes>
__device__ __forceinline__ void rms_norm(float (&x)[kLaneElems],
                                         const float* weight,
                                         const LaneChunks& chunks, float eps,
                                         bool apply) {
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < kLaneElems; ++i) sum_sq += x[i] * x[i];
  sum_sq = group_sum<kLanes>(sum_sq);
  if (!apply) return;
  const float inv_rms = rsqrtf(sum_sq / (kLanes * kLaneElems) + eps);
  const float4* w_lo =
      reinterpret_cast<const float4*>(weight + chunks.lo * kVecElems);
  const float4* w_hi =
      reinterpret_cast<const float4*>(weight + chunks.hi * kVecElems);
  const float4 w[4] = {w_lo[0], w_lo[1], w_hi[0], w_hi[1]};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[4 * i + 0] *= inv_rms * w[i].x;
    x[4 * i + 1] *= inv_rms * w[i].y;
    x[4 * i + 2] *= inv_rms * w[i].z;
    x[4 * i + 3] *= inv_rms * w[i].w;
  }
}

// Rotates the lane's two chunks in place from one cos/sin row (cos half then
// sin half, rotary_dim / 2 frequencies each).
template <typename C>
__device__ __forceinline__ void apply_rope(float (&x)[kLaneElems], const C* row,
                                           int rotary_dim, bool is_neox,
                                           const LaneChunks& chunks) {
  const int half = rotary_dim / 2;
  float cos_v[kVecElems], sin_v[kVecElems];
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) {
    cos_v[i] = to_float(row[chunks.freq + i]);
    sin_v[i] = to_float(row[half + chunks.freq + i]);
  }
  if (is_neox) {
    // x[i] is channel c, x[8 + i] its partner c + rotary_dim / 2.
#pragma unroll
    for (int i = 0; i < kVecElems; ++i) {
      const float a = x[i], b = x[kVecElems + i];
      x[i] = a * cos_v[i] - b * sin_v[i];
      x[kVecElems + i] = b * cos_v[i] + a * sin_v[i];
    }
  } else {
    // Pairs (2i, 2i + 1) across both chunks, frequencies freq .. freq + 7.
#pragma unroll
    for (int i = 0; i < kVecElems; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      x[2 * i] = a * cos_v[i] - b * sin_v[i];
      x[2 * i + 1] = b * cos_v[i] + a * sin_v[i];
    }
  }
}

// Shared memory of the tile pipeline: `stages` buffers, each holding
//   [tile_tokens x row_bytes]      the tile's slice of the packed QKV rows
//   [tile_tokens x cos_sin_bytes]  cos/sin rows at the tokens' positions
//   [tile_tokens x 8]              each token's K/V cache offset (-1: padding)
// Offsets inside a stage are 16-byte aligned: row and cos/sin sizes are
// multiples of 16. A tile is tile_tokens consecutive tokens times
// heads_per_tile consecutive heads; only small batches use more than one
// head chunk per token.
struct TileLayout {
  int tile_tokens;     // <= kMaxTileTokens: one producer lane per token
  int heads_per_tile;  // heads of one token in a tile
  int head_chunks;     // tiles across one token's heads
  int row_bytes;       // heads_per_tile * head_dim * 2
  int cos_sin_bytes;   // rotary_dim * sizeof(cos/sin element)
  int stages;          // <= kMaxStages
  int num_tiles;       // token tiles x head_chunks

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

// Where a tile lies in the (token, head) grid.
struct TileCoord {
  int first_token;
  int tokens;
  int first_head;
  int heads;

  __device__ TileCoord(const TileLayout& layout, const RopeNormParams& p,
                       int tile) {
    const int token_tile = tile / layout.head_chunks;
    const int chunk = tile % layout.head_chunks;
    const int heads_per_token = p.num_q_heads + 2 * p.num_kv_heads;
    first_token = token_tile * layout.tile_tokens;
    tokens = min(layout.tile_tokens, p.num_tokens - first_token);
    first_head = chunk * layout.heads_per_tile;
    heads = min(layout.heads_per_tile, heads_per_token - first_head);
  }
};

constexpr int kMaxStages = 4;
constexpr int kMaxTileTokens = 32;
constexpr int kConsumerWarps = 8;
constexpr int kThreadsPerBlock = 32 * (1 + kConsumerWarps);
// Resident CTAs per SM: 24 consumer warps per SM hide the latency of the
// per-head reduction chains.
constexpr int kCtasPerSm = 3;

// Producer side (warp 0): for each of the CTA's tiles, waits for a free stage,
// then moves each token's slice of the QKV row and its cos/sin row into it
// with the bulk-copy engine (one lane per token; one copy for the whole tile
// when its rows are contiguous), and records where each token's K/V rows go
// in the cache (the slot arithmetic is done once per token here, not once per
// head and lane by the consumers). Positions and slots of the next tile are
// loaded while the current one is issued, so they never stall the warp.
template <typename T>
__device__ __forceinline__ void produce_tiles(const RopeNormParams& p,
                                              const TileLayout& layout,
                                              int head_dim, uint8_t* smem,
                                              uint64_t* full, uint64_t* empty) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  const int lane = threadIdx.x % 32;
  auto token_index = [&](int tile) {
    const int token = tile / layout.head_chunks * layout.tile_tokens + lane;
    return tile < layout.num_tiles && lane < layout.tile_tokens &&
                   token < p.num_tokens
               ? token
               : -1;
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
  const bool whole_rows =
      layout.head_chunks == 1 &&
      p.qkv_row_stride * static_cast<int64_t>(sizeof(T)) == layout.row_bytes;

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
    const TileCoord coord(layout, p, tile);
    const int slice_bytes =
        coord.heads * head_dim * static_cast<int>(sizeof(T));
    if (lane == 0) {
      Barrier::expect_transaction(
          &full[stage], coord.tokens * (slice_bytes + layout.cos_sin_bytes));
    }
    __syncwarp();  // the expected bytes are set before any copy can land
    const T* rows = static_cast<const T*>(p.qkv) +
                    coord.first_token * p.qkv_row_stride +
                    coord.first_head * head_dim;
    if (whole_rows && lane == 0) {
      cute::SM90_BULK_COPY_G2S::copy(rows, &full[stage], buffer,
                                     coord.tokens * slice_bytes);
    }
    if (token >= 0) {
      const int t = lane;
      if (!whole_rows) {
        cute::SM90_BULK_COPY_G2S::copy(
            rows + t * p.qkv_row_stride, &full[stage],
            buffer + t * layout.row_bytes, slice_bytes);
      }
      reinterpret_cast<int64_t*>(buffer + layout.cache_offsets_offset())[t] =
          slot < 0 ? -1
                   : (slot / p.block_size) * p.cache_block_stride +
                         (slot % p.block_size) * p.cache_token_stride;
      cute::SM90_BULK_COPY_G2S::copy(
          static_cast<const uint8_t*>(p.cos_sin_cache) +
              position * layout.cos_sin_bytes,
          &full[stage],
          buffer + layout.cos_sin_offset() + t * layout.cos_sin_bytes,
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
// so the shuffles inside norm and amax always see converged warps (idle
// groups compute on stale data and store nothing).
template <typename T, int kHeadDim>
__device__ __forceinline__ void process_tile(
    const RopeNormParams& p, const TileLayout& layout, const uint8_t* buffer,
    const TileCoord& coord, const float* norm_weights, float k_scale_inv,
    float v_scale_inv) {
  constexpr int kLanes = kHeadDim / kLaneElems;
  constexpr int kGroups = 32 * kConsumerWarps / kLanes;
  const int consumer = threadIdx.x - 32;
  const int lane = consumer % kLanes;
  const int group = consumer / kLanes;
  const LaneChunks chunks(lane, p.rotary_dim, p.is_neox);
  const int tasks = coord.tokens * coord.heads;
  const int64_t* cache_offsets =
      reinterpret_cast<const int64_t*>(buffer + layout.cache_offsets_offset());

  // (t, h) of this group's task inside the tile, advanced by kGroups tasks
  // per step without a division per step.
  int step_t = group / coord.heads;
  int step_h = group % coord.heads;
  for (int base = 0; base < tasks; base += kGroups) {
    if (base > 0) {
      step_h += kGroups;
      while (step_h >= coord.heads) {
        step_h -= coord.heads;
        ++step_t;
      }
    }
    const bool active = base + group < tasks;
    const int t = active ? step_t : 0;
    const int h = active ? step_h : 0;
    const int head = coord.first_head + h;
    const bool is_q = head < p.num_q_heads;
    const bool is_v = head >= p.num_q_heads + p.num_kv_heads;

    float x[kLaneElems];
    {
      const uint8_t* row = buffer + t * layout.row_bytes +
                           h * kHeadDim * static_cast<int>(sizeof(T));
      const uint4 lo = *reinterpret_cast<const uint4*>(
          row + chunks.lo * kVecElems * static_cast<int>(sizeof(T)));
      const uint4 hi = *reinterpret_cast<const uint4*>(
          row + chunks.hi * kVecElems * static_cast<int>(sizeof(T)));
      float (&x_lo)[kVecElems] = *reinterpret_cast<float (*)[kVecElems]>(x);
      float (&x_hi)[kVecElems] =
          *reinterpret_cast<float (*)[kVecElems]>(x + kVecElems);
      unpack8(reinterpret_cast<const T*>(&lo), x_lo);
      unpack8(reinterpret_cast<const T*>(&hi), x_hi);
    }

    // Norm and rope work in place on Q/K heads; V heads pass through
    // unchanged. Warps holding only V heads (or idle groups) skip both: the
    // vote is warp-uniform, so the shuffles inside stay converged.
    if (__any_sync(0xffffffffu, active && !is_v)) {
      const float* w = norm_weights + (is_q ? 0 : kHeadDim);
      if (p.norm_policy == QkNormPolicy::kNormThenRope) {
        rms_norm<kLanes>(x, w, chunks, p.eps, !is_v);
      }
      if (active && !is_v && chunks.rotary) {
        const uint8_t* row =
            buffer + layout.cos_sin_offset() + t * layout.cos_sin_bytes;
        if (p.cos_sin_is_fp32) {
          apply_rope(x, reinterpret_cast<const float*>(row), p.rotary_dim,
                     p.is_neox, chunks);
        } else {
          apply_rope(x, reinterpret_cast<const T*>(row), p.rotary_dim,
                     p.is_neox, chunks);
        }
      }
      if (p.norm_policy == QkNormPolicy::kRopeThenNorm) {
        rms_norm<kLanes>(x, w, chunks, p.eps, !is_v);
      }
    }

    // FP8 Q: per-token-per-head scale from the head's amax. The reduction
    // runs on every lane (p.q_out_is_fp8 is uniform) before any branch on the
    // head kind.
    float amax = 0.f;
    if (p.q_out_is_fp8) {
#pragma unroll
      for (int e = 0; e < kLaneElems; ++e) amax = fmaxf(amax, fabsf(x[e]));
      amax = group_max<kLanes>(amax);
    }
    if (!active) continue;

    const float (&x_lo)[kVecElems] =
        *reinterpret_cast<const float (*)[kVecElems]>(x);
    const float (&x_hi)[kVecElems] =
        *reinterpret_cast<const float (*)[kVecElems]>(x + kVecElems);
    const int token = coord.first_token + t;
    int64_t base_offset;
    void* out;
    bool fp8;
    float scale_inv;
    if (is_q) {
      const int64_t row = static_cast<int64_t>(token) * p.num_q_heads + head;
      base_offset = row * kHeadDim;
      out = p.q_out;
      fp8 = p.q_out_is_fp8;
      scale_inv = amax > 0.f ? kFp8E4m3Max / amax : 0.f;
      if (fp8 && lane == 0) p.q_scale[row] = amax / kFp8E4m3Max;
    } else {
      const int64_t token_offset = cache_offsets[t];
      if (token_offset < 0) continue;  // padding token: no cache write
      const int kv_head = head - p.num_q_heads - (is_v ? p.num_kv_heads : 0);
      base_offset = token_offset + kv_head * p.cache_head_stride;
      out = is_v ? p.value_cache : p.key_cache;
      fp8 = p.cache_is_fp8;
      scale_inv = is_v ? v_scale_inv : k_scale_inv;
    }
    const int64_t lo_offset = base_offset + chunks.lo * kVecElems;
    const int64_t hi_offset = base_offset + chunks.hi * kVecElems;
    if (fp8) {
      store8_fp8(static_cast<uint8_t*>(out) + lo_offset, x_lo, scale_inv);
      store8_fp8(static_cast<uint8_t*>(out) + hi_offset, x_hi, scale_inv);
    } else {
      store8(static_cast<T*>(out) + lo_offset, x_lo);
      store8(static_cast<T*>(out) + hi_offset, x_hi);
    }
  }
}

// Persistent CTAs: warp 0 produces tiles into a ring of shared-memory stages,
// the other warps consume them, so the next tiles' HBM reads are always in
// flight while the current one is computed and stored.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreadsPerBlock, kCtasPerSm)
    rope_norm_kernel(const __grid_constant__ RopeNormParams p,
                     const TileLayout layout) {
  static_assert(kHeadDim % kLaneElems == 0 && 32 % (kHeadDim / kLaneElems) == 0,
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
    produce_tiles<T>(p, layout, kHeadDim, smem, full, empty);
    return;
  }
  const float k_scale_inv = p.cache_is_fp8 ? 1.f / *p.k_scale : 1.f;
  const float v_scale_inv = p.cache_is_fp8 ? 1.f / *p.v_scale : 1.f;
  int i = 0;
  for (int tile = blockIdx.x; tile < layout.num_tiles; tile += gridDim.x, ++i) {
    const int stage = i % layout.stages;
    Barrier::wait(&full[stage], (i / layout.stages) & 1);
    process_tile<T, kHeadDim>(p, layout, smem + stage * layout.stage_bytes(),
                              TileCoord(layout, p, tile), norm_weights,
                              k_scale_inv, v_scale_inv);
    __syncwarp();
    if (threadIdx.x % 32 == 0) Barrier::arrive(&empty[stage]);
  }
}

}  // namespace rope_norm
}  // namespace hpc
