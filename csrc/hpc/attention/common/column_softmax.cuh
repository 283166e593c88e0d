// Online softmax over the columns of a transposed score tile, in the exp2
// domain: S^T = K Q^T with the keys as the wgmma M side (64 rows, one
// warpgroup) and the query rows as its N side, as swap-AB kernels compute
// it when the query rows are too few to fill M.
//
// A thread of the m64nN accumulator holds keys 16 w + lane / 4 and that + 8
// (w = warp of the warpgroup) of columns fragment_column(i, lane): N / 4
// columns, two keys each. A column's maximum is reduced over the eight lanes
// of the same lane % 4 by shuffles and over the four warps through shared
// memory (one warpgroup barrier per tile); each thread keeps its own share
// of a column's sum until the end, where the same two steps add the shares.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "attention/common/online_softmax.cuh"
#include "attention/common/packed_pair.cuh"
#include "common/sync.cuh"

namespace hpc {
namespace attention {

// Column c (0 .. N / 4 - 1) of a thread's accumulator values: value i
// belongs to column slot 2 * (i / 4) + i % 2.
__device__ __forceinline__ int column_slot_of(int value) {
  return 2 * (value >> 2) + (value & 1);
}

// The column fragment_column gives for slot c.
__device__ __forceinline__ int column_of_slot(int slot, int lane) {
  return (slot >> 1) * 8 + 2 * (lane & 3) + (slot & 1);
}

// Reduces `x` over the lanes that hold the same columns (lane % 4 equal).
template <class Op>
__device__ __forceinline__ float reduce_over_keys_in_warp(float x, Op op) {
#pragma unroll
  for (int lanes = 4; lanes < 32; lanes *= 2) {
    x = op(x, __shfl_xor_sync(0xffffffffu, x, lanes));
  }
  return x;
}

// kCols: columns of the tile (N). Scratch: 2 x 4 x kCols floats per
// warpgroup (two tiles in flight, four warps), `barrier` the warpgroup's
// named barrier id (128 threads). kProbLog2Scale > 0: the probabilities go
// to an E4M3 product; they come out rounded to E4M3 and the sums add the
// rounded values, so that the output's numerator and denominator carry the
// same rounding (a peaked row then keeps its dominant value exactly).
template <int kCols, int kProbLog2Scale = 0>
struct ColumnSoftmax {
  static constexpr int kSlots = kCols / 4;
  static constexpr int kScratchFloats = 2 * 4 * kCols;
  // The sums carry the probabilities' factor 2^kProbLog2Scale.
  static constexpr int kSumLog2Scale = kProbLog2Scale;
  static_assert(kCols % 8 == 0);

  float m[kSlots];  // running column maxima (log2 domain)
  float l[kSlots];  // this thread's share of the running column sums

  __device__ void reset() {
#pragma unroll
    for (int c = 0; c < kSlots; ++c) {
      m[c] = -INFINITY;
      l[c] = 0.f;
    }
  }

  // Scores x (-inf where masked) into unnormalised probabilities
  // exp2(x * scale - m) in place; scale[c] > 0 is column slot c's logit
  // scale (log2 domain), alpha[c] the factor its running output must be
  // multiplied by. `parity` alternates between consecutive calls (the
  // scratch half written), so one barrier per call suffices.
  template <class Frag>
  __device__ void update(Frag& x, const float (&scale)[kSlots],
                         float (&alpha)[kSlots], float* scratch, int parity,
                         int barrier) {
    const int lane = threadIdx.x % 32;
    const int warp = (threadIdx.x / 32) % 4;
    float tile_max[kSlots];
#pragma unroll
    for (int c = 0; c < kSlots; ++c) tile_max[c] = -INFINITY;
#pragma unroll
    for (int i = 0; i < int(cute::size(x)); ++i) {
      const int c = column_slot_of(i);
      tile_max[c] = fmaxf(tile_max[c], x(i));
    }
    float* half = scratch + parity * 4 * kCols;
#pragma unroll
    for (int c = 0; c < kSlots; ++c) {
      tile_max[c] = reduce_over_keys_in_warp(
          tile_max[c], [](float a, float b) { return fmaxf(a, b); });
      if (lane < 4) half[warp * kCols + column_of_slot(c, lane)] = tile_max[c];
    }
    named_barrier_sync(barrier, 128);
    float ref[kSlots];
#pragma unroll
    for (int c = 0; c < kSlots; ++c) {
      const int col = column_of_slot(c, lane);
      float mx = half[col];
#pragma unroll
      for (int w = 1; w < 4; ++w) mx = fmaxf(mx, half[w * kCols + col]);
      const float m_new = fmaxf(m[c], mx * scale[c]);
      ref[c] = m_new == -INFINITY ? 0.f : m_new;
      alpha[c] = fast_exp2(m[c] - ref[c]);
      m[c] = m_new;
      l[c] *= alpha[c];
      ref[c] -= static_cast<float>(kProbLog2Scale);
    }
#pragma unroll
    for (int i = 0; i < int(cute::size(x)); ++i) {
      const int c = column_slot_of(i);
      x(i) = fast_exp2(fmaf(x(i), scale[c], -ref[c]));
      if constexpr (kProbLog2Scale > 0) {
        x(i) = static_cast<float>(__nv_fp8_e4m3(x(i)));
      }
      l[c] += x(i);
    }
  }

  // After the last tile: each column's whole sum (every thread of the
  // warpgroup gets its columns'), through the scratch half `parity`.
  __device__ void column_sums(float (&sum)[kSlots], float* scratch, int parity,
                              int barrier) {
    const int lane = threadIdx.x % 32;
    const int warp = (threadIdx.x / 32) % 4;
    float* half = scratch + parity * 4 * kCols;
#pragma unroll
    for (int c = 0; c < kSlots; ++c) {
      const float s = reduce_over_keys_in_warp(
          l[c], [](float a, float b) { return a + b; });
      if (lane < 4) half[warp * kCols + column_of_slot(c, lane)] = s;
    }
    named_barrier_sync(barrier, 128);
#pragma unroll
    for (int c = 0; c < kSlots; ++c) {
      const int col = column_of_slot(c, lane);
      sum[c] = half[col] + half[kCols + col] + half[2 * kCols + col] +
               half[3 * kCols + col];
    }
  }
};

// Multiplies each value of a transposed accumulator (columns = query rows,
// several 64-row blocks: the values of one block, 2 * kSlots, come first)
// by its column's factor.
template <class Frag, int kSlots>
__device__ __forceinline__ void scale_columns(Frag& acc,
                                              const float (&f)[kSlots]) {
#pragma unroll
  for (int i = 0; i < int(cute::size(acc)); ++i) {
    acc(i) *= f[column_slot_of(i % (2 * kSlots))];
  }
}

// Writes a warp's probabilities of a transposed score tile (keys x kCols
// columns, its 16 keys of the m64nN accumulator) as 16-bit P^T rows
// (column, key) into shared memory. A thread holds two adjacent columns of
// a key in one register, which is the row fragment stmatrix takes; with
// .trans each 8 x 8 block lands transposed, one register per block instead
// of one store per value. `row_address(column, key)` is the shared address
// of P^T element (column, key), key a multiple of 8 (8 keys are one 16-byte
// chunk of a row under the 128-byte swizzle).
template <class Element, int kCols, class Frag, class RowAddress>
__device__ __forceinline__ void store_probs_transposed(const Frag& p, int warp,
                                                       int lane,
                                                       RowAddress row_address) {
  static_assert(kCols == 8 || kCols % 16 == 0);
  constexpr int kMatrices = 2 * (kCols / 8);  // (8-column block, key half)
  // Matrix m = 2 block + half: values 4 block + 2 half and the next.
  const auto packed = [&](int m) {
    return pack2<Element>(p(4 * (m / 2) + 2 * (m % 2)),
                          p(4 * (m / 2) + 2 * (m % 2) + 1));
  };
  // Lane l gives the address of row l % 8 of matrix l / 8 of each group.
  const auto address = [&](int m) {
    return row_address(8 * (m / 2) + lane % 8, 16 * warp + 8 * (m % 2));
  };
  if constexpr (kMatrices == 2) {
    asm volatile(
        "stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::
            "r"(address(lane / 8 % 2)),
        "r"(packed(0)), "r"(packed(1))
        : "memory");
  } else {
#pragma unroll
    for (int g = 0; g < kMatrices; g += 4) {
      asm volatile(
          "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, "
          "%4};\n" ::"r"(address(g + lane / 8)),
          "r"(packed(g)), "r"(packed(g + 1)), "r"(packed(g + 2)),
          "r"(packed(g + 3))
          : "memory");
    }
  }
}

}  // namespace attention
}  // namespace hpc
