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

template <typename T, int kLanes>
__device__ __forceinline__ void rms_norm(float (&x)[kVecElems],
                                         const void* weight, bool weight_fp32,
                                         float eps, int lane) {
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) sum_sq += x[i] * x[i];
  sum_sq = group_sum<kLanes>(sum_sq);
  const float inv_rms = rsqrtf(sum_sq / (kLanes * kVecElems) + eps);
  float w[kVecElems];
  const size_t offset = static_cast<size_t>(lane) * kVecElems;
  load8_any<T>(
      weight_fp32
          ? static_cast<const void*>(static_cast<const float*>(weight) + offset)
          : static_cast<const void*>(static_cast<const T*>(weight) + offset),
      weight_fp32, w);
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) x[i] = x[i] * inv_rms * w[i];
}

// Rotates the first rotary_dim channels of the head held by the group.
// `active` is false for lanes of a group past the end of the work; they still
// take part in the shuffle so the whole warp stays converged.
template <typename T, int kLanes>
__device__ __forceinline__ void apply_rope(float (&x)[kVecElems],
                                           const RopeNormParams& p,
                                           int64_t position, int lane,
                                           bool active) {
  const int half = p.rotary_dim / 2;
  const int first = lane * kVecElems;  // first channel held by this lane
  if (p.is_neox) {
    // Channel c < half pairs with c + half; both halves are whole lanes
    // because rotary_dim is a multiple of 16.
    const int lane_shift = half / kVecElems;
    const bool rotates = first < p.rotary_dim;
    const bool low = first < half;
    const int partner =
        rotates ? (low ? lane + lane_shift : lane - lane_shift) : lane;
    const int src = (threadIdx.x % 32) - lane + partner;
    float other[kVecElems];
#pragma unroll
    for (int i = 0; i < kVecElems; ++i) {
      other[i] = __shfl_sync(0xffffffffu, x[i], src);
    }
    if (!rotates || !active) return;
    const int freq = low ? first : first - half;
    const size_t row = static_cast<size_t>(position) * p.rotary_dim;
    float cos_v[kVecElems], sin_v[kVecElems];
    if (p.cos_sin_is_fp32) {
      const float* cache = static_cast<const float*>(p.cos_sin_cache) + row;
      load8_any<T>(cache + freq, true, cos_v);
      load8_any<T>(cache + half + freq, true, sin_v);
    } else {
      const T* cache = static_cast<const T*>(p.cos_sin_cache) + row;
      load8(cache + freq, cos_v);
      load8(cache + half + freq, sin_v);
    }
    const float sign = low ? -1.f : 1.f;
#pragma unroll
    for (int i = 0; i < kVecElems; ++i) {
      x[i] = x[i] * cos_v[i] + sign * other[i] * sin_v[i];
    }
  } else {
    // GPT-J: channels (2i, 2i + 1) rotate together with frequency i.
    if (!active || first >= p.rotary_dim) return;
    const int freq = first / 2;
    const size_t row = static_cast<size_t>(position) * p.rotary_dim;
    float cs[kVecElems / 2], sn[kVecElems / 2];
#pragma unroll
    for (int i = 0; i < kVecElems / 2; ++i) {
      if (p.cos_sin_is_fp32) {
        const float* cache = static_cast<const float*>(p.cos_sin_cache) + row;
        cs[i] = cache[freq + i];
        sn[i] = cache[half + freq + i];
      } else {
        const T* cache = static_cast<const T*>(p.cos_sin_cache) + row;
        cs[i] = to_float(cache[freq + i]);
        sn[i] = to_float(cache[half + freq + i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kVecElems / 2; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      x[2 * i] = a * cs[i] - b * sn[i];
      x[2 * i + 1] = b * cs[i] + a * sn[i];
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_cache(void* cache, bool fp8,
                                            int64_t offset,
                                            const float (&x)[kVecElems],
                                            const float* scale) {
  if (fp8) {
    store8_fp8(static_cast<uint8_t*>(cache) + offset, x, 1.f / *scale);
  } else {
    store8(static_cast<T*>(cache) + offset, x);
  }
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreadsPerBlock)
    rope_norm_kernel(const __grid_constant__ RopeNormParams p) {
  constexpr int kLanes = kHeadDim / kVecElems;
  constexpr int kGroupsPerBlock = kThreadsPerBlock / kLanes;
  static_assert(kLanes <= 32 && 32 % kLanes == 0, "head must fit a warp");

  const int lane = threadIdx.x % kLanes;
  const int heads_per_token = p.num_q_heads + 2 * p.num_kv_heads;
  const int64_t item =
      static_cast<int64_t>(blockIdx.x) * kGroupsPerBlock + threadIdx.x / kLanes;
  const bool active =
      item < static_cast<int64_t>(p.num_tokens) * heads_per_token;
  const int token = active ? static_cast<int>(item / heads_per_token) : 0;
  const int head = active ? static_cast<int>(item % heads_per_token) : 0;

  // Inputs may be produced by the previous kernel (the QKV projection).
  pdl_wait_for_producer();
  pdl_launch_dependents();

  const bool is_q = head < p.num_q_heads;
  const bool is_v = head >= p.num_q_heads + p.num_kv_heads;
  const int64_t slot =
      active && !is_q ? load_index(p.slot_mapping, p.slots_are_int64, token)
                      : 0;
  // Q heads always produce output; K/V heads of padding tokens do nothing.
  const bool works = active && (is_q || slot >= 0);

  float x[kVecElems] = {};
  if (works) {
    const T* src = static_cast<const T*>(p.qkv) + token * p.qkv_row_stride +
                   head * kHeadDim + lane * kVecElems;
    load8(src, x);
  }

  // Norm and rope run on every lane, V heads and idle lanes included, so the
  // group shuffles inside them always see a converged warp; only Q/K heads
  // keep the result.
  const bool qk = !is_v;
  const void* weight = is_q ? p.q_norm_weight : p.k_norm_weight;
  const int64_t position =
      works && qk ? load_index(p.positions, p.positions_are_int64, token) : 0;
  const bool norm = p.norm_policy != QkNormPolicy::kNone;
  float y[kVecElems];
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) y[i] = x[i];
  if (norm && p.norm_policy == QkNormPolicy::kNormThenRope) {
    rms_norm<T, kLanes>(y, weight, p.norm_weight_is_fp32, p.eps, lane);
  }
  apply_rope<T, kLanes>(y, p, position, lane, works && qk);
  if (norm && p.norm_policy == QkNormPolicy::kRopeThenNorm) {
    rms_norm<T, kLanes>(y, weight, p.norm_weight_is_fp32, p.eps, lane);
  }
  if (qk) {
#pragma unroll
    for (int i = 0; i < kVecElems; ++i) x[i] = y[i];
  }

  // FP8 Q: per-token-per-head scale from the group's amax.
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) amax = fmaxf(amax, fabsf(x[i]));
  amax = group_max<kLanes>(amax);

  if (!works) return;

  if (is_q) {
    const int64_t row = static_cast<int64_t>(token) * p.num_q_heads + head;
    const int64_t offset = row * kHeadDim + lane * kVecElems;
    if (p.q_out_is_fp8) {
      const float scale = amax / kFp8E4m3Max;
      store8_fp8(static_cast<uint8_t*>(p.q_out) + offset, x,
                 amax > 0.f ? kFp8E4m3Max / amax : 0.f);
      if (lane == 0) p.q_scale[row] = scale;
    } else {
      store8(static_cast<T*>(p.q_out) + offset, x);
    }
    return;
  }

  const int kv_head =
      is_v ? head - p.num_q_heads - p.num_kv_heads : head - p.num_q_heads;
  const int64_t block = slot / p.block_size;
  const int64_t in_block = slot % p.block_size;
  const int64_t offset = block * p.cache_block_stride +
                         in_block * p.cache_token_stride +
                         kv_head * p.cache_head_stride + lane * kVecElems;
  if (is_v) {
    store_cache<T>(p.value_cache, p.cache_is_fp8, offset, x, p.v_scale);
  } else {
    store_cache<T>(p.key_cache, p.cache_is_fp8, offset, x, p.k_scale);
  }
}

}  // namespace rope_norm
}  // namespace hpc
