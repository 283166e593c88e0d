// Device side of the paged-KV TMA access (paged_kv_tma.h): the copies of one
// key tile of one KV head into a shared-memory stage laid out
// [head-dim chunk][key][row bytes] (the layout the copies' swizzle gives),
// issued lane-parallel by one warp, one copy per (cache block, chunk).
#pragma once

#include <cuda.h>

#include <cstdint>

#include <cute/arch/copy_sm90_tma.hpp>

namespace hpc {
namespace attention {

template <int kTileKeys, int kChunks, int kRowBytes>
struct PagedKvTile {
  static constexpr int kChunkElemsBytes = kRowBytes;
  static constexpr int kChunkBytes = kTileKeys * kRowBytes;

  // Transaction bytes of a tile made of `blocks` cache blocks.
  __device__ static uint32_t bytes(int blocks, int block_size) {
    return static_cast<uint32_t>(blocks * block_size * kRowBytes * kChunks);
  }

  // Copies `blocks` cache blocks (ids block_ids[0 .. blocks)) of `kv_head`
  // into `dst`, completing on `bar`; `elem_bytes` converts a chunk's bytes
  // into the map's element coordinate. Called by every lane of the warp.
  __device__ static void issue(const CUtensorMap* map, uint64_t* bar,
                               uint8_t* dst, const int32_t* block_ids,
                               int blocks, int block_size, int kv_head,
                               int elem_bytes, uint64_t cache_hint, int lane) {
    static_assert(kTileKeys / 16 * kChunks <= 32, "one copy per lane");
    if (lane < blocks * kChunks) {
      const int blk = lane / kChunks;
      const int chunk = lane % kChunks;
      cute::SM90_TMA_LOAD_4D::copy(
          map, bar, cache_hint,
          dst + chunk * kChunkBytes + blk * block_size * kRowBytes,
          chunk * kRowBytes / elem_bytes, 0, kv_head, block_ids[blk]);
    }
  }
};

}  // namespace attention
}  // namespace hpc
