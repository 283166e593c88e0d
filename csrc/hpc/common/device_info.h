// Properties of the current device, read once per device at run time so that
// nothing is tuned into templates for one GPU model.
#pragma once

#include <cuda_runtime.h>

namespace hpc {

struct DeviceInfo {
  int sm_count;
  int max_smem_per_block;  // opt-in dynamic shared memory limit, bytes
};

// The current device's properties (cached; thread-safe after first use).
const DeviceInfo& current_device_info();

}  // namespace hpc
