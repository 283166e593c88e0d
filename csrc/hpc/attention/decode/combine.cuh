// Device code of the split-KV combine. The decode kernel's CTA that
// finishes the last piece of a split unit merges the unit's fp32 pieces into
// the output (decode_kernel.cuh), so no separate kernel or launch is needed.
// Each lane sums its columns in piece order, so the result does not depend
// on which CTA merges or when.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode/decode_params.h"
#include "attention/decode/decode_plan.h"
#include "common/sync.cuh"
#include "kernel_limits.h"

namespace hpc {
namespace decode {

constexpr int kMaxRows = limits::kMaxDecodeRows;  // rows of one unit
constexpr int kPiecesInFlight = 16;
constexpr int kLseChunks = 4;  // LSEs a lane holds in merge_split_row
static_assert(32 % kPiecesInFlight == 0);

__device__ __forceinline__ void store4(uint16_t* out, ElemType type, float4 v) {
  uint32_t lo, hi;
  if (type == ElemType::kBf16) {
    __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y);
    __nv_bfloat162 b = __floats2bfloat162_rn(v.z, v.w);
    lo = *reinterpret_cast<uint32_t*>(&a);
    hi = *reinterpret_cast<uint32_t*>(&b);
  } else {
    __half2 a = __floats2half2_rn(v.x, v.y);
    __half2 b = __floats2half2_rn(v.z, v.w);
    lo = *reinterpret_cast<uint32_t*>(&a);
    hi = *reinterpret_cast<uint32_t*>(&b);
  }
  *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
}

// Output row `row` of unit `unit` (token-major rows: query token, then head).
__device__ __forceinline__ uint16_t* output_row(const DecodeParams& p, int unit,
                                                int row) {
  const int b = unit % p.batch;
  const int h = unit / p.batch;
  const int t = row / p.group;
  const int head = h * p.group + row % p.group;
  return static_cast<uint16_t*>(p.out) +
         static_cast<int64_t>(b * p.query_tokens + t) * p.out_token_stride +
         static_cast<int64_t>(head) * p.out_head_stride;
}

// One warp merges row `row` of a unit split into `pieces` pieces whose
// partial rows start at `first`. Lane l holds the LSEs of pieces l, l + 32,
// ... (kLseChunks of them, loaded together: one load latency for up to
// 32 kLseChunks pieces, whose weights then stay in registers), broadcasts
// the weights, and keeps kPiecesInFlight partial-row loads in flight.
// Each lane sums its columns in piece order. Partials are read through L2
// (they were written by other CTAs).
__device__ __forceinline__ void merge_split_row(const DecodeParams& p, int unit,
                                                int first, int pieces, int row,
                                                int head_dim, int lane) {
  constexpr int kGroup = 32 * kLseChunks;  // pieces per pass of LSE loads
  const float* lse = p.partial_lse + static_cast<int64_t>(first) * p.rows + row;
  const auto load_lse = [&](int g, float (&x)[kLseChunks]) {
#pragma unroll
    for (int k = 0; k < kLseChunks; ++k) {
      const int i = g + 32 * k + lane;
      x[k] = i < pieces ? __ldcg(lse + static_cast<int64_t>(i) * p.rows)
                        : -INFINITY;
    }
  };
  // Running max and sum of 2^lse over the lane's pieces, then over the warp.
  float x[kLseChunks];
  float m = -INFINITY, sum = 0.f;
  for (int g = 0; g < pieces; g += kGroup) {
    load_lse(g, x);
#pragma unroll
    for (int k = 0; k < kLseChunks; ++k) {
      const float m_new = fmaxf(m, x[k]);
      if (m_new != -INFINITY) {
        sum = sum * exp2f(m - m_new) + exp2f(x[k] - m_new);
      }
      m = m_new;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float m_other = __shfl_xor_sync(0xffffffffu, m, offset);
    const float s_other = __shfl_xor_sync(0xffffffffu, sum, offset);
    const float m_new = fmaxf(m, m_other);
    if (m_new != -INFINITY) {
      sum = sum * exp2f(m - m_new) + s_other * exp2f(m_other - m_new);
    }
    m = m_new;
  }
  const float ref = m == -INFINITY ? 0.f : m;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  // One group: its LSEs are still in x.
  const bool one_group = pieces <= kGroup;

  uint16_t* out = output_row(p, unit, row);
  const int quads = head_dim / 4;
  for (int q0 = 0; q0 < quads; q0 += 32) {
    const int quad = q0 + lane;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int g = 0; g < pieces; g += kGroup) {
      if (!one_group) load_lse(g, x);
      float w[kLseChunks];
#pragma unroll
      for (int k = 0; k < kLseChunks; ++k) {
        w[k] = g + 32 * k + lane < pieces ? exp2f(x[k] - ref) * inv : 0.f;
      }
      const int n = min(kGroup, pieces - g);
      for (int k0 = 0; k0 < n; k0 += kPiecesInFlight) {
        // Issue all loads of the batch before the first use.
        float4 v[kPiecesInFlight];
#pragma unroll
        for (int k = 0; k < kPiecesInFlight; ++k) {
          v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
          if (k0 + k < n && quad < quads) {
            v[k] = __ldcg(reinterpret_cast<const float4*>(
                p.partial_out +
                (static_cast<int64_t>(first + g + k0 + k) * p.rows + row) *
                    head_dim +
                4 * quad));
          }
        }
        // The batch's weights are one register of the lanes (kPiecesInFlight
        // divides 32), picked without indexing x by a runtime value.
        float w_batch = w[0];
#pragma unroll
        for (int k = 1; k < kLseChunks; ++k) {
          if (k0 >= 32 * k) w_batch = w[k];
        }
#pragma unroll
        for (int k = 0; k < kPiecesInFlight; ++k) {
          const float wk = __shfl_sync(0xffffffffu, w_batch, (k0 + k) & 31);
          acc.x += wk * v[k].x;
          acc.y += wk * v[k].y;
          acc.z += wk * v[k].z;
          acc.w += wk * v[k].w;
        }
      }
    }
    if (quad < quads) store4(out + 4 * quad, p.out_type, acc);
  }
}

// Sums the weighted partial rows for kElems (row, 4-channel) elements per
// thread, kPieces pieces per batch: all kElems x kPieces loads of a batch
// are issued before the first use, so each thread keeps that many in flight.
template <int kElems, int kPieces, int kThreads>
__device__ __forceinline__ void merge_elements(
    const DecodeParams& p, int unit, int first, int pieces, int head_dim,
    const float* row_ref, const float* row_inv, int thread) {
  const int quads = head_dim / 4;
  const int elems = p.rows * quads;
  const float* lse = p.partial_lse + static_cast<int64_t>(first) * p.rows;
  const float* partial =
      p.partial_out + static_cast<int64_t>(first) * p.rows * head_dim;
  const int64_t piece_stride = static_cast<int64_t>(p.rows) * head_dim;
  for (int e0 = thread; e0 < elems; e0 += kThreads * kElems) {
    int row[kElems], quad[kElems];
    float4 acc[kElems];
#pragma unroll
    for (int k = 0; k < kElems; ++k) {
      const int e = min(e0 + k * kThreads, elems - 1);
      row[k] = e / quads;
      quad[k] = e % quads;
      acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int i0 = 0; i0 < pieces; i0 += kPieces) {
      float4 v[kElems][kPieces];
      float x[kElems][kPieces];
#pragma unroll
      for (int k = 0; k < kElems; ++k) {
#pragma unroll
        for (int j = 0; j < kPieces; ++j) {
          const int i = min(i0 + j, pieces - 1);
          x[k][j] =
              i0 + j < pieces
                  ? __ldcg(lse + static_cast<int64_t>(i) * p.rows + row[k])
                  : -INFINITY;
          v[k][j] = __ldcg(reinterpret_cast<const float4*>(
              partial + i * piece_stride +
              static_cast<int64_t>(row[k]) * head_dim + 4 * quad[k]));
        }
      }
#pragma unroll
      for (int k = 0; k < kElems; ++k) {
#pragma unroll
        for (int j = 0; j < kPieces; ++j) {
          const float w = exp2f(x[k][j] - row_ref[row[k]]) * row_inv[row[k]];
          acc[k].x += w * v[k][j].x;
          acc[k].y += w * v[k][j].y;
          acc[k].z += w * v[k][j].z;
          acc[k].w += w * v[k][j].w;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kElems; ++k) {
      if (e0 + k * kThreads < elems) {
        store4(output_row(p, unit, row[k]) + 4 * quad[k], p.out_type, acc[k]);
      }
    }
  }
}

// kThreads threads merge a unit split into `pieces` pieces whose partial
// rows start at `first`. First every row's max and sum of 2^lse (one thread
// per row), then the weighted sum, element-parallel; each element is summed
// in piece order. Partials are read through L2 (other CTAs wrote them).
// `row_stats` is shared memory for 2 x rows floats; `barrier` a named
// barrier of the kThreads threads, `thread` this one's index among them.
template <int kThreads>
__device__ __forceinline__ void merge_split_unit(const DecodeParams& p,
                                                 int unit, int first,
                                                 int pieces, int head_dim,
                                                 float* row_stats, int barrier,
                                                 int thread) {
  constexpr int kBatch = 8;
  const int row = thread;
  if (row < p.rows) {
    const float* lse =
        p.partial_lse + static_cast<int64_t>(first) * p.rows + row;
    float m = -INFINITY, sum = 0.f;
    for (int i0 = 0; i0 < pieces; i0 += kBatch) {
      float x[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        x[j] = i0 + j < pieces
                   ? __ldcg(lse + static_cast<int64_t>(i0 + j) * p.rows)
                   : -INFINITY;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float m_new = fmaxf(m, x[j]);
        if (m_new != -INFINITY) {
          sum = sum * exp2f(m - m_new) + exp2f(x[j] - m_new);
        }
        m = m_new;
      }
    }
    row_stats[row] = m == -INFINITY ? 0.f : m;
    row_stats[kMaxRows + row] = sum > 0.f ? 1.f / sum : 0.f;
  }
  named_barrier_sync(barrier, kThreads);
  // Few elements per thread (few rows): go deep in pieces; many: go wide.
  if (p.rows * (head_dim / 4) <= 2 * kThreads) {
    merge_elements<2, 8, kThreads>(p, unit, first, pieces, head_dim, row_stats,
                                   row_stats + kMaxRows, thread);
  } else {
    merge_elements<4, 4, kThreads>(p, unit, first, pieces, head_dim, row_stats,
                                   row_stats + kMaxRows, thread);
  }
}

// Units with no KV at all get no work item; their rows are zeroed, spread
// over the grid by `threads` threads of each CTA (this one is `thread`).
__device__ __forceinline__ void zero_empty_units(const DecodeParams& p,
                                                 int head_dim, int thread,
                                                 int threads) {
  const int num_units = p.plan[kNumUnits];
  const int32_t* num_pieces = p.plan + p.layout.unit_num_pieces();
  const int vectors = head_dim / 8;  // 16-byte stores per row
  for (int unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
    if (num_pieces[unit] != 0) continue;
    for (int e = thread; e < p.rows * vectors; e += threads) {
      *reinterpret_cast<uint4*>(output_row(p, unit, e / vectors) +
                                8 * (e % vectors)) = make_uint4(0, 0, 0, 0);
    }
  }
}

// Split units with at most this many pieces are merged element-parallel.
constexpr int kFewPieces = 16;

// Publishes a finished piece of a split unit; the CTA that finishes the
// unit's last piece merges all of them (threadfence-reduction pattern: the
// per-unit counter is reset by the merging CTA, ready for the next launch).
// Called by the kThreads threads of named barrier `barrier` (whole warps;
// this one is `thread` among them); `row_stats` is shared memory
// (merge_split_unit).
template <int kThreads>
__device__ __forceinline__ void combine_if_last(const DecodeParams& p,
                                                const WorkItem& item,
                                                int head_dim, float* row_stats,
                                                int barrier, int thread) {
  __threadfence();
  named_barrier_sync(barrier, kThreads);
  const bool last = thread == 0 && atomicAdd(&p.piece_counters[item.unit], 1) ==
                                       item.pieces - 1;
  if (named_barrier_sync_or(barrier, kThreads, last)) {
    __threadfence();
    if (item.pieces <= kFewPieces) {
      // Few pieces: every thread takes (row, channel) elements of all rows.
      merge_split_unit<kThreads>(p, item.unit, item.first_partial, item.pieces,
                                 head_dim, row_stats, barrier, thread);
    } else {
      // Many pieces: a warp per row, 32 pieces' weights per LSE load.
      const int warp = thread / 32;
      for (int row = warp; row < p.rows; row += kThreads / 32) {
        merge_split_row(p, item.unit, item.first_partial, item.pieces, row,
                        head_dim, thread % 32);
      }
    }
    if (thread == 0) p.piece_counters[item.unit] = 0;
  }
}

}  // namespace decode
}  // namespace hpc
