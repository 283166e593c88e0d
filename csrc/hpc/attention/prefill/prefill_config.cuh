// Compile-time configuration of the paged prefill kernel for one head size
// and MMA element type: tile shape, stage count, shared-memory layouts and
// the wgmma tilings.
//
// A CTA computes a 128-row query tile (prefill_plan.h) against key tiles of
// kBlockN keys. Consumer warpgroup w owns rows [64w, 64w + 64):
//   S = Q K^T   wgmma, both operands in shared memory (K-major)
//   O += P V    wgmma, P from registers (the S accumulator converted in
//               place: the m64nN accumulator and the m64nDk16 A fragment
//               hold the same elements in the same register order), V as
//               an MN-major operand of the same shared memory tile that the
//               paged TMA copies write.
// Q, K and V tiles are [head-dim chunk of 64][row][64] elements with the
// 128-byte swizzle, which is both the layout the copies produce and the
// layout wgmma reads (K-major for Q and K; MN-major for V, where the chunk
// of 64 channels is the atom's contiguous MN extent and the keys its K).
#pragma once

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "attention/prefill/prefill_plan.h"

namespace hpc {
namespace prefill {

constexpr int kProducerThreads = 128;  // one warpgroup
constexpr int kConsumerThreads = 256;  // two warpgroups
constexpr int kPrefillThreads = kProducerThreads + kConsumerThreads;
// Shared memory a CTA may use on one SM (every Hopper part).
constexpr int kSmemPerSm = 227 * 1024;

// Element: cute::bfloat16_t or cute::half_t, the MMA operand type.
// kWidenKv: the cache holds FP8: TMA copies it into a raw ring and the
// producer warpgroup widens it to Element into the stages (and writes Q).
template <int kHeadDimValue, class ElementType, bool kWidenKvValue>
struct PrefillConfig {
  using Element = ElementType;
  static constexpr int kHeadDim = kHeadDimValue;
  static constexpr bool kWidenKv = kWidenKvValue;
  static constexpr int kBlockM = kTileRows;
  // Keys per stage: the S accumulator (kBlockN / 2 registers) and O
  // (kHeadDim / 2) share a consumer thread's registers.
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  static constexpr int kChunkElems = 64;  // 128 bytes
  static constexpr int kChunks = kHeadDim / kChunkElems;
  static constexpr int kRowBytes = kChunkElems * 2;
  static_assert(kHeadDim % kChunkElems == 0, "head size: a multiple of 64");

  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kStageBytes = kBlockN * kHeadDim * 2;  // K or V
  // FP8 caches: the copies land in a ring of raw (FP8) key tiles, K then V,
  // each [chunk][key][kRawRowBytes] with the copies' swizzle, which the
  // producer warps widen into the stages.
  static constexpr int kRawRowBytes = kHeadDim < 128 ? kHeadDim : 128;
  static constexpr int kRawChunks = kHeadDim / kRawRowBytes;
  static constexpr int kRawTileBytes = kBlockN * kHeadDim;  // K or V
  static constexpr int kRawSlotBytes = 2 * kRawTileBytes;
  static constexpr int kFreeBytes = kSmemPerSm - 2048 - kQBytes;
  static constexpr int kStagesFit =
      (kFreeBytes - (kWidenKv ? kRawSlotBytes : 0)) / (2 * kStageBytes);
  static constexpr int kStages =
      kWidenKv ? 2 : (kStagesFit < 4 ? kStagesFit : 4);
  static_assert(kStagesFit >= 2, "a ring of at least two stages");
  static constexpr int kRawFit =
      (kFreeBytes - 2 * kStages * kStageBytes) / kRawSlotBytes;
  static constexpr int kRawSlots = !kWidenKv ? 0 : (kRawFit < 4 ? kRawFit : 4);
  static constexpr int kKOffset = kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kStageBytes;
  static constexpr int kRawOffset = kVOffset + kStages * kStageBytes;
  static constexpr int kTileBytes = kRawOffset + kRawSlots * kRawSlotBytes;
  // The tiles, 1024-byte aligned for the swizzle, and the barriers.
  static constexpr int kSmemBytes = kTileBytes + 1024;
  static_assert(kSmemBytes + 1024 <= kSmemPerSm, "shared memory");

  // Consumer warpgroups issue their wgmma in turns (prefill_mainloop.cuh)
  // where a warpgroup's softmax is long beside its matrix products.
  static constexpr bool kTakeTurns = kHeadDim <= 128;

  // Register budgets after reallocation (sum <= 64K registers).
  static constexpr int kProducerRegs = kWidenKv ? 64 : 40;
  static constexpr int kConsumerRegs = kWidenKv ? 216 : 232;
  static_assert(kProducerThreads * kProducerRegs +
                    kConsumerThreads * kConsumerRegs <=
                65536);

  using SmemLayoutQ = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>,
                  cute::Int<kStages>>{}));
  // (channel, key, stage) over the same bytes as SmemLayoutK's (key,
  // channel, stage): keys tile first, then channel chunks, then stages.
  using SmemLayoutVt = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>,
                  cute::Int<kStages>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));

  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<
          Element, Element, float,
          cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<
          Element, Element, float,
          cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockN>>,
          cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
};

}  // namespace prefill
}  // namespace hpc
