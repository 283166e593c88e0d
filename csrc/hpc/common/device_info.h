// Properties of the current device, read once per device at run time so that
// nothing is tuned into templates for one GPU model.
#pragma once

#include <cuda_runtime.h>

namespace hpc {

struct DeviceInfo {
  int sm_count;
  // SMs this process's kernels may hold at once: sm_count, or fewer for an
  // MPS client held to an SM count (its context's execution affinity, or
  // CUDA_MPS_ACTIVE_THREAD_PERCENTAGE). A grid whose CTAs wait for each
  // other must fit in these.
  int resident_sm_count;
  int max_smem_per_block;  // opt-in dynamic shared memory limit, bytes
};

// The current device's properties (cached; thread-safe after first use).
const DeviceInfo& current_device_info();

}  // namespace hpc
