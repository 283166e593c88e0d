// What the op adapters share, on torch's stable C ABI only (so one build
// loads on every torch from the targeted version on): the kernels' element
// type of a tensor, the views and scale pointers the kernels take, and the
// stream they launch on. Kernel translation units never include this.
#pragma once

#include <cuda_runtime.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <optional>

#include "common/elem_type.h"
#include "common/paged_cache_view.h"

namespace hpc {

// torch's dtype enum; rope_norm.h has a ScalarType of its own.
using Dtype = torch::headeronly::ScalarType;
using torch::stable::Tensor;
using torch::stable::accelerator::DeviceGuard;

// `op` names the caller in the error for any other dtype.
inline ElemType elem_type_of(const Tensor& t, const char* op) {
  const Dtype dtype = t.scalar_type();
  if (dtype == Dtype::BFloat16) return ElemType::kBf16;
  if (dtype == Dtype::Half) return ElemType::kFp16;
  STD_TORCH_CHECK(dtype == Dtype::Float8_e4m3fn, op, ": unsupported dtype ",
                  dtype);
  return ElemType::kFp8E4m3;
}

// A K or V cache [num_blocks, block_size, num_kv_heads, head_size] whose
// head dimension is contiguous.
inline PagedCacheView cache_view(const Tensor& cache, const char* op) {
  STD_TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1, op,
                  ": a KV cache must have 4 dims, the last contiguous");
  return {cache.const_data_ptr(), cache.size(0), cache.stride(0),
          cache.stride(1), cache.stride(2)};
}

// A per-tensor scale: one float32 on `device`, or null when not given.
inline const float* optional_scale(const std::optional<Tensor>& scale,
                                   const torch::stable::Device& device,
                                   const char* op, const char* name) {
  if (!scale.has_value()) return nullptr;
  STD_TORCH_CHECK(scale->scalar_type() == Dtype::Float && scale->numel() == 1 &&
                      scale->device() == device,
                  op, ": ", name, " must be one float32 on the op's device");
  return scale->const_data_ptr<float>();
}

// The current CUDA stream of `t`'s device, which the launches use.
inline cudaStream_t current_stream(const Tensor& t) {
  void* stream = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(
      aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream));
  return static_cast<cudaStream_t>(stream);
}

}  // namespace hpc
