// Warp-level FP8 MMA for streaming expert weights against a few tokens
// (the decode path, moe_decode_*.cuh).
//
// A warp multiplies 16 weight rows (the A side of mma.sync m16n8k32) by 8
// token columns (the B side), 64 bytes of K per step: two k32 MMAs. Lane
// (g = lane / 4, q = lane % 4) loads bytes [16q, 16q + 16) of the step from
// A rows g and g + 8 and from B column g, each straight into registers, and
// hands the same 32-bit words to the A and the B fragment. Both sides so see
// one permutation of K, which leaves every dot product unchanged; the
// weights need no shared memory and no reordering.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

// 16 bytes of streamed weights: read once, so kept out of L1. Not volatile:
// the weights are constant for the call, so the compiler may schedule it.
__device__ __forceinline__ uint4 load_weights16(const uint8_t* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

}  // namespace moe
}  // namespace hpc
