// Synchronization of a subset of a CTA's warps, and of CTAs through memory.
#pragma once

#include <cstdint>

namespace hpc {

// Waits until `threads` threads (whole warps) have reached barrier `id`
// (1..15; 0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Arrives at barrier `id` without waiting: `threads` counts the waiting
// threads and the arriving ones.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// named_barrier_sync that also returns whether `pred` held for any of the
// `threads` threads (bar.red.or): a flag one thread computed reaches all of
// them without a shared-memory round trip.
__device__ __forceinline__ bool named_barrier_sync_or(int id, int threads,
                                                      bool pred) {
  uint32_t any;
  asm volatile(
      "{\n\t.reg .pred p, q;\n\t"
      "setp.ne.u32 p, %1, 0;\n\t"
      "bar.red.or.pred q, %2, %3, p;\n\t"
      "selp.u32 %0, 1, 0, q;\n\t}"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(threads)
      : "memory");
  return any != 0;
}

// Loads *ptr with acquire semantics at GPU scope: the writes another CTA
// made before releasing the value (a fence, then the store or atomic) are
// visible to this thread after the load, and to the CTA's threads after a
// barrier that follows it.
__device__ __forceinline__ int load_acquire(const int32_t* ptr) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];"
               : "=r"(value)
               : "l"(ptr)
               : "memory");
  return value;
}

}  // namespace hpc
