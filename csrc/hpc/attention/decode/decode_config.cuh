// Compile-time configuration of the swap-AB decode kernel for one head
// size, MMA element type and row count: shared-memory layout, ring depth
// and the wgmma tilings.
//
// A unit's rows (query tokens x query heads of one KV head, at most 64) are
// few, so the products run transposed, with the 64 keys of a KV tile as the
// wgmma M side and the rows as N:
//   S^T = K Q^T     SS wgmma: K (64 x D) as the copies land it, K-major;
//                   Q (rows x D) K-major
//   O^T += V^T P^T  SS wgmma: V^T (D x 64) read MN-major from the V tile as
//                   it lands; P^T (rows x 64) written by the consumers
// Two consumer warpgroups: up to 32 rows they take a work item's tiles in
// turn (even and odd tiles of the CTA's sequence) and merge their states
// at the item's end; 64 rows are split, 32 per warpgroup, over every tile.
#pragma once

#include <type_traits>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "attention/common/column_softmax.cuh"
#include "attention/decode/decode_plan.h"

namespace hpc {
namespace decode {

// The kernel's roles: a producer warpgroup (warp 0 copies) and two consumer
// warpgroups.
constexpr int kWgmmaProducerThreads = 128;
constexpr int kWgmmaConsumerThreads = 256;
constexpr int kWgmmaThreads = kWgmmaProducerThreads + kWgmmaConsumerThreads;

template <int kHeadDimValue, class ElementType, int kRowsValue>
struct DecodeConfig {
  using Element = ElementType;
  static constexpr int kHeadDim = kHeadDimValue;
  static constexpr int kRows = kRowsValue;  // N: rows rounded up, 8..64
  static constexpr int kTileKeys = kTileTokens;
  static constexpr int kElemBytes = 2;
  static_assert(kRows == 8 || kRows == 16 || kRows == 32 || kRows == 64);
  static_assert(kHeadDim % 64 == 0);

  // 64 rows: each warpgroup takes 32 of every tile. Fewer: the warpgroups
  // take whole tiles in turn, each with all rows.
  static constexpr bool kSplitRows = kRows > 32;
  static constexpr int kWgRows = kSplitRows ? kRows / 2 : kRows;
  static constexpr int kQParts = kSplitRows ? 2 : 1;
  // Warps that release a K or V stage.
  static constexpr int kStageReaders = kSplitRows ? 8 : 4;

  // Rows of the K/V tiles and of Q: 128-byte chunks of the 128-byte
  // swizzle (a 16-bit row of 64 channels or more fills whole chunks).
  static constexpr int kRowBytes = 128;
  static constexpr int kChunks = kHeadDim * kElemBytes / kRowBytes;

  static constexpr int kStageBytes = kTileKeys * kHeadDim * kElemBytes;
  static constexpr int kQBytes = kRows * kHeadDim * kElemBytes;
  static constexpr int kPBytes = kWgRows * kTileKeys * kElemBytes;  // per wg
  using Softmax = attention::ColumnSoftmax<kWgRows>;
  static constexpr int kReduceBytes = Softmax::kScratchFloats * 4;  // per wg
  // Taking turns: warpgroup 1's state for warpgroup 0 to merge (O^T, then
  // the column maxima and sums).
  static constexpr int kMergeBytes =
      kSplitRows ? 0 : (kHeadDim + 2) * kWgRows * 4;

  static constexpr int kQOffset = 0;
  static constexpr int kPOffset = kQOffset + kQBytes;
  static constexpr int kReduceOffset = kPOffset + 2 * kPBytes;
  static constexpr int kMergeOffset = kReduceOffset + 2 * kReduceBytes;
  static constexpr int kKOffsetUnaligned = kMergeOffset + kMergeBytes;
  // Stages on 1024-byte boundaries (the 128-byte swizzle's atom).
  static constexpr int kKOffset = (kKOffsetUnaligned + 1023) / 1024 * 1024;

  // Shared memory a CTA may use on one SM; one CTA per SM.
  static constexpr int kSmemPerSm = 227 * 1024;
  static constexpr int kMaxStages = 8;
  static constexpr int kStagesFit =
      (kSmemPerSm - 2048 - kKOffset) / (2 * kStageBytes);
  static constexpr int kStages =
      kStagesFit < kMaxStages ? kStagesFit : kMaxStages;
  static_assert(kStages >= 2, "rings of at least two stages");
  static constexpr int kVOffset = kKOffset + kStages * kStageBytes;
  static constexpr int kTileBytes = kVOffset + kStages * kStageBytes;
  static constexpr int kSmemBytes = kTileBytes + 1024;  // alignment slack

  // Register budgets after reallocation.
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;

  using KAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  // K stages: (key, channel, stage), [chunk][key][128 bytes] per stage.
  using SmemLayoutK = decltype(cute::tile_to_shape(
      KAtom{}, cute::Shape<cute::Int<kTileKeys>, cute::Int<kHeadDim>,
                           cute::Int<kStages>>{}));
  // Q: (row, channel, part), part = the warpgroup's half under kSplitRows.
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      KAtom{}, cute::Shape<cute::Int<kWgRows>, cute::Int<kHeadDim>,
                           cute::Int<kQParts>>{}));
  // V^T over the V stages: (channel, key, stage), the same bytes as K's
  // (key, channel, stage), MN-major.
  using SmemLayoutVt = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kHeadDim>, cute::Int<kTileKeys>,
                  cute::Int<kStages>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));
  // P^T of one warpgroup: (row, key), K-major (one 128-byte row of 64 keys
  // per query row).
  using SmemLayoutP = decltype(cute::tile_to_shape(
      KAtom{}, cute::Shape<cute::Int<kWgRows>, cute::Int<kTileKeys>>{}));

  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<
          Element, Element, float,
          cute::Shape<cute::_64, cute::Int<kWgRows>, cute::Int<kHeadDim>>>(),
      cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>{}));
  using TiledMmaO = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<
          Element, Element, float,
          cute::Shape<cute::_64, cute::Int<kWgRows>, cute::Int<kTileKeys>>,
          cute::GMMA::Major::MN, cute::GMMA::Major::K>(),
      cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>{}));
};

}  // namespace decode
}  // namespace hpc
