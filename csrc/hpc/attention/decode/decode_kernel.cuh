// Device code of the split-KV paged decode kernel.
//
// Persistent CTAs walk the plan (decode_plan.h): each takes a contiguous run
// of granules and turns it into work items, one per (unit, tile range). A
// unit is one KV head of one sequence; its rows are the query heads of that
// KV head times the query tokens (up to 64), packed into 16-row MMA tiles.
//
// Inside a CTA one producer warp streams 64-token K and V tiles into a ring
// of shared-memory stages with TMA over the paged cache (one box per cache
// block and 128-byte column chunk) and never drains the ring between work
// items. Four consumer warps split each tile: a warp owns one 16-row tile
// and 64 / kTokenGroups tokens, computes S = Q K^T and O += P V with
// mma.sync, and keeps its own online-softmax state; the token groups of a
// row tile are merged once per work item. A unit that is not split writes
// its output directly; a piece of a split unit writes fp32 O and LSE rows
// that the combine merges.
//
// Register layout (m16n8k16, g = lane / 4, q4 = lane % 4):
//  * QK^T: the head dimension is a reduction, so each k-step of 16 channels
//    is permuted to let a lane hold 4 consecutive channels of Q and K
//    (logical k 2q4+{0,1} <-> channel 4q4+{0,1}, k 2q4+8+{0,1} <-> 4q4+{2,3}):
//    one 8-byte (16-bit KV) or 4-byte (FP8 KV) shared load per B fragment.
//  * PV: output columns are permuted so that a lane reads 16 consecutive
//    bytes of each V row it needs, conflict-free, and owns runs of 8 or 16
//    consecutive output channels (PvLayout).
// FP8 K and V are widened to fp16 in registers (exact), so Q is used in
// fp16 and P in fp16: no extra rounding beyond the bf16/fp16 inputs.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cutlass/arch/barrier.h>
#include <cute/arch/copy_sm90_tma.hpp>

#include "attention/common/paged_kv_tma.cuh"
#include "attention/decode/combine.cuh"
#include "attention/decode/decode_params.h"
#include "attention/decode/decode_plan.h"
#include "attention/decode/decode_work.cuh"
#include "common/pdl.cuh"
#include "common/sync.cuh"

namespace hpc {
namespace decode {

constexpr int kConsumerWarps = 4;
constexpr int kDecodeThreads = (kConsumerWarps + 1) * 32;
// Named barrier of the consumer warps (0 is __syncthreads, 1..4 the token
// group merges).
constexpr int kCombineBarrier = 5;
constexpr float kLog2e = 1.4426950408889634f;
// Shared memory a kernel may use on one SM (every Hopper part), and the
// shallowest ring worth running.
constexpr int kSmemPerSm = 227 * 1024;
constexpr int kMinStages = 3;
constexpr int kMaxStages = 8;

// ---------------------------------------------------------------------------
// Shared-memory tile layout
// ---------------------------------------------------------------------------

// One 64-token K (or V) tile as TMA writes it: the head dimension is cut into
// chunks of at most 128 bytes; each chunk is 64 rows with the hardware
// swizzle (16-byte units XOR-ed with the row), which keeps the fragment
// loads below free of bank conflicts.
template <int kHeadDim, int kKvBytes>
struct TileLayout {
  static constexpr int kRowBytes =
      kHeadDim * kKvBytes < 128 ? kHeadDim * kKvBytes : 128;
  static constexpr int kChunkElems = kRowBytes / kKvBytes;
  static constexpr int kChunks = kHeadDim / kChunkElems;
  static constexpr int kChunkBytes = kTileTokens * kRowBytes;
  static constexpr int kMatrixBytes = kChunks * kChunkBytes;
  static constexpr int kStageBytes = 2 * kMatrixBytes;  // K then V
  static_assert(kRowBytes == 128 || kRowBytes == 64, "unsupported row size");

  // Byte offset of byte `byte` of token `token`'s row inside the matrix.
  __device__ static int offset(int token, int byte) {
    const int linear =
        (byte / kRowBytes) * kChunkBytes + token * kRowBytes + byte % kRowBytes;
    constexpr int kMask = kRowBytes / 16 - 1;
    return linear ^ (((linear >> 7) & kMask) << 4);
  }
};

// Stage count, merge scratch and CTAs per SM for one configuration. Two
// CTAs share an SM (eight consumer warps hide each other's latencies) when
// each still gets a ring of kMinStages tiles; otherwise one CTA takes the
// whole SM.
template <int kHeadDim, int kKvBytes>
struct SmemPlan {
  using Layout = TileLayout<kHeadDim, kKvBytes>;
  // Token groups exchange O in chunks of at most 32 registers per lane.
  static constexpr int kOutRegs = kHeadDim / 2;
  static constexpr int kMergeRegs = kOutRegs < 32 ? kOutRegs : 32;
  static constexpr int kScratchBytes =
      (kConsumerWarps - 1) * (kMergeRegs + 4) * 32 * 4;
  // Scratch, alignment slack for the ring, barriers and the per-CTA reserve.
  static constexpr int kFixedBytes = kScratchBytes + 1024 + 1024;
  static constexpr int kCtasPerSm =
      (kSmemPerSm / 2 - kFixedBytes) / Layout::kStageBytes >= kMinStages ? 2
                                                                         : 1;
  static constexpr int kStagesFit =
      (kSmemPerSm / kCtasPerSm - kFixedBytes) / Layout::kStageBytes;
  static constexpr int kStages =
      kStagesFit > kMaxStages ? kMaxStages : kStagesFit;
  static_assert(kStages >= kMinStages, "pipeline must be >= 3 stages deep");
  static constexpr int kBytes =
      kStages * Layout::kStageBytes + kScratchBytes + 1024;
};

// ---------------------------------------------------------------------------
// Producer: TMA over the paged cache
// ---------------------------------------------------------------------------

using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

// K/V are streamed once; keep them from displacing reused data in L2.
constexpr uint64_t kEvictFirst =
    static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);

template <int kHeadDim, int kKvBytes, int kStages>
__device__ void produce_tiles(const DecodeParams& p, const CUtensorMap* tmap_k,
                              const CUtensorMap* tmap_v, uint8_t* stages,
                              uint64_t* full, uint64_t* empty) {
  using Layout = TileLayout<kHeadDim, kKvBytes>;
  // One TMA copy per (K or V, cache block, head-dim chunk): at most 32.
  static_assert(2 * 4 * Layout::kChunks <= 32, "one copy per lane");
  const int lane = threadIdx.x % 32;
  WorkCursor cursor(p, blockIdx.x);
  WorkItem item;
  int it = 0;
  while (cursor.next(item)) {
    ItemBlocks blocks_of(p, item, lane);
    const int h = blocks_of.kv_head;
    const int bs = blocks_of.block_size;
    for (int tile = item.tile_begin; tile < item.tile_end; ++tile, ++it) {
      const int blocks = blocks_of.count(tile);
      const int copies = 2 * blocks * Layout::kChunks;
      const int is_v = lane / (blocks * Layout::kChunks);
      const int blk = (lane % (blocks * Layout::kChunks)) / Layout::kChunks;
      const int chunk = lane % Layout::kChunks;
      const int cache_block = blocks_of.id(tile, blk);

      const int stage = it % kStages;
      EmptyBarrier::wait(&empty[stage], ((it / kStages) & 1) ^ 1);
      if (lane == 0) {
        FullBarrier::arrive_and_expect_tx(
            &full[stage],
            2 * blocks * bs * Layout::kRowBytes * Layout::kChunks);
      }
      __syncwarp();
      if (lane < copies) {
        uint8_t* dst = stages + stage * Layout::kStageBytes;
        cute::SM90_TMA_LOAD_4D::copy(
            is_v ? tmap_v : tmap_k, &full[stage], kEvictFirst,
            dst + is_v * Layout::kMatrixBytes + chunk * Layout::kChunkBytes +
                blk * bs * Layout::kRowBytes,
            chunk * Layout::kChunkElems, 0, h, cache_block);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Consumer math
// ---------------------------------------------------------------------------

template <bool kBf16>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4],
                                             const uint32_t (&a)[4],
                                             uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kBf16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// Two E4M3 values (low byte first) to an fp16 pair; exact.
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// Four consecutive query channels of one row as two MMA-type pairs.
template <bool kBf16Mma>
__device__ __forceinline__ void load_q4(const void* row, ElemType type, int d,
                                        uint32_t& lo, uint32_t& hi) {
  if (type == ElemType::kFp8E4m3) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(
        static_cast<const uint8_t*>(row) + d);
    lo = fp8x2_to_f16x2(w);
    hi = fp8x2_to_f16x2(w >> 16);
    return;
  }
  const uint2 raw =
      *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(row) + d);
  const bool is_bf16 = type == ElemType::kBf16;
  if (is_bf16 == kBf16Mma) {
    lo = raw.x;
    hi = raw.y;
    return;
  }
  // bf16 queries against FP8 KV: fp16 MMA, convert (values stay in range
  // for normalised queries).
  float2 a =
      __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  float2 c =
      __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  lo = pack2<kBf16Mma>(a.x, a.y);
  hi = pack2<kBf16Mma>(c.x, c.y);
}

// B fragment of K (two pairs of consecutive channels) at a smem address.
template <int kKvBytes>
__device__ __forceinline__ void load_k_frag(const uint8_t* ptr, uint32_t& b0,
                                            uint32_t& b1) {
  if constexpr (kKvBytes == 2) {
    const uint2 raw = *reinterpret_cast<const uint2*>(ptr);
    b0 = raw.x;
    b1 = raw.y;
  } else {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(ptr);
    b0 = fp8x2_to_f16x2(w);
    b1 = fp8x2_to_f16x2(w >> 16);
  }
}

// Channel j (of the lane's run) of two V rows, as one MMA-type pair
// (row_a in the low half). `wa`/`wb` hold the rows' run as 32-bit words.
template <int kKvBytes, int kWords>
__device__ __forceinline__ uint32_t v_pair(const uint32_t (&wa)[kWords],
                                           const uint32_t (&wb)[kWords],
                                           int j) {
  if constexpr (kKvBytes == 2) {
    return __byte_perm(wa[j / 2], wb[j / 2], (j % 2) ? 0x7632 : 0x5410);
  } else {
    const int byte = j % 4;
    const uint32_t sel = byte | ((byte + 4) << 4);
    return fp8x2_to_f16x2(__byte_perm(wa[j / 4], wb[j / 4], sel));
  }
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// How a lane reads V and owns output channels in O += P V. The head
// dimension is cut into units of 8 x kUnitChannels channels; in unit u, lane
// group g (lane / 4) reads the kUnitChannels channels starting at
// (u * 8 + g) * kUnitChannels of each V row it needs (one load of at most 16
// bytes; the eight groups cover whole 128-byte swizzled rows, so the loads
// are free of bank conflicts), and n-tile u * kUnitChannels + jj of the MMA
// maps output column n to channel (u * 8 + n) * kUnitChannels + jj.
template <int kHeadDim, int kKvBytes>
struct PvLayout {
  static constexpr int kRowBytes = kHeadDim * kKvBytes;
  static constexpr int kUnitBytes = kRowBytes / 8 < 16 ? kRowBytes / 8 : 16;
  static constexpr int kUnitWords = kUnitBytes / 4;
  static constexpr int kUnitChannels = kUnitBytes / kKvBytes;
  static constexpr int kUnits = kHeadDim / (8 * kUnitChannels);
  static_assert(kUnitChannels % 8 == 0, "16-byte output vectors");
};

// Online-softmax state and output accumulator of one warp: one 16-row tile
// (rows g and g + 8 of the lane) over the warp's token slice.
template <int kHeadDim>
struct RowState {
  float m[2];  // running max, log2 domain
  float l[2];  // running sum (lane-partial until finalised)
  float o[kHeadDim / 8][4];

  __device__ void reset() {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m[i] = -INFINITY;
      l[i] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
    }
  }
};

// Merges the token groups of each row tile into the group's first warp,
// through `scratch` in chunks of kMergeRegs registers per lane.
template <int kHeadDim, int kTokenGroups, int kMergeRegs>
__device__ void merge_token_groups(RowState<kHeadDim>& st, float* scratch,
                                   int row_tile, int token_group, int lane) {
  if constexpr (kTokenGroups > 1) {
    constexpr int kRegs = kHeadDim / 2;
    const int barrier_id = 1 + row_tile;
    constexpr int kThreads = kTokenGroups * 32;
    // Scratch of the row tile: (kTokenGroups - 1) slots, each 4 + kMergeRegs
    // floats per lane, lane-minor.
    float* group_scratch =
        scratch + row_tile * (kTokenGroups - 1) * (kMergeRegs + 4) * 32;
    float factor[kTokenGroups][2];
    if (token_group > 0) {
      float* slot = group_scratch + (token_group - 1) * (kMergeRegs + 4) * 32;
      slot[0 * 32 + lane] = st.m[0];
      slot[1 * 32 + lane] = st.m[1];
      slot[2 * 32 + lane] = st.l[0];
      slot[3 * 32 + lane] = st.l[1];
    }
#pragma unroll
    for (int c0 = 0; c0 < kRegs; c0 += kMergeRegs) {
      if (token_group > 0) {
        float* slot =
            group_scratch + (token_group - 1) * (kMergeRegs + 4) * 32 + 4 * 32;
#pragma unroll
        for (int r = 0; r < kMergeRegs; ++r) {
          slot[r * 32 + lane] = st.o[(c0 + r) / 4][(c0 + r) % 4];
        }
      }
      named_barrier_sync(barrier_id, kThreads);
      if (token_group == 0) {
        if (c0 == 0) {
          float m_all[2] = {st.m[0], st.m[1]};
#pragma unroll
          for (int w = 1; w < kTokenGroups; ++w) {
            const float* slot = group_scratch + (w - 1) * (kMergeRegs + 4) * 32;
#pragma unroll
            for (int i = 0; i < 2; ++i)
              m_all[i] = fmaxf(m_all[i], slot[i * 32 + lane]);
          }
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float m_use = m_all[i] == -INFINITY ? 0.f : m_all[i];
            factor[0][i] = exp2f(st.m[i] - m_use);
            float l = st.l[i] * factor[0][i];
#pragma unroll
            for (int w = 1; w < kTokenGroups; ++w) {
              const float* slot =
                  group_scratch + (w - 1) * (kMergeRegs + 4) * 32;
              factor[w][i] = exp2f(slot[i * 32 + lane] - m_use);
              l += slot[(2 + i) * 32 + lane] * factor[w][i];
            }
            st.m[i] = m_all[i];
            st.l[i] = l;
          }
        }
#pragma unroll
        for (int r = 0; r < kMergeRegs; ++r) {
          const int reg = c0 + r;
          const int i = (reg % 4) / 2;  // row of the register: g or g + 8
          float v = st.o[reg / 4][reg % 4] * factor[0][i];
#pragma unroll
          for (int w = 1; w < kTokenGroups; ++w) {
            const float* slot =
                group_scratch + (w - 1) * (kMergeRegs + 4) * 32 + 4 * 32;
            v += slot[r * 32 + lane] * factor[w][i];
          }
          st.o[reg / 4][reg % 4] = v;
        }
      }
      named_barrier_sync(barrier_id, kThreads);
    }
  }
}

// Writes one finished row (either directly to the output or as a partial).
// Register o[u * kUnitChannels + jj][2 * i + run] holds channel
// (u * 8 + 2 * q4 + run) * kUnitChannels + jj (see PvLayout).
template <int kHeadDim, int kKvBytes>
__device__ void store_row(const DecodeParams& p, const WorkItem& item,
                          const RowState<kHeadDim>& st, int i, int row,
                          int q4) {
  using Pv = PvLayout<kHeadDim, kKvBytes>;
  constexpr int kUc = Pv::kUnitChannels;
  const float v_scale = p.v_scale ? *p.v_scale : 1.f;
  const float l = st.l[i];
  const float inv = l > 0.f ? v_scale / l : 0.f;
  if (item.pieces == 1) {
    uint16_t* out = output_row(p, item.unit, row);
#pragma unroll
    for (int u = 0; u < Pv::kUnits; ++u) {
#pragma unroll
      for (int run = 0; run < 2; ++run) {
#pragma unroll
        for (int j0 = 0; j0 < kUc; j0 += 8) {
          uint4 raw;
          uint32_t* w = reinterpret_cast<uint32_t*>(&raw);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int j = u * kUc + j0 + 2 * k;
            const float x = st.o[j][2 * i + run] * inv;
            const float y = st.o[j + 1][2 * i + run] * inv;
            w[k] = p.out_type == ElemType::kBf16 ? pack2<true>(x, y)
                                                 : pack2<false>(x, y);
          }
          *reinterpret_cast<uint4*>(out + (u * 8 + 2 * q4 + run) * kUc + j0) =
              raw;
        }
      }
    }
    return;
  }
  const int64_t prow = static_cast<int64_t>(item.partial_row) * p.rows + row;
  float* dst = p.partial_out + prow * kHeadDim;
#pragma unroll
  for (int u = 0; u < Pv::kUnits; ++u) {
#pragma unroll
    for (int run = 0; run < 2; ++run) {
#pragma unroll
      for (int j0 = 0; j0 < kUc; j0 += 4) {
        const int j = u * kUc + j0;
        *reinterpret_cast<float4*>(dst + (u * 8 + 2 * q4 + run) * kUc + j0) =
            make_float4(
                st.o[j][2 * i + run] * inv, st.o[j + 1][2 * i + run] * inv,
                st.o[j + 2][2 * i + run] * inv, st.o[j + 3][2 * i + run] * inv);
      }
    }
  }
  if (q4 == 0) {
    p.partial_lse[prow] = l > 0.f ? st.m[i] + log2f(l) : -INFINITY;
  }
}

template <int kHeadDim, typename KvT, int kTokenGroups, int kStages,
          int kMergeRegs>
__device__ void consume_tiles(const DecodeParams& p, const uint8_t* stages,
                              uint64_t* full, uint64_t* empty, float* scratch,
                              float* row_stats) {
  constexpr int kKvBytes = sizeof(KvT);
  constexpr bool kBf16Mma = std::is_same_v<KvT, __nv_bfloat16>;
  using Layout = TileLayout<kHeadDim, kKvBytes>;
  constexpr int kWarpTokens = kTileTokens / kTokenGroups;
  constexpr int kNt = kWarpTokens / 8;  // S n-tiles per warp
  constexpr int kKq = kHeadDim / 16;    // QK k-steps
  constexpr int kRun = kHeadDim / 8;    // output n-tiles
  using Pv = PvLayout<kHeadDim, kKvBytes>;

  const int warp = threadIdx.x / 32;  // 0 .. kConsumerWarps - 1
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int q4 = lane % 4;
  const int row_tile = warp / kTokenGroups;
  const int token_group = warp % kTokenGroups;
  const int rows[2] = {row_tile * 16 + g, row_tile * 16 + g + 8};
  const bool fp8_q = p.q_type == ElemType::kFp8E4m3;
  const float k_scale = p.k_scale ? *p.k_scale : 1.f;
  const bool softcap = p.softcap > 0.f;

  RowState<kHeadDim> st;
  uint32_t qf[kKq][4];
  WorkCursor cursor(p, blockIdx.x);
  WorkItem item;
  int it = 0;
  while (cursor.next(item)) {
    const int b = item.unit % p.batch;
    const int h = item.unit / p.batch;
    // Queries of this lane's two rows, and their scales and positions.
    float row_scale[2];
    int query_pos[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = rows[i];
      const bool live = row < p.rows;
      const int t = row / p.group;
      const int head = h * p.group + row % p.group;
      const int64_t token = static_cast<int64_t>(b) * p.query_tokens + t;
      const int elem_bytes = fp8_q ? 1 : 2;
      const void* q_row =
          static_cast<const uint8_t*>(p.q) +
          (token * p.q_token_stride + head * p.q_head_stride) * elem_bytes;
      float scale = p.scale * k_scale;
      if (live && fp8_q)
        scale *= p.q_scale[token * p.q_scale_token_stride + head];
      row_scale[i] = softcap ? scale / p.softcap : scale * kLog2e;
      query_pos[i] = item.kv_len - p.query_tokens + t;
#pragma unroll
      for (int kk = 0; kk < kKq; ++kk) {
        uint32_t lo = 0, hi = 0;
        if (live) load_q4<kBf16Mma>(q_row, p.q_type, kk * 16 + 4 * q4, lo, hi);
        qf[kk][i] = lo;      // a0 / a1: rows g / g + 8, channels 4q4+{0,1}
        qf[kk][2 + i] = hi;  // a2 / a3: channels 4q4+{2,3}
      }
    }
    st.reset();

    for (int tile = item.tile_begin; tile < item.tile_end; ++tile, ++it) {
      const int stage = it % kStages;
      FullBarrier::wait(&full[stage], (it / kStages) & 1);
      const uint8_t* k_tile = stages + stage * Layout::kStageBytes;
      const uint8_t* v_tile = k_tile + Layout::kMatrixBytes;
      const int tok0 = token_group * kWarpTokens;

      float s[kNt][4];
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < kKq; ++kk) {
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
          uint32_t b0, b1;
          load_k_frag<kKvBytes>(
              k_tile + Layout::offset(tok0 + nt * 8 + g,
                                      (kk * 16 + 4 * q4) * kKvBytes),
              b0, b1);
          mma_m16n8k16<kBf16Mma>(s[nt], qf[kk], b0, b1);
        }
      }

      // Scale, soft-cap, mask; online softmax. Only tiles at the end of
      // the sequence (causal, padding) or at the window's start need masks.
      const int pos0 = tile * kTileTokens + tok0 + 2 * q4;
      const bool unmasked =
          (tile + 1) * kTileTokens <= item.kv_len - p.query_tokens + 1 &&
          (p.window <= 0 || tile * kTileTokens >= item.kv_len - p.window);
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e / 2;
          const int pos = pos0 + nt * 8 + (e % 2);
          float x = s[nt][e] * row_scale[i];
          if (softcap) x = p.softcap * kLog2e * tanhf(x);
          if (!unmasked) {
            const bool visible =
                pos < item.kv_len && pos <= query_pos[i] &&
                (p.window <= 0 || pos > query_pos[i] - p.window);
            x = visible ? x : -INFINITY;
          }
          s[nt][e] = x;
          tile_max[i] = fmaxf(tile_max[i], x);
        }
      }
      float m_use[2], alpha[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float m_new = fmaxf(st.m[i], quad_max(tile_max[i]));
        m_use[i] = m_new == -INFINITY ? 0.f : m_new;
        alpha[i] = exp2f(st.m[i] - m_use[i]);
        st.m[i] = m_new;
        st.l[i] *= alpha[i];
      }
      // Once the running maxima settle, O needs no rescaling.
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int j = 0; j < kRun; ++j) {
          st.o[j][0] *= alpha[0];
          st.o[j][1] *= alpha[0];
          st.o[j][2] *= alpha[1];
          st.o[j][3] *= alpha[1];
        }
      }
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nt][e] = exp2f(s[nt][e] - m_use[e / 2]);
          st.l[e / 2] += s[nt][e];
        }
      }

      // O += P V. V rows past the sequence may hold anything (even NaN):
      // they are zeroed so that P = 0 there really contributes nothing.
      const int valid_tokens = item.kv_len - tile * kTileTokens;
#pragma unroll
      for (int kk = 0; kk < kNt / 2; ++kk) {
        uint32_t a[4];
        a[0] = pack2<kBf16Mma>(s[2 * kk][0], s[2 * kk][1]);
        a[1] = pack2<kBf16Mma>(s[2 * kk][2], s[2 * kk][3]);
        a[2] = pack2<kBf16Mma>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = pack2<kBf16Mma>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        const int t0 = tok0 + kk * 16 + 2 * q4;
        const int vrow[4] = {t0, t0 + 1, t0 + 8, t0 + 9};
#pragma unroll
        for (int u = 0; u < Pv::kUnits; ++u) {
          uint32_t w[4][Pv::kUnitWords];
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const uint8_t* src =
                v_tile + Layout::offset(vrow[r], (u * 8 + g) * Pv::kUnitBytes);
            const uint32_t keep = vrow[r] < valid_tokens ? 0xffffffffu : 0u;
            if constexpr (Pv::kUnitWords == 4) {
              const uint4 raw = *reinterpret_cast<const uint4*>(src);
              w[r][0] = raw.x & keep;
              w[r][1] = raw.y & keep;
              w[r][2] = raw.z & keep;
              w[r][3] = raw.w & keep;
            } else {
              const uint2 raw = *reinterpret_cast<const uint2*>(src);
              w[r][0] = raw.x & keep;
              w[r][1] = raw.y & keep;
            }
          }
#pragma unroll
          for (int jj = 0; jj < Pv::kUnitChannels; ++jj) {
            const uint32_t b0 = v_pair<kKvBytes>(w[0], w[1], jj);
            const uint32_t b1 = v_pair<kKvBytes>(w[2], w[3], jj);
            mma_m16n8k16<kBf16Mma>(st.o[u * Pv::kUnitChannels + jj], a, b0, b1);
          }
        }
      }
      __syncwarp();
      if (lane == 0) EmptyBarrier::arrive(&empty[stage]);
    }

#pragma unroll
    for (int i = 0; i < 2; ++i) st.l[i] = quad_sum(st.l[i]);
    merge_token_groups<kHeadDim, kTokenGroups, kMergeRegs>(
        st, scratch, row_tile, token_group, lane);
    if (token_group == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (rows[i] < p.rows)
          store_row<kHeadDim, kKvBytes>(p, item, st, i, rows[i], q4);
      }
    }
    if (item.pieces > 1) {
      combine_if_last<kConsumerWarps * 32>(p, item, kHeadDim, row_stats,
                                           kCombineBarrier, threadIdx.x);
    }
  }
}

// ---------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------

template <int kHeadDim, typename KvT, int kTokenGroups>
__global__ void __launch_bounds__(kDecodeThreads,
                                  (SmemPlan<kHeadDim, sizeof(KvT)>::kCtasPerSm))
    decode_kernel(const __grid_constant__ DecodeParams p,
                  const __grid_constant__ CUtensorMap tmap_k,
                  const __grid_constant__ CUtensorMap tmap_v) {
  using Smem = SmemPlan<kHeadDim, sizeof(KvT)>;
  constexpr int kStages = Smem::kStages;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // TMA's 128-byte swizzle needs 1024-byte aligned stages.
  uint8_t* stages = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* scratch =
      reinterpret_cast<float*>(stages + kStages * Smem::Layout::kStageBytes);
  __shared__ uint64_t full[kStages];
  __shared__ uint64_t empty[kStages];
  __shared__ float row_stats[2 * kMaxRows];

  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&full[s], 1);
      EmptyBarrier::init(&empty[s], kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  pdl_launch_dependents();
  // The plan, the queries and the cache are written by earlier kernels.
  pdl_wait_for_producer();
  // The kernel's row layout comes from the launch; a plan made for another
  // query count would be walked wrongly, so fail loudly instead.
  if (p.plan[kQueryTokens] != p.query_tokens) __trap();
  if (warp < kConsumerWarps) {
    zero_empty_units(p, kHeadDim, threadIdx.x, kConsumerWarps * 32);
  }
  if (blockIdx.x >= p.plan[kNumCtas]) return;

  if (warp == kConsumerWarps) {
    produce_tiles<kHeadDim, sizeof(KvT), kStages>(p, &tmap_k, &tmap_v, stages,
                                                  full, empty);
  } else {
    consume_tiles<kHeadDim, KvT, kTokenGroups, kStages, Smem::kMergeRegs>(
        p, stages, full, empty, scratch, row_stats);
  }
}

}  // namespace decode
}  // namespace hpc
