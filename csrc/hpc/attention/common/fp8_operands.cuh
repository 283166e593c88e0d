// FP8 (E4M3) operands in the forms the FP8 wgmma takes, for every attention
// kernel: both operands K-major, A from registers or shared memory.
//
//  * P: the fp32 S accumulator of one warpgroup, rounded to E4M3 into the
//    A fragment of O += P V. The m64nN accumulator gives a thread columns
//    {2t, 2t + 1, 8 + 2t, 9 + 2t} of every 16 (t = lane % 4); the 8-bit A
//    fragment wants k = 4t .. 4t + 3. Rather than move bytes between
//    threads, the fragment keeps the accumulator's columns and the keys of
//    V are permuted to match: k-position 16 h + 4 t + j of a 32-key block
//    holds key 16 h + prob_key_of_position(4 t + j).
//  * V^T: V arrives as [key][channel] rows (the cache's layout); PV needs
//    [channel][key] rows. One warp transposes 16 keys x 32 channels per
//    step: ldmatrix.trans on 16-bit pairs gives a thread the channel pair
//    (2c, 2c + 1) of keys (2t, 2t + 1) and of (8 + 2t, 9 + 2t), two byte
//    permutes give each channel's four keys in the permuted order above,
//    and stmatrix writes them as channel rows.
//  * 16-bit rows quantized per row to E4M3 with a power-of-two scale (Q of
//    models whose queries are not FP8): values round as a cast to E4M3
//    rounds them (what vLLM's FP8 attention paths and their tests do),
//    while rows far from E4M3's range neither saturate nor go subnormal.
//
// Tiles are [chunk][row][kRowBytes] with the kRowBytes swizzle of the TMA
// copies and of the wgmma layouts (swizzled_offset).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include <cute/tensor.hpp>

#include "attention/common/swizzle.h"
#include "common/cluster.cuh"

namespace hpc {
namespace attention {

constexpr float kE4m3Max = 448.f;

// The key at k-position `pos` (0..15) of a 16-key group of the PV operand
// (see the file comment): the order the P fragment and V^T agree on.
__host__ __device__ constexpr int prob_key_of_position(int pos) {
  return 8 * ((pos & 3) >> 1) + 2 * (pos >> 2) + (pos & 1);
}

// The k-position of key `key` (0..15) of a 16-key group: the inverse of
// prob_key_of_position.
__host__ __device__ constexpr int position_of_prob_key(int key) {
  return 4 * ((key >> 1) & 3) + 2 * (key >> 3) + (key & 1);
}

constexpr bool prob_key_positions_are_inverse() {
  for (int k = 0; k < 16; ++k) {
    if (prob_key_of_position(position_of_prob_key(k)) != k) return false;
  }
  return true;
}
static_assert(prob_key_positions_are_inverse(),
              "P^T and V^T must agree on the key at each k-position");

// Two floats to two E4M3 bytes (low byte first), saturating.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  return static_cast<uint32_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

// The S accumulator of 16 columns x 2 rows per value group (values 16 j ..
// 16 j + 15 of a thread: 32 columns of the tile) as the four 32-bit
// registers of the A fragment of one k = 32 step of an E4M3 wgmma:
// register 2 h + r holds row half r, columns {2t, 2t+1, 8+2t, 9+2t} + 16 h.
template <class FragS, class Regs>
__device__ __forceinline__ void probabilities_to_e4m3(const FragS& s, Regs& a) {
  static_assert(int(cute::size(FragS{})) % 16 == 0);
#pragma unroll
  for (int j = 0; j < int(cute::size(FragS{})) / 16; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int v = 16 * j + 8 * h + 2 * r;
        a(4 * j + 2 * h + r) =
            e4m3x2(s(v), s(v + 1)) | (e4m3x2(s(v + 4), s(v + 5)) << 16);
      }
    }
  }
}

// V^T of a key tile, by kWarps warps: `src` holds kKeys keys of kHeadDim
// E4M3 channels as [chunk][key][kSrcRowBytes]; `dst` receives kHeadDim rows
// of kKeys bytes (one chunk, the kKeys-byte swizzle), k-positions permuted
// as prob_key_of_position. Keys at or past `valid` become zeros: their
// cache slots may hold anything (NaN), and a zero probability times NaN is
// NaN. A step is 16 keys x 32 channels; the lane parts of its addresses are
// fixed, so a step adds its key offset and XORs its channel bits in (the
// swizzle only moves bytes within a row, by the row's place in its atom,
// which steps of 16 keys and 32 channels keep).
template <int kKeys, int kHeadDim, int kSrcRowBytes, int kWarps>
class VTransposer {
 public:
  static_assert(kKeys % 16 == 0 && kHeadDim % 32 == 0);
  static constexpr int kKeyGroups = kKeys / 16;
  static constexpr int kSteps = kKeyGroups * (kHeadDim / 32);
  static constexpr int kStepsPerWarp = (kSteps + kWarps - 1) / kWarps;
  // Steps whose loads are in flight together.
  static constexpr int kBatch = 4;

  __device__ VTransposer() {
    const int lane = threadIdx.x % 32;
    const int matrix = lane / 8;  // the 8x8 (16-bit) matrix it addresses
    const int r = lane % 8;
    // Loads: keys +0..7 / +8..15 (matrix & 1) of channels +0..15 / +16..31
    // (matrix >> 1). Stores: channel rows 16 (matrix >> 1) + 2r + (matrix
    // & 1).
    src_lane_ = swizzled_offset<kSrcRowBytes>(8 * (matrix & 1) + r,
                                              16 * (matrix >> 1), kKeys);
    dst_lane_ = swizzled_offset<kKeys>(
        16 * (matrix >> 1) + 2 * r + (matrix & 1), 0, kHeadDim);
    // Byte b of a stored word: the key at k-position 4t + b of the group.
    const int t = lane % 4;
    key_of_byte_ = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      key_of_byte_ |= static_cast<uint32_t>(prob_key_of_position(4 * t + b))
                      << (8 * b);
    }
  }

  // By every lane of warp `warp` (0 .. kWarps - 1).
  __device__ void operator()(const uint8_t* src, uint8_t* dst, int valid,
                             int warp) const {
    const uint32_t src_base = smem_address(src);
    const uint32_t dst_base = smem_address(dst);
#pragma unroll 1
    for (int i0 = 0; i0 < kStepsPerWarp; i0 += kBatch) {
      uint32_t w[kBatch][4];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const uint32_t step = warp + (i0 + j) * kWarps;
        if (i0 + j < kStepsPerWarp && step < kSteps) {
          asm volatile(
              "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, "
              "%3}, [%4];\n"
              : "=r"(w[j][0]), "=r"(w[j][1]), "=r"(w[j][2]), "=r"(w[j][3])
              : "r"(src_base + src_offset(step)));
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const uint32_t step = warp + (i0 + j) * kWarps;
        if (i0 + j < kStepsPerWarp && step < kSteps) {
          // w[j][2m + i]: channels (2c, 2c + 1) of keys 8i + 2t and
          // 8i + 2t + 1 (c = lane / 4, channel block m).
          uint32_t out[4];
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            out[2 * m] = __byte_perm(w[j][2 * m], w[j][2 * m + 1], 0x6420);
            out[2 * m + 1] = __byte_perm(w[j][2 * m], w[j][2 * m + 1], 0x7531);
          }
          const int k0 = key0(step);
          if (k0 + 16 > valid) {
            uint32_t keep = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
              const int key = k0 + ((key_of_byte_ >> (8 * b)) & 0xff);
              keep |= key < valid ? 0xffu << (8 * b) : 0u;
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) out[i] &= keep;
          }
          asm volatile(
              "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, "
              "%4};\n" ::"r"(dst_base + dst_offset(step)),
              "r"(out[0]), "r"(out[1]), "r"(out[2]), "r"(out[3])
              : "memory");
        }
      }
    }
  }

 private:
  __device__ static int key0(uint32_t step) {
    return static_cast<int>(step % kKeyGroups) * 16;
  }
  __device__ static uint32_t channel0(uint32_t step) {
    return step / kKeyGroups * 32;
  }
  __device__ uint32_t src_offset(uint32_t step) const {
    const uint32_t d0 = channel0(step);
    return (d0 / kSrcRowBytes * (kKeys * kSrcRowBytes) +
            key0(step) * kSrcRowBytes + src_lane_) ^
           (d0 % kSrcRowBytes);
  }
  __device__ uint32_t dst_offset(uint32_t step) const {
    return (channel0(step) * kKeys + dst_lane_) ^ key0(step);
  }

  uint32_t src_lane_;
  uint32_t dst_lane_;
  uint32_t key_of_byte_;
};

// The eight 16-bit values (bf16 when `bf16`, else fp16) of a 16-byte unit,
// widened to float into x[0..7].
__device__ __forceinline__ void unpack_16bit_unit(const uint4& raw, bool bf16,
                                                  float* x) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f =
        bf16 ? __bfloat1622float2(
                   *reinterpret_cast<const __nv_bfloat162*>(&words[i]))
             : __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

// The largest |x| of a row whose parts are spread over kLanes consecutive
// lanes (each passing the largest of its own part). Every lane of the warp
// takes part.
template <int kLanes>
__device__ __forceinline__ float row_abs_max(float part_max) {
  static_assert(kLanes <= 32 && 32 % kLanes == 0);
#pragma unroll
  for (int lanes = 1; lanes < kLanes; lanes *= 2) {
    part_max = fmaxf(part_max, __shfl_xor_sync(0xffffffffu, part_max, lanes));
  }
  return part_max;
}

// The scale of a row quantized to E4M3 whose largest |x| is `amax`: the
// smallest power of two at least amax / 448 (0 for a zero row). Scaling by
// a power of two commutes with rounding, so x / scale rounds to the E4M3
// value of x itself, times 1 / scale.
__device__ __forceinline__ float e4m3_row_scale(float amax) {
  if (!(amax > 0.f)) return 0.f;
  const uint32_t bits =
      __float_as_uint(fmaxf(amax / kE4m3Max, 1.17549435e-38f));
  // The exponent, raised by one unless the mantissa is zero.
  const uint32_t exponent = (bits >> 23) + ((bits & 0x7fffffu) != 0);
  return __uint_as_float(exponent << 23);
}

// Sixteen values divided by `scale` (a power of two from e4m3_row_scale,
// whose inverse is exact; 0 gives zeros) as sixteen E4M3 bytes.
__device__ __forceinline__ uint4 quantize16_e4m3(const float* x, float scale) {
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  uint32_t q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    q[i] = e4m3x2(x[4 * i] * inv, x[4 * i + 1] * inv) |
           (e4m3x2(x[4 * i + 2] * inv, x[4 * i + 3] * inv) << 16);
  }
  return make_uint4(q[0], q[1], q[2], q[3]);
}

// Two E4M3 terms of a value: y ~ hi + lo / kE4m3ResidualScale. Rounding to
// E4M3 (3 mantissa bits) leaves a residual of at most 2^-4 |y|, so the
// residual term, scaled by 2^4, uses the same range as the first; a
// product over the two terms is about as exact as one over 16-bit values.
constexpr float kE4m3ResidualScale = 16.f;

// Two E4M3 bytes (the low 16 bits of `two`) as two floats.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// quantize16_e4m3 with the residual term: `hi` the sixteen E4M3 bytes of
// x / scale, `lo` those of the residuals times kE4m3ResidualScale.
__device__ __forceinline__ void quantize16_e4m3_two_terms(const float* x,
                                                          float scale,
                                                          uint4& hi,
                                                          uint4& lo) {
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  uint32_t h[4], l[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t pair_hi[2], pair_lo[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float y0 = x[4 * i + 2 * j] * inv;
      const float y1 = x[4 * i + 2 * j + 1] * inv;
      pair_hi[j] = e4m3x2(y0, y1);
      const float2 r = e4m3x2_to_float2(pair_hi[j]);
      pair_lo[j] = e4m3x2((y0 - r.x) * kE4m3ResidualScale,
                          (y1 - r.y) * kE4m3ResidualScale);
    }
    h[i] = pair_hi[0] | (pair_hi[1] << 16);
    l[i] = pair_lo[0] | (pair_lo[1] << 16);
  }
  hi = make_uint4(h[0], h[1], h[2], h[3]);
  lo = make_uint4(l[0], l[1], l[2], l[3]);
}

// The layout of 16-bit query rows quantized per row to E4M3
// (e4m3_row_scale): a tile of kHeadDim channels stored [chunk of 64][row][128
// bytes] over kTileRows rows (the staging tile the copies fill). The
// quantizing warps and the readers of the quantized tile each derive a
// row's scale from it, by the same rule, so no scale changes hands.
template <int kHeadDim, int kTileRows>
struct StagedRows16 {
  static_assert(kHeadDim % 64 == 0);

  // The offset of channel `c` (a multiple of 8) of row `row`.
  __device__ static int offset(int row, int c) {
    return swizzled_offset<128>(row, 2 * c, kTileRows);
  }

  // The scale of row `row`, from kLanes consecutive lanes that each read
  // kHeadDim / kLanes channels (`part` = lane % kLanes). Every lane of the
  // warp takes part.
  template <int kLanes>
  __device__ static float row_scale(const uint8_t* src, int row, int part,
                                    bool bf16) {
    constexpr int kUnits = kHeadDim / kLanes / 8;
    static_assert(kUnits >= 1 && kHeadDim % (8 * kLanes) == 0);
    float amax = 0.f;
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      float x[8];
      unpack_16bit_unit(*reinterpret_cast<const uint4*>(
                            src + offset(row, 8 * (kUnits * part + u))),
                        bf16, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(x[i]));
    }
    return e4m3_row_scale(row_abs_max<kLanes>(amax));
  }

  // Rows [0, rows) quantized into `dst` ([chunk][row][kDstRowBytes] over
  // kTileRows rows) by `threads` threads (whole warps; this one is
  // `thread`). Each row is split over kHeadDim / 16 consecutive lanes of 16
  // channels (one 16-byte E4M3 unit each); lane group g takes rows g,
  // g + groups, ... Every lane of a warp takes part in each step.
  template <int kDstRowBytes>
  __device__ static void quantize(const uint8_t* src, uint8_t* dst, bool bf16,
                                  int rows, int thread, int threads) {
    constexpr int kLanesPerRow = kHeadDim / 16;
    const int part = thread % kLanesPerRow;
    const int group = thread / kLanesPerRow;
    const int groups = threads / kLanesPerRow;
#pragma unroll 1
    for (int base = 0; base < rows; base += groups) {
      const int row = min(base + group, kTileRows - 1);
      float x[16];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        unpack_16bit_unit(*reinterpret_cast<const uint4*>(
                              src + offset(row, 16 * part + 8 * u)),
                          bf16, &x[8 * u]);
      }
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
      amax = row_abs_max<kLanesPerRow>(amax);
      if (base + group >= rows) continue;
      // The readers derive the same scale from the same amax.
      *reinterpret_cast<uint4*>(
          dst + swizzled_offset<kDstRowBytes>(row, 16 * part, kTileRows)) =
          quantize16_e4m3(x, e4m3_row_scale(amax));
    }
  }
};

}  // namespace attention
}  // namespace hpc
