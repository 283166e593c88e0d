// Device code of the split-KV combine. The decode kernel's CTAs merge a
// split unit's fp32 pieces into the output themselves (decode_kernel.cuh):
// the pieces that end their CTAs' work share the merge, or the CTA that
// finishes the last piece does it alone, so no separate kernel or launch is
// needed. Each output element is summed the same way whoever merges it, so
// the result does not depend on which CTA merges or when.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode/decode_params.h"
#include "attention/decode/decode_plan.h"
#include "common/sync.cuh"

namespace hpc {
namespace decode {

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

// The merge of one output element (a row's 4 channels) over a unit's
// pieces is done by a group of merge_lanes(pieces) lanes: lane s takes
// pieces s, s + lanes, ..., kPiecesPerLane loads in flight at a time, keeps
// a running max and sum of 2^lse and the scaled sum of its partial rows,
// and the group folds its lanes together (butterfly). The group size
// depends on the piece count alone, so an element's sum, and the output
// bits, do not depend on which CTA or thread merges it, nor on how many
// CTAs share the unit's merge.
constexpr int kPiecesPerLane = 8;

__device__ __forceinline__ int merge_lanes(int pieces) {
  int lanes = 1;
  while (lanes < 32 && lanes * kPiecesPerLane < pieces) lanes *= 2;
  return lanes;
}

struct MergeState {
  float m = -INFINITY;  // running max of the lse (log2 domain)
  float sum = 0.f;      // sum of 2^(lse - m)
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);

  // Adds a state with max m_o, sum s_o and partial sum a_o.
  __device__ __forceinline__ void fold(float m_o, float s_o, float4 a_o) {
    const float m_new = fmaxf(m, m_o);
    if (m_new == -INFINITY) return;
    const float a = exp2f(m - m_new);
    const float b = exp2f(m_o - m_new);
    sum = sum * a + s_o * b;
    acc.x = acc.x * a + a_o.x * b;
    acc.y = acc.y * a + a_o.y * b;
    acc.z = acc.z * a + a_o.z * b;
    acc.w = acc.w * a + a_o.w * b;
    m = m_new;
  }
};

// kThreads threads (whole warps; this one is `thread`) merge elements
// [begin, end) of a unit split into `pieces` pieces whose partial rows start
// at `first`; element e is channels 4 (e % quads) .. of row e / quads. A
// thread takes kElems elements per round, each with kSlots pieces' loads in
// flight (kSlots >= the lane's pieces per pass, or kPiecesPerLane).
// Partials are read through L2 (other CTAs wrote them).
template <int kThreads, int kElems, int kSlots>
__device__ __forceinline__ void merge_elements(const DecodeParams& p, int unit,
                                               int first, int pieces,
                                               int head_dim, int begin, int end,
                                               int thread) {
  const int lanes = merge_lanes(pieces);
  const int groups = kThreads / lanes;
  const int lane = thread % lanes;
  const int quads = head_dim / 4;
  const int64_t piece_rows = static_cast<int64_t>(p.rows);
  // Every thread runs the same rounds: the butterfly takes whole warps.
  for (int base = begin; base < end; base += groups * kElems) {
    MergeState state[kElems];
#pragma unroll
    for (int k = 0; k < kElems; ++k) {
      const int e = base + k * groups + thread / lanes;
      const bool active = e < end;
      const int row = active ? e / quads : 0;
      const float* lse = p.partial_lse + first * piece_rows + row;
      const float* partial = p.partial_out +
                             (first * piece_rows + row) * head_dim +
                             4 * (active ? e % quads : 0);
      for (int j0 = lane; j0 < pieces; j0 += lanes * kSlots) {
        float x[kSlots];
        float4 v[kSlots];
#pragma unroll
        for (int j = 0; j < kSlots; ++j) {
          const int i = j0 + j * lanes;
          const bool load = active && i < pieces;
          x[j] = load ? __ldcg(lse + i * piece_rows) : -INFINITY;
          v[j] = load ? __ldcg(reinterpret_cast<const float4*>(
                            partial + i * piece_rows * head_dim))
                      : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        float m_chunk = -INFINITY;
#pragma unroll
        for (int j = 0; j < kSlots; ++j) m_chunk = fmaxf(m_chunk, x[j]);
        if (m_chunk == -INFINITY) continue;
        MergeState chunk;
        chunk.m = m_chunk;
#pragma unroll
        for (int j = 0; j < kSlots; ++j) {
          const float w = exp2f(x[j] - m_chunk);
          chunk.sum += w;
          chunk.acc.x += w * v[j].x;
          chunk.acc.y += w * v[j].y;
          chunk.acc.z += w * v[j].z;
          chunk.acc.w += w * v[j].w;
        }
        state[k].fold(chunk.m, chunk.sum, chunk.acc);
      }
    }
#pragma unroll
    for (int k = 0; k < kElems; ++k) {
      for (int offset = lanes / 2; offset > 0; offset /= 2) {
        const float m_o = __shfl_xor_sync(0xffffffffu, state[k].m, offset);
        const float s_o = __shfl_xor_sync(0xffffffffu, state[k].sum, offset);
        float4 a_o;
        a_o.x = __shfl_xor_sync(0xffffffffu, state[k].acc.x, offset);
        a_o.y = __shfl_xor_sync(0xffffffffu, state[k].acc.y, offset);
        a_o.z = __shfl_xor_sync(0xffffffffu, state[k].acc.z, offset);
        a_o.w = __shfl_xor_sync(0xffffffffu, state[k].acc.w, offset);
        state[k].fold(m_o, s_o, a_o);
      }
      const int e = base + k * groups + thread / lanes;
      if (e < end && lane == 0) {
        const float inv = state[k].sum > 0.f ? 1.f / state[k].sum : 0.f;
        const float4 acc = state[k].acc;
        store4(output_row(p, unit, e / quads) + 4 * (e % quads), p.out_type,
               make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
      }
    }
  }
}

// merge_elements with the most loads in flight for the piece count: one
// lane per element up to 4 pieces, taking 4 or 2 elements at once; else
// kPiecesPerLane pieces per lane. The slots past a lane's pieces add
// zeros, so every choice sums an element the same way.
template <int kThreads>
__device__ __forceinline__ void merge_unit_elements(const DecodeParams& p,
                                                    int unit, int first,
                                                    int pieces, int head_dim,
                                                    int begin, int end,
                                                    int thread) {
  if (pieces <= 2) {
    merge_elements<kThreads, 4, 2>(p, unit, first, pieces, head_dim, begin, end,
                                   thread);
  } else if (pieces <= 4) {
    merge_elements<kThreads, 2, 4>(p, unit, first, pieces, head_dim, begin, end,
                                   thread);
  } else {
    merge_elements<kThreads, 1, kPiecesPerLane>(p, unit, first, pieces,
                                                head_dim, begin, end, thread);
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

// Publishes a finished piece of a split unit and takes its part in the
// unit's merge. Called by the kThreads threads of named barrier `barrier`
// (whole warps; this one is `thread` among them) after the piece's partial
// rows are stored.
//
// The unit's counter counts its finished pieces, then its merged slices.
// When the unit has mergers (`item_mergers`, the item's WorkItem::mergers)
// and the grid is resident, each of its first `mergers` pieces, the last
// item of its CTA, waits until every piece is in and merges one slice of
// the unit's elements, so the merge is spread over those CTAs; the merger
// that counts the last slice resets the counter for the next launch.
// Otherwise the CTA that finishes the last piece merges alone and resets it
// (threadfence-reduction pattern).
// Not inlined: it runs once per item, and kept apart its registers and
// branches do not weigh on the consumer mainloop's code.
template <int kThreads>
__device__ __noinline__ void combine_pieces(const DecodeParams& p,
                                            const WorkItem& item,
                                            int item_mergers, int head_dim,
                                            int barrier, int thread) {
  __threadfence();  // this piece's partial rows before its count
  named_barrier_sync(barrier, kThreads);
  int32_t* counter = p.piece_counters + item.unit;
  const int elems = p.rows * (head_dim / 4);
  const int mergers = p.grid_resident ? item_mergers : 0;
  const int piece = item.partial_row - item.first_partial;
  if (piece < mergers) {
    if (thread == 0) {
      atomicAdd(counter, 1);
      while (load_acquire(counter) < item.pieces) {
      }
      // Every merger passed its wait when the slices' count is full.
      if (atomicAdd(counter, 1) == item.pieces + mergers - 1) *counter = 0;
    }
    named_barrier_sync(barrier, kThreads);
    merge_unit_elements<kThreads>(p, item.unit, item.first_partial, item.pieces,
                                  head_dim, piece * elems / mergers,
                                  (piece + 1) * elems / mergers, thread);
    return;
  }
  const bool last = thread == 0 && atomicAdd(counter, 1) == item.pieces - 1;
  if (mergers == 0 && named_barrier_sync_or(barrier, kThreads, last)) {
    __threadfence();
    merge_unit_elements<kThreads>(p, item.unit, item.first_partial, item.pieces,
                                  head_dim, 0, elems, thread);
    if (thread == 0) *counter = 0;
  }
}

}  // namespace decode
}  // namespace hpc
