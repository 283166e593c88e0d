// Device code of the fused prologue.
//
// Work decomposition: one "head group" of head_dim / 8 lanes owns one
// (token, head) pair; each lane holds 8 contiguous channels in registers, so
// the head is read from and written to HBM exactly once with 16-byte accesses.
// Reductions (RMSNorm, FP8 amax) are shuffles inside the group; the NeoX
// rotation partner of a lane is another lane of the same group, fetched with
// one shuffle. The work is indexed by (token, head) and nothing depends on how
// tokens split into requests, so prefill and decode batches run the same way.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/pdl.cuh"
#include "common/vec.cuh"
#include "rope_norm/rope_norm.h"

namespace hpc {
namespace rope_norm {

constexpr int kThreadsPerBlock = 256;

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

template <typename T>
__device__ __forceinline__ void load_weight(const void* weight, bool is_fp32,
                                            int first, float (&w)[kVecElems]) {
  if (is_fp32) {
    load8_any<T>(static_cast<const float*>(weight) + first, true, w);
  } else {
    load8(static_cast<const T*>(weight) + first, w);
  }
}

template <int kLanes>
__device__ __forceinline__ void rms_norm(float (&x)[kVecElems],
                                         const float (&w)[kVecElems],
                                         float eps) {
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) sum_sq += x[i] * x[i];
  sum_sq = group_sum<kLanes>(sum_sq);
  const float inv_rms = rsqrtf(sum_sq / (kLanes * kVecElems) + eps);
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) x[i] = x[i] * inv_rms * w[i];
}

// Loads the 8 cos and 8 sin values a lane needs for its channels. NeoX lanes
// pair channel c with c + rotary_dim / 2 at frequency c mod (rotary_dim / 2);
// GPT-J lanes rotate (2i, 2i + 1) at frequency i, so only 4 of the values are
// used.
template <typename T>
__device__ __forceinline__ void load_cos_sin(const RopeNormParams& p,
                                             int64_t position, int first,
                                             float (&cos_v)[kVecElems],
                                             float (&sin_v)[kVecElems]) {
  const int half = p.rotary_dim / 2;
  const int freq =
      p.is_neox ? (first < half ? first : first - half) : first / 2;
  const int64_t row = position * p.rotary_dim;
  if (p.cos_sin_is_fp32) {
    const float* cache = static_cast<const float*>(p.cos_sin_cache) + row;
    if (p.is_neox) {
      load8_any<T>(cache + freq, true, cos_v);
      load8_any<T>(cache + half + freq, true, sin_v);
    } else {
      const float4 c = *reinterpret_cast<const float4*>(cache + freq);
      const float4 s = *reinterpret_cast<const float4*>(cache + half + freq);
      cos_v[0] = c.x, cos_v[1] = c.y, cos_v[2] = c.z, cos_v[3] = c.w;
      sin_v[0] = s.x, sin_v[1] = s.y, sin_v[2] = s.z, sin_v[3] = s.w;
    }
  } else {
    const T* cache = static_cast<const T*>(p.cos_sin_cache) + row;
    if (p.is_neox) {
      load8(cache + freq, cos_v);
      load8(cache + half + freq, sin_v);
    } else {
#pragma unroll
      for (int i = 0; i < kVecElems / 2; ++i) {
        cos_v[i] = to_float(cache[freq + i]);
        sin_v[i] = to_float(cache[half + freq + i]);
      }
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

// One (token, head) pair of the packed QKV rows.
struct WorkItem {
  int token;
  int head;
  bool active;  // inside the work at all
  bool is_q;
  bool is_v;
  int64_t slot;      // cache slot of K/V heads (< 0: padding)
  int64_t position;  // rope position of Q/K heads
  __device__ bool writes() const { return active && (is_q || slot >= 0); }
};

template <typename T, int kHeadDim, int kItemsPerGroup>
__global__ void __launch_bounds__(kThreadsPerBlock)
    rope_norm_kernel(const __grid_constant__ RopeNormParams p) {
  constexpr int kLanes = kHeadDim / kVecElems;
  constexpr int kGroupsPerBlock = kThreadsPerBlock / kLanes;
  static_assert(kLanes <= 32 && 32 % kLanes == 0, "head must fit a warp");

  const int lane = threadIdx.x % kLanes;
  const int first_channel = lane * kVecElems;
  const int heads_per_token = p.num_q_heads + 2 * p.num_kv_heads;
  const int64_t num_items =
      static_cast<int64_t>(p.num_tokens) * heads_per_token;
  const int64_t first_item =
      (static_cast<int64_t>(blockIdx.x) * kGroupsPerBlock +
       threadIdx.x / kLanes) *
      kItemsPerGroup;

  // Inputs may be produced by the previous kernel (the QKV projection).
  pdl_wait_for_producer();
  pdl_launch_dependents();

  // Phase 1: issue every independent load of the group's items before any
  // use, so their latencies overlap instead of chaining.
  // Raw 16-byte vectors: converting to fp32 only at use halves the registers
  // that the loads in flight occupy.
  WorkItem items[kItemsPerGroup];
  uint4 raw[kItemsPerGroup];
#pragma unroll
  for (int i = 0; i < kItemsPerGroup; ++i) {
    WorkItem& it = items[i];
    const int64_t item = first_item + i;
    it.active = item < num_items;
    it.token = it.active ? static_cast<int>(item / heads_per_token) : 0;
    it.head = it.active ? static_cast<int>(item % heads_per_token) : 0;
    it.is_q = it.head < p.num_q_heads;
    it.is_v = it.head >= p.num_q_heads + p.num_kv_heads;
    it.slot = it.active && !it.is_q
                  ? load_index(p.slot_mapping, p.slots_are_int64, it.token)
                  : 0;
    it.position = it.active && !it.is_v
                      ? load_index(p.positions, p.positions_are_int64, it.token)
                      : 0;
    raw[i] = it.active ? *reinterpret_cast<const uint4*>(
                             static_cast<const T*>(p.qkv) +
                             it.token * p.qkv_row_stride + it.head * kHeadDim +
                             first_channel)
                       : make_uint4(0, 0, 0, 0);
  }
  const float k_scale_inv = p.cache_is_fp8 ? 1.f / *p.k_scale : 1.f;
  const float v_scale_inv = p.cache_is_fp8 ? 1.f / *p.v_scale : 1.f;

  // Phase 2, per item: norm weights and cos/sin rows are small and shared by
  // every head of a token, so they are L1/L2 hits and are loaded next to
  // their use. Norm and rope run on every lane, V heads and idle lanes
  // included, so the group shuffles inside always see a converged warp; only
  // Q/K heads keep the result.
#pragma unroll
  for (int i = 0; i < kItemsPerGroup; ++i) {
    const WorkItem& it = items[i];
    const bool qk = !it.is_v;
    const bool rotates = it.active && qk && first_channel < p.rotary_dim;
    float w[kVecElems], cos_v[kVecElems], sin_v[kVecElems];
    if (p.norm_policy != QkNormPolicy::kNone) {
      load_weight<T>(it.is_q ? p.q_norm_weight : p.k_norm_weight,
                     p.norm_weight_is_fp32, first_channel, w);
    }
    if (rotates) {
      load_cos_sin<T>(p, it.position, first_channel, cos_v, sin_v);
    }
    float x[kVecElems], y[kVecElems];
    unpack8(reinterpret_cast<const T*>(&raw[i]), x);
#pragma unroll
    for (int e = 0; e < kVecElems; ++e) y[e] = x[e];
    if (p.norm_policy == QkNormPolicy::kNormThenRope) {
      rms_norm<kLanes>(y, w, p.eps);
    }
    apply_rope<kLanes>(y, p, lane, rotates, cos_v, sin_v);
    if (p.norm_policy == QkNormPolicy::kRopeThenNorm) {
      rms_norm<kLanes>(y, w, p.eps);
    }
    if (qk) {
#pragma unroll
      for (int e = 0; e < kVecElems; ++e) x[e] = y[e];
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
    if (!it.writes()) continue;
    if (it.is_q && p.q_out_is_fp8) {
      const int64_t row =
          static_cast<int64_t>(it.token) * p.num_q_heads + it.head;
      store8_fp8(
          static_cast<uint8_t*>(p.q_out) + row * kHeadDim + first_channel, x,
          amax > 0.f ? kFp8E4m3Max / amax : 0.f);
      if (lane == 0) p.q_scale[row] = amax / kFp8E4m3Max;
      continue;
    }
    if (it.is_q) {
      const int64_t row =
          static_cast<int64_t>(it.token) * p.num_q_heads + it.head;
      store8(static_cast<T*>(p.q_out) + row * kHeadDim + first_channel, x);
      continue;
    }
    const int kv_head =
        it.head - p.num_q_heads - (it.is_v ? p.num_kv_heads : 0);
    const int64_t offset = (it.slot / p.block_size) * p.cache_block_stride +
                           (it.slot % p.block_size) * p.cache_token_stride +
                           kv_head * p.cache_head_stride + first_channel;
    void* cache = it.is_v ? p.value_cache : p.key_cache;
    if (p.cache_is_fp8) {
      store8_fp8(static_cast<uint8_t*>(cache) + offset, x,
                 it.is_v ? v_scale_inv : k_scale_inv);
    } else {
      store8(static_cast<T*>(cache) + offset, x);
    }
  }
}

}  // namespace rope_norm
}  // namespace hpc
