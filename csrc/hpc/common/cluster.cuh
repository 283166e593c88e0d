// Thread-block cluster primitives: shared::cluster addresses, mbarrier
// arrivals (DSMEM) and a cluster-scope acquiring wait.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hpc {

// The shared::cta address of `ptr` (this CTA's shared memory).
__device__ __forceinline__ uint32_t smem_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// The address of `ptr` (this CTA's shared memory) in the shared memory of
// the cluster's CTA `rank`, as a shared::cluster address.
__device__ __forceinline__ uint32_t cluster_address(const void* ptr, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(smem_address(ptr)), "r"(rank));
  return remote;
}

// A generic pointer to `ptr`'s counterpart in CTA `rank`.
template <typename T>
__device__ __forceinline__ T* map_to_cta(T* ptr, int rank) {
  T* remote;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(remote) : "l"(ptr), "r"(rank));
  return remote;
}

// Arrives on the mbarrier at `bar`'s place in CTA `rank`, releasing this
// thread's prior writes at cluster scope.
__device__ __forceinline__ void cluster_arrive_remote(uint64_t* bar, int rank) {
  asm volatile(
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(
          cluster_address(bar, rank))
      : "memory");
}

// Waits for the phase `parity` of this CTA's mbarrier to complete, acquiring
// at cluster scope the writes its (remote) arrivals released.
__device__ __forceinline__ void cluster_wait_acquire(uint64_t* bar,
                                                     uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], "
      "%1;\n"
      "@!done bra WAIT_%=;\n"
      "}" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
}

// Every thread of every CTA of the cluster: the mbarriers initialized before
// it are visible to the cluster's remote arrivals after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;" ::
          : "memory");
}

}  // namespace hpc
