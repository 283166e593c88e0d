// Searches over monotone device arrays.
#pragma once

#include <cstdint>

namespace hpc {

// The largest i in [0, n) with offsets[i] <= x, for non-decreasing offsets
// with offsets[0] <= x: the segment of a prefix-sum table that holds x.
__device__ __forceinline__ int segment_of(const int32_t* offsets, int n,
                                          int x) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace hpc
