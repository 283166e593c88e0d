// Online softmax over MMA accumulator fragments, in the exp2 domain.
//
// The accumulator fragments of the SM80 (mma.sync m16n8) and SM90 (wgmma
// m64nN) atoms give each thread values of two rows, g and g + 8 of its
// warp's 16, in the order (column pair, row half, 8-column block): value i
// belongs to row half (i / 2) % 2, and the four threads of a quad hold the
// rest of those rows. Scores come in raw (masked to -inf) with a per-row
// scale that includes log2(e), so exp2 replaces exp.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include <cute/tensor.hpp>

namespace hpc {
namespace attention {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ int row_half_of(int value) {
  return (value >> 1) & 1;
}

// Column of value i within the accumulator tile: 8-column block i / 4,
// column pair 2 * (lane % 4), then i % 2. With i known at compile time this
// is one register plus an immediate.
__device__ __forceinline__ int fragment_column(int value, int lane) {
  return (value >> 2) * 8 + 2 * (lane & 3) + (value & 1);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// 2^x on the special-function unit (flushes subnormal results to zero,
// which a probability below 2^-126 can afford); 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// kProbLog2Scale: probabilities come out scaled by 2^kProbLog2Scale (the
// row maximum's is 2^kProbLog2Scale instead of 1), for a caller that rounds
// them to a narrow type; the row sums carry the same factor, so O / l is
// unchanged.
template <int kProbLog2Scale = 0>
struct OnlineSoftmax {
  float m[2];  // running row maxima (log2 domain)
  float l[2];  // this thread's share of the running row sums

  __device__ void reset() {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }

  // Turns a tile of raw scores x (-inf where masked) into unnormalised
  // probabilities exp2(x * scale - m) in place, updating the running maxima
  // (of x * scale) and sums; scale[h] > 0 is row half h's logit scale in
  // the log2 domain, folded into one FMA per value. alpha[h] is the factor
  // the running output of row half h must be multiplied by. A row that has
  // seen no key yet keeps m = -inf and uses 0 as its reference, so fully
  // masked rows give zeros rather than NaN.
  template <class Frag>
  __device__ void update(Frag& x, const float (&scale)[2], float (&alpha)[2]) {
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < int(cute::size(x)); ++i) {
      tile_max[row_half_of(i)] = fmaxf(tile_max[row_half_of(i)], x(i));
    }
    float ref[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m[h], quad_max(tile_max[h]) * scale[h]);
      ref[h] = m_new == -INFINITY ? 0.f : m_new;
      alpha[h] = fast_exp2(m[h] - ref[h]);
      m[h] = m_new;
      l[h] *= alpha[h];
      ref[h] -= static_cast<float>(kProbLog2Scale);
    }
#pragma unroll
    for (int i = 0; i < int(cute::size(x)); ++i) {
      const int h = row_half_of(i);
      x(i) = fast_exp2(fmaf(x(i), scale[h], -ref[h]));
      l[h] += x(i);
    }
  }

  // After the last tile: 1 / row sum (0 for a row that saw no key), and the
  // row's log-sum-exp in the log2 domain (-inf for such a row).
  __device__ void finish(float (&inv_sum)[2], float (&lse)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(l[h]);
      inv_sum[h] = sum > 0.f ? 1.f / sum : 0.f;
      lse[h] = sum > 0.f
                   ? m[h] + log2f(sum) - static_cast<float>(kProbLog2Scale)
                   : -INFINITY;
    }
  }
};

// Multiplies each value of an accumulator fragment by its row's factor.
template <class Frag>
__device__ __forceinline__ void scale_rows(Frag& acc, const float (&f)[2]) {
#pragma unroll
  for (int i = 0; i < int(cute::size(acc)); ++i) acc(i) *= f[row_half_of(i)];
}

}  // namespace attention
}  // namespace hpc
