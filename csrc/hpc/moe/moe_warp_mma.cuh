// Warp-level FP8 MMA for streaming expert weights against a few tokens
// (the decode path, moe_decode_*.cuh), and the shared-memory tiles they
// read: the weights land there whole through the bulk-copy engine, so a CTA
// has all its bytes in flight at once without holding them in registers.
//
// A warp multiplies 16 weight rows (the A side of mma.sync m16n8k32) by 8
// token columns (the B side), 64 bytes of K per step: two k32 MMAs. Lane
// (g = lane / 4, q = lane % 4) loads bytes [16q, 16q + 16) of the step from
// A rows g and g + 8 and from B column g (16-byte shared-memory loads) and
// hands the same 32-bit words to the A and the B fragment. Both sides so see
// one permutation of K, which leaves every dot product unchanged: the tiles
// stay in their global row-major layout, with no reordering.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cute/arch/copy_sm90_tma.hpp>

namespace hpc {
namespace moe {

constexpr int kStepBytes = 64;  // K bytes per warp MMA step

// d += A(16 x 32) * B(32 x 8), E4M3 inputs, fp32 accumulators. Fragments
// (PTX ISA, m16n8k32 with 8-bit types): a0/a2 row g, a1/a3 row g + 8; a0/a1
// hold k = 4q..4q+3, a2/a3 k = 16+4q..; b0/b1 likewise for column g; d0/d1
// are row g, columns 2q and 2q + 1; d2/d3 row g + 8.
__device__ __forceinline__ void mma_fp8_m16n8k32(float (&d)[4], uint32_t a0,
                                                 uint32_t a1, uint32_t a2,
                                                 uint32_t a3, uint32_t b0,
                                                 uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// One 64-byte K step: `lo` and `hi` are this lane's 16 bytes of A rows g
// and g + 8, `b` its 16 bytes of B column g. Words x, y feed the first MMA
// and z, w the second, identically on both sides.
__device__ __forceinline__ void mma_fp8_step(float (&d)[4], const uint4& lo,
                                             const uint4& hi, const uint4& b) {
  mma_fp8_m16n8k32(d, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
  mma_fp8_m16n8k32(d, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
}

// Warp-wide: lanes 0..15 each copy one 16-row tile row of `row_bytes` bytes
// (lane -> source `rows[lane]`) into shared memory rows `stride` apart with
// the bulk-copy engine; `bar` (arrival count 1) completes when all have
// landed. Every lane of the warp must call it.
template <class RowPtr>
__device__ __forceinline__ void copy_tile_rows(RowPtr rows, int row_bytes,
                                               uint8_t* dst, int stride,
                                               uint64_t* bar) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  const int lane = threadIdx.x % 32;
  if (lane == 0) Barrier::expect_transaction(bar, 16 * row_bytes);
  __syncwarp();  // the expected bytes are set before any copy can land
  if (lane < 16) {
    cute::SM90_BULK_COPY_G2S::copy(rows(lane), bar, dst + lane * stride,
                                   row_bytes);
  }
  __syncwarp();
  if (lane == 0) Barrier::arrive(bar);
}

// One thread: `bytes` contiguous bytes (a whole tile whose rows are
// contiguous in global memory) into shared memory with the bulk-copy
// engine; `bar` (arrival count 1) completes when they have landed.
__device__ __forceinline__ void copy_tile(const uint8_t* src, int bytes,
                                          uint8_t* dst, uint64_t* bar) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  Barrier::arrive_and_expect_tx(bar, bytes);
  cute::SM90_BULK_COPY_G2S::copy(src, bar, dst, bytes);
}

}  // namespace moe
}  // namespace hpc
