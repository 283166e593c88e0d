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

// Block ids of a sequence's block-table row from block `first` up to `end`,
// read 32 at a time by a warp's lanes (one lane per block) with the next 32
// already in flight, so that issuing a tile never waits on a block-table
// load.
class BlockIdWindow {
 public:
  __device__ BlockIdWindow(const int32_t* table, int first, int end, int lane)
      : table_(table), end_(end), lane_(lane), base_(first) {
    current_ = load(base_);
    next_ = load(base_ + 32);
  }

  // Block id of block `index` of the sequence, held by lane `index - base`;
  // every lane of the warp must call this with the same `first_index`.
  __device__ int get(int first_index, int index) {
    if (first_index >= base_ + 32) {
      base_ += 32;
      current_ = next_;
      next_ = load(base_ + 32);
    }
    return __shfl_sync(0xffffffffu, current_, (index - base_) & 31);
  }

 private:
  __device__ int load(int base) const {
    return base + lane_ < end_ ? table_[base + lane_] : 0;
  }

  const int32_t* table_;
  int end_;
  int lane_;
  int base_;
  int current_;
  int next_;
};

template <int kTileKeys, int kChunks, int kRowBytes>
struct PagedKvTile {
  static constexpr int kChunkBytes = kTileKeys * kRowBytes;

  // Transaction bytes of a tile made of `blocks` cache blocks.
  __device__ static uint32_t bytes(int blocks, int block_size) {
    return static_cast<uint32_t>(blocks * block_size * kRowBytes * kChunks);
  }

  // The tile's block a lane copies (lane / kChunks); lanes past the copies
  // issue none.
  __device__ static int lane_block(int lane) { return lane / kChunks; }

  // Copies `blocks` cache blocks of `kv_head` into `dst`, completing on
  // `bar`; `block_id` is the id of this lane's block (lane_block).
  // `elem_bytes` converts a chunk's bytes into the map's element coordinate.
  // Called by every lane of the warp.
  __device__ static void issue_block(const CUtensorMap* map, uint64_t* bar,
                                     uint8_t* dst, int block_id, int blocks,
                                     int block_size, int kv_head,
                                     int elem_bytes, uint64_t cache_hint,
                                     int lane) {
    static_assert(kTileKeys / 16 * kChunks <= 32, "one copy per lane");
    if (lane < blocks * kChunks) {
      const int blk = lane_block(lane);
      const int chunk = lane % kChunks;
      cute::SM90_TMA_LOAD_4D::copy(
          map, bar, cache_hint,
          dst + chunk * kChunkBytes + blk * block_size * kRowBytes,
          chunk * kRowBytes / elem_bytes, 0, kv_head, block_id);
    }
  }

  // Zeroes the rows of keys at and past `valid` of a landed tile, by
  // `threads` threads (this one is `thread`): cache slots past a sequence
  // may hold anything (NaN), and a zero probability times NaN is NaN. Rows
  // are whole lines of each chunk (the swizzle only moves bytes within a
  // row). The caller fences the async proxy and synchronizes its readers.
  __device__ static void zero_keys_from(uint8_t* tile, int valid, int thread,
                                        int threads) {
    constexpr int kUnitsPerRow = kRowBytes / 16;
    const int rows = kTileKeys - valid;
    for (int e = thread; e < kChunks * rows * kUnitsPerRow; e += threads) {
      const int chunk = e / (rows * kUnitsPerRow);
      const int key = valid + (e / kUnitsPerRow) % rows;
      *reinterpret_cast<uint4*>(tile + chunk * kChunkBytes + key * kRowBytes +
                                16 * (e % kUnitsPerRow)) =
          make_uint4(0, 0, 0, 0);
    }
  }

  // The same, the ids read from block_ids[0 .. blocks).
  __device__ static void issue(const CUtensorMap* map, uint64_t* bar,
                               uint8_t* dst, const int32_t* block_ids,
                               int blocks, int block_size, int kv_head,
                               int elem_bytes, uint64_t cache_hint, int lane) {
    const int id = lane < blocks * kChunks ? block_ids[lane_block(lane)] : 0;
    issue_block(map, bar, dst, id, blocks, block_size, kv_head, elem_bytes,
                cache_hint, lane);
  }
};

}  // namespace attention
}  // namespace hpc
