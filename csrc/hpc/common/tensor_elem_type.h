// The kernels' element type of a tensor, for the at::Tensor adapters (kernel
// translation units never include this: it pulls in torch headers).
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/Exception.h>

#include "common/elem_type.h"

namespace hpc {

// `op` names the caller in the error for any other dtype.
inline ElemType elem_type_of(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return ElemType::kBf16;
    case at::kHalf:
      return ElemType::kFp16;
    case at::kFloat8_e4m3fn:
      return ElemType::kFp8E4m3;
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", t.scalar_type());
  }
}

}  // namespace hpc
