// Element types the kernels take at run time (16-bit activations and FP8).
#pragma once

namespace hpc {

enum class ElemType : int { kBf16 = 0, kFp16 = 1, kFp8E4m3 = 2 };

constexpr int elem_bytes(ElemType type) {
  return type == ElemType::kFp8E4m3 ? 1 : 2;
}

}  // namespace hpc
