#include <mutex>
#include <vector>

#include "common/cuda_check.h"
#include "common/device_info.h"

namespace hpc {

const DeviceInfo& current_device_info() {
  static std::mutex mutex;
  static std::vector<DeviceInfo> infos;
  static std::vector<bool> known;
  int device = 0;
  HPC_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= static_cast<int>(infos.size())) {
    infos.resize(device + 1);
    known.resize(device + 1, false);
  }
  if (!known[device]) {
    DeviceInfo& info = infos[device];
    HPC_CUDA_CHECK(cudaDeviceGetAttribute(
        &info.sm_count, cudaDevAttrMultiProcessorCount, device));
    HPC_CUDA_CHECK(cudaDeviceGetAttribute(
        &info.max_smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin,
        device));
    known[device] = true;
  }
  return infos[device];
}

}  // namespace hpc
