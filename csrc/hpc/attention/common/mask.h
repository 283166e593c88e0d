// Which keys a query row sees: the one statement of the causal, sliding-
// window and key-length rules, evaluated by the planners (host and device)
// and by the kernels' per-element masks.
//
// A request has q_len new query tokens and kv_len keys in all (its cached
// context followed by the new tokens), so the masks are bottom-right aligned:
// query token i sits at position kv_len - q_len + i and sees the keys at
// positions [key_begin, pos] with key_begin = pos - window + 1 under a window
// of `window` tokens (0: none), never a key at or past kv_len.
#pragma once

#include "common/host_device.h"

namespace hpc {
namespace attention {

HPC_HOST_DEVICE int query_position(int kv_len, int q_len, int token) {
  return kv_len - q_len + token;
}

// First key the query at `pos` sees.
HPC_HOST_DEVICE int key_begin(int pos, int window) {
  if (window <= 0) return 0;
  const int first = pos - window + 1;
  return first > 0 ? first : 0;
}

// One past the last key the query at `pos` sees.
HPC_HOST_DEVICE int key_end(int pos, int kv_len) {
  return pos + 1 < kv_len ? pos + 1 : kv_len;
}

HPC_HOST_DEVICE bool key_visible(int key, int pos, int kv_len, int window) {
  return key <= pos && key < kv_len && (window <= 0 || key > pos - window);
}

// The keys a block of consecutive query positions [pos_first, pos_last]
// reads, cut into key tiles of `tile` keys: tiles [tile_begin, tile_end).
// Tile t needs no per-element mask iff every key of it is visible to every
// query of the block (interior()).
struct KeyTiles {
  int tile_begin;
  int tile_end;
  int pos_first;
  int pos_last;
  int kv_len;
  int window;
  int tile;

  HPC_HOST_DEVICE static KeyTiles of(int pos_first, int pos_last, int kv_len,
                                     int window, int tile) {
    KeyTiles r;
    r.pos_first = pos_first;
    r.pos_last = pos_last;
    r.kv_len = kv_len;
    r.window = window;
    r.tile = tile;
    const int end = key_end(pos_last, kv_len);
    const int begin = key_begin(pos_first, window);
    r.tile_begin = begin / tile;
    r.tile_end = end > begin ? (end + tile - 1) / tile : r.tile_begin;
    return r;
  }

  HPC_HOST_DEVICE int count() const { return tile_end - tile_begin; }

  HPC_HOST_DEVICE bool interior(int t) const {
    const int first = t * tile;
    const int last = first + tile - 1;
    return last <= pos_first && last < kv_len &&
           (window <= 0 || first > pos_last - window);
  }
};

}  // namespace attention
}  // namespace hpc
