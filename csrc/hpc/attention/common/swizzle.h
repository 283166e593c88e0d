// The address rule of the shared-memory tiles the attention kernels' TMA
// copies fill and their wgmma read: [chunk][row][kRowBytes], each 16-byte
// unit of a row XOR-ed with the row's place in its 1024-byte atom.
#pragma once

#include "common/host_device.h"

namespace hpc {
namespace attention {

// Byte offset of byte `byte` of row `row` in a tile of `rows` rows stored
// as chunks of kRowBytes per row ([chunk][row][kRowBytes]), each 16-byte
// unit XOR-ed with the row's place in its 1024-byte swizzle atom (the 128-
// or 64-byte swizzle for kRowBytes 128 or 64).
template <int kRowBytes>
HPC_HOST_DEVICE int swizzled_offset(int row, int byte, int rows) {
  static_assert(kRowBytes == 64 || kRowBytes == 128);
  const int linear = (byte / kRowBytes) * (rows * kRowBytes) + row * kRowBytes +
                     byte % kRowBytes;
  constexpr int kMask = kRowBytes / 16 - 1;
  return linear ^ (((linear >> 7) & kMask) << 4);
}

}  // namespace attention
}  // namespace hpc
