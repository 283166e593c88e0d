// Synchronization of a subset of a CTA's warps.
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

// Stores `value` at `dst` (this CTA's shared memory) through the async
// proxy, counting its 4 bytes as a transaction of the mbarrier `bar`: a
// thread that sees the barrier's phase complete sees the value, as it sees
// the bytes of a bulk copy.
__device__ __forceinline__ void store_async_counted(float* dst, float value,
                                                    uint64_t* bar) {
  const uint32_t dst_addr =
      static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const uint32_t bar_addr =
      static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, "
      "[%2];" ::"r"(dst_addr),
      "r"(__float_as_uint(value)), "r"(bar_addr)
      : "memory");
}

}  // namespace hpc
