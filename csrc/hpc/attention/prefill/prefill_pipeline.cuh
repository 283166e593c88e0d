// The shared-memory pipeline of the paged prefill kernel: a Q buffer and
// two rings, K (kStages stages) and V (kVStages), each stage guarded by a
// full barrier (its contents landed) and an empty barrier (every consumer
// warp is done reading it). K and V advance together, but a V stage is
// released one step after the K stage of its key tile, since O += P V runs
// beside the next S = Q K^T. FP8 caches add a staging tile for 16-bit
// queries and a ring of kRawSlots raw V tiles ahead of the V stages, which
// producer warps fill with V^T (prefill_load.cuh): the copies in flight
// are the raw slots, so that ring is the deep one.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "attention/common/ring_state.cuh"

namespace hpc {
namespace prefill {

using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

// The kernel's roles.
constexpr int kProducerThreads = 128;  // one warpgroup
constexpr int kConsumerThreads = 256;  // two warpgroups
constexpr int kPrefillThreads = kProducerThreads + kConsumerThreads;
constexpr int kConsumerWarps = kConsumerThreads / 32;
// FP8 caches: producer warps 1..3 transpose V (and quantize 16-bit Q);
// warp 0 issues the copies.
constexpr int kTransposeWarps = kProducerThreads / 32 - 1;

template <int kStages, int kVStages, int kRawSlots>
struct PipelineBarriers {
  uint64_t q_full;
  uint64_t q_empty;
  uint64_t k_full[kStages];
  uint64_t k_empty[kStages];
  uint64_t v_full[kVStages];
  uint64_t v_empty[kVStages];
  // FP8 caches: the 16-bit queries' staging tile and the raw V tiles.
  uint64_t q_staged;
  uint64_t raw_full[kRawSlots > 0 ? kRawSlots : 1];
  uint64_t raw_empty[kRawSlots > 0 ? kRawSlots : 1];

  // q_arrivals, v_arrivals: 1 where TMA fills the buffer (one expect_tx
  // arrival), else the producer warps that write it (who also release the
  // raw tiles).
  __device__ void init(int q_arrivals, int v_arrivals) {
    FullBarrier::init(&q_staged, 1);
#pragma unroll
    for (int s = 0; s < kRawSlots; ++s) {
      FullBarrier::init(&raw_full[s], 1);
      EmptyBarrier::init(&raw_empty[s], v_arrivals);
    }
    FullBarrier::init(&q_full, q_arrivals);
    EmptyBarrier::init(&q_empty, kConsumerWarps);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&k_full[s], 1);
      EmptyBarrier::init(&k_empty[s], kConsumerWarps);
    }
#pragma unroll
    for (int s = 0; s < kVStages; ++s) {
      FullBarrier::init(&v_full[s], v_arrivals);
      EmptyBarrier::init(&v_empty[s], kConsumerWarps);
    }
  }
};

using attention::RingState;

// Where a role of the kernel is in the pipeline, carried from tile to tile:
// its positions in the K, V and raw V rings and the Q buffer's phase.
template <int kStages, int kVStages, int kRawSlots>
struct PipelineState {
  RingState<kStages> k;
  RingState<kVStages> v;
  RingState<kRawSlots> raw;
  uint32_t q_phase = 0;
};

}  // namespace prefill
}  // namespace hpc
