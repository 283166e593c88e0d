#include <cuda.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "common/cuda_check.h"
#include "common/device_info.h"
#include "common/driver_entry.h"

namespace hpc {

namespace {

using ExecAffinityFn = CUresult (*)(CUexecAffinityParam*, CUexecAffinityType);

// The SM count of the current context's execution affinity, or `sm_count`
// where the driver has none to report.
int affinity_sm_count(int sm_count) {
  void* ptr = driver_entry_point("cuCtxGetExecAffinity", 11040);
  if (ptr == nullptr) return sm_count;
  CUexecAffinityParam param{};
  if (reinterpret_cast<ExecAffinityFn>(ptr)(
          &param, CU_EXEC_AFFINITY_TYPE_SM_COUNT) != CUDA_SUCCESS ||
      param.param.smCount.val == 0) {
    return sm_count;
  }
  return static_cast<int>(param.param.smCount.val);
}

// sm_count scaled by CUDA_MPS_ACTIVE_THREAD_PERCENTAGE when it is set.
int mps_sm_count(int sm_count) {
  const char* env = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
  if (env == nullptr) return sm_count;
  const double percent = std::atof(env);
  if (!(percent > 0.0 && percent < 100.0)) return sm_count;
  return static_cast<int>(sm_count * percent / 100.0);
}

}  // namespace

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
    info.resident_sm_count = info.sm_count;
    for (const int limit :
         {affinity_sm_count(info.sm_count), mps_sm_count(info.sm_count)}) {
      if (limit < info.resident_sm_count) info.resident_sm_count = limit;
    }
    known[device] = true;
  }
  return infos[device];
}

}  // namespace hpc
