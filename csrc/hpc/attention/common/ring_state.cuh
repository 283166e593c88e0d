// A position in a ring of pipeline stages (an mbarrier pair per stage):
// the stage and the parity of its current phase, advanced in step or
// derived from a running count.
#pragma once

#include <cstdint>

namespace hpc {
namespace attention {

// Position in a ring: stage index and the parity of its current phase.
template <int kStages>
struct RingState {
  int stage = 0;
  uint32_t phase = 0;

  // The position of the `it`-th item put into the ring.
  __device__ static RingState of(int it) {
    return {it % kStages, static_cast<uint32_t>((it / kStages) & 1)};
  }

  __device__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

}  // namespace attention
}  // namespace hpc
