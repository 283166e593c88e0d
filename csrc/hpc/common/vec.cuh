// Vectorised access and conversions used by the element-wise kernels: every
// thread moves 8 contiguous elements (16 bytes of bf16/fp16, 8 bytes of FP8).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace hpc {

constexpr int kVecElems = 8;
constexpr float kFp8E4m3Max = 448.0f;

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// Converts 8 16-bit elements already in registers to floats.
template <typename T>
__device__ __forceinline__ void unpack8(const T* elems,
                                        float (&dst)[kVecElems]) {
  static_assert(sizeof(T) == 2, "unpack8 expects a 16-bit type");
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) dst[i] = to_float(elems[i]);
}

// Loads 8 16-bit elements (one 16-byte load) as floats.
template <typename T>
__device__ __forceinline__ void load8(const T* src, float (&dst)[kVecElems]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  unpack8(reinterpret_cast<const T*>(&raw), dst);
}

template <typename T>
__device__ __forceinline__ void store8(T* dst, const float (&src)[kVecElems]) {
  static_assert(sizeof(T) == 2, "store8 expects a 16-bit type");
  uint4 raw;
  T* elems = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) elems[i] = from_float<T>(src[i]);
  *reinterpret_cast<uint4*>(dst) = raw;
}

// Stores src * scale_inv as 8 saturated FP8-E4M3 bytes (one 8-byte store).
__device__ __forceinline__ void store8_fp8(uint8_t* dst,
                                           const float (&src)[kVecElems],
                                           float scale_inv) {
  uint2 raw;
  __nv_fp8x2_storage_t* pairs = reinterpret_cast<__nv_fp8x2_storage_t*>(&raw);
#pragma unroll
  for (int i = 0; i < kVecElems / 2; ++i) {
    float2 v = make_float2(src[2 * i] * scale_inv, src[2 * i + 1] * scale_inv);
    pairs[i] = __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);
  }
  *reinterpret_cast<uint2*>(dst) = raw;
}

}  // namespace hpc
