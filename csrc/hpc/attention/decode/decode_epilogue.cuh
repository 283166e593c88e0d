// Epilogue of the swap-AB decode kernel: a work item's column sums, the
// merge of the two consumer warpgroups' states when they took the item's
// tiles in turn, and the rows: O / sum (times the V scale of an FP8 cache)
// into the output (a unit that is not split), or fp32 rows and their
// log-sum-exp for the combine (a piece of a split unit).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "attention/common/column_softmax.cuh"
#include "attention/common/named_barriers.h"
#include "attention/common/online_softmax.cuh"
#include "attention/decode/combine.cuh"
#include "attention/decode/decode_config.cuh"
#include "attention/decode/decode_mainloop.cuh"
#include "attention/decode/decode_params.h"
#include "common/sync.cuh"

namespace hpc {
namespace decode {

__device__ __forceinline__ uint16_t to_output(float x, ElemType type) {
  if (type == ElemType::kBf16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
  return __half_as_ushort(__float2half_rn(x));
}

// Taking turns: warpgroup 1 hands its O^T, column maxima and sums to
// warpgroup 0 through shared memory (value-major, thread-minor: both hold
// the same (channel, column) in the same register), which rescales both to
// the larger maximum and adds them.
template <class Config, class FragO, int kSlots>
__device__ void merge_warpgroups(const ConsumerGroup& g, uint8_t* smem,
                                 FragO& acc_o, float (&m)[kSlots],
                                 float (&sum)[kSlots]) {
  constexpr int kValues = decltype(cute::size(acc_o))::value;
  static_assert(kValues + 2 * kSlots == Config::kMergeFloatsPerThread);
  float* merge = reinterpret_cast<float*>(smem + Config::kMergeOffset);
  float* merge_m = merge + kValues * 128;
  float* merge_sum = merge_m + kSlots * 128;
  if (g.wg == 1) {
#pragma unroll
    for (int i = 0; i < kValues; ++i) merge[i * 128 + g.tid] = acc_o(i);
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      merge_m[s * 128 + g.tid] = m[s];
      merge_sum[s * 128 + g.tid] = sum[s];
    }
  }
  named_barrier_sync(static_cast<int>(attention::DecodeBarrier::kConsumers),
                     kWgmmaConsumerThreads);
  if (g.wg == 1) return;
  float f0[kSlots], f1[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const float m1 = merge_m[s * 128 + g.tid];
    const float m_all = fmaxf(m[s], m1);
    const float ref = m_all == -INFINITY ? 0.f : m_all;
    f0[s] = exp2f(m[s] - ref);
    f1[s] = exp2f(m1 - ref);
    sum[s] = sum[s] * f0[s] + merge_sum[s * 128 + g.tid] * f1[s];
    m[s] = m_all;
  }
#pragma unroll
  for (int i = 0; i < kValues; ++i) {
    const int s = attention::column_slot_of(i % (2 * kSlots));
    acc_o(i) = acc_o(i) * f0[s] + merge[i * 128 + g.tid] * f1[s];
  }
}

// Finishes a warpgroup's part of `item`: column sums (through the softmax
// scratch half `parity`, flipped), the merge when the warpgroups took turns,
// and the stores of its rows (row0 + column). Register value i of O^T holds
// channel 64 (i / (N / 2)) + 16 warp + lane / 4 + 8 row_half(i) of column
// fragment_column(i).
template <class Config, class FragO>
__device__ void store_item(const DecodeParams& p, const WorkItem& item,
                           const ConsumerGroup& g, uint8_t* smem, FragO& acc_o,
                           typename Config::Softmax& softmax, int& parity) {
  constexpr int kSlots = Config::kWgRows / 4;
  constexpr int kValues = decltype(cute::size(acc_o))::value;
  const int lane = g.tid % 32;
  const int warp = g.tid / 32;
  float* reduce = reinterpret_cast<float*>(smem + Config::kReduceOffset +
                                           g.wg * Config::kReduceBytes);
  float sum[kSlots], m[kSlots];
  softmax.column_sums(sum, reduce, parity, g.barrier());
  parity ^= 1;
#pragma unroll
  for (int s = 0; s < kSlots; ++s) m[s] = softmax.m[s];
  if constexpr (!Config::kSplitRows) {
    merge_warpgroups<Config>(g, smem, acc_o, m, sum);
    if (g.wg == 1) return;
  }

  // Per column slot: 1 / sum (times the V scale) and the row's destination,
  // computed once (the row's token and head take an integer division).
  const float v_scale = p.v_scale ? *p.v_scale : 1.f;
  const bool split = item.pieces > 1;
  float inv[kSlots];
  bool live[kSlots];
  uint16_t* out_row[kSlots];
  float* partial_row[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    inv[s] = sum[s] > 0.f ? __fdividef(v_scale, sum[s]) : 0.f;
    const int row = g.row0 + attention::column_of_slot(s, lane);
    live[s] = row < p.rows;
    if (split) {
      partial_row[s] = p.partial_out +
                       (static_cast<int64_t>(item.partial_row) * p.rows + row) *
                           Config::kHeadDim;
    } else {
      out_row[s] = live[s] ? output_row(p, item.unit, row) : nullptr;
    }
  }
#pragma unroll
  for (int i = 0; i < kValues; ++i) {
    const int v = i % (2 * kSlots);
    const int s = attention::column_slot_of(v);
    if (!live[s]) continue;
    const int channel = 64 * (i / (2 * kSlots)) + 16 * warp + lane / 4 +
                        8 * attention::row_half_of(v);
    const float x = acc_o(i) * inv[s];
    if (split) {
      partial_row[s][channel] = x;
    } else {
      out_row[s][channel] = to_output(x, p.out_type);
    }
  }
  if (split && warp == 0 && lane < 4) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int row = g.row0 + attention::column_of_slot(s, lane);
      if (row >= p.rows) continue;
      p.partial_lse[static_cast<int64_t>(item.partial_row) * p.rows + row] =
          sum[s] > 0.f ? m[s] + log2f(sum[s]) -
                             static_cast<float>(Config::Softmax::kSumLog2Scale)
                       : -INFINITY;
    }
  }
}

}  // namespace decode
}  // namespace hpc
