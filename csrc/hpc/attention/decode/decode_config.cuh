// Compile-time configuration of the swap-AB decode kernel for one head
// size, MMA element type and row count: shared-memory layout, ring depths
// and the wgmma tilings.
//
// A unit's rows (query tokens x query heads of one KV head, at most 64) are
// few, so the products run transposed, with the 64 keys of a KV tile as the
// wgmma M side and the rows as N:
//   S^T = K Q^T     SS wgmma: K (64 x D) as the copies land it, K-major;
//                   Q (rows x D) K-major
//   O^T += V^T P^T  SS wgmma: P^T (rows x 64) written by the consumers,
//                   K-major; V^T (D x 64): 16-bit caches read the V tile as
//                   it lands, MN-major; FP8 caches (whose wgmma takes
//                   K-major operands only) read V^T rows that producer
//                   warps 1..3 write from a ring of raw V tiles
//                   (attention/common/fp8_operands.cuh), their keys in the
//                   order prob_key_of_position gives, which P^T follows.
// FP8 caches: Q is E4M3 (the queries' own, or 16-bit queries quantized per
// row by the consumers when they load them into two terms), P is E4M3
// scaled by 2^8. The Q tile holds the residual term's rows below the first
// term's, so that with two terms S^T can be one product over both (N twice
// the rows, K read once: a small-N wgmma is bound by reading its M side
// from shared memory, not by the tensor cores).
// Two consumer warpgroups: up to 16 rows they take a work item's tiles in
// turn (even and odd tiles of the CTA's sequence) and merge their states
// at the item's end; 32 and 64 rows are split, half per warpgroup, over
// every tile (no merge buffer, so the rings are deeper).
#pragma once

#include <type_traits>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "attention/common/column_softmax.cuh"
#include "attention/common/gmma_layouts.cuh"
#include "attention/decode/decode_plan.h"
#include "kernel_limits.h"

namespace hpc {
namespace decode {

// The kernel's roles: a producer warpgroup (warp 0 copies; for FP8 caches
// warps 1..3 transpose V) and two consumer warpgroups.
constexpr int kWgmmaProducerThreads = 128;
constexpr int kWgmmaConsumerThreads = 256;
constexpr int kWgmmaThreads = kWgmmaProducerThreads + kWgmmaConsumerThreads;
constexpr int kWgmmaTransposeWarps = kWgmmaProducerThreads / 32 - 1;

template <int kHeadDimValue, class ElementType, int kRowsValue>
struct DecodeConfig {
  using Element = ElementType;
  static constexpr int kHeadDim = kHeadDimValue;
  static constexpr int kRows = kRowsValue;  // N: rows rounded up, 8..64
  static constexpr int kTileKeys = kTileTokens;
  static constexpr bool kFp8 = std::is_same_v<Element, cute::float_e4m3_t>;
  static constexpr int kElemBytes = kFp8 ? 1 : 2;
  static_assert(kRows == 8 || kRows == 16 || kRows == 32 || kRows == 64);
  static_assert(kRows <= limits::kMaxDecodeRows);
  static_assert(kHeadDim % 64 == 0);

  // 32 or 64 rows: each warpgroup takes half of every tile. Fewer: the
  // warpgroups take whole tiles in turn, each with all rows.
  static constexpr bool kSplitRows = kRows > 16;
  static constexpr int kWgRows = kSplitRows ? kRows / 2 : kRows;
  static constexpr int kQParts = kSplitRows ? 2 : 1;
  // Warps that release a K or V stage.
  static constexpr int kStageReaders = kSplitRows ? 8 : 4;

  // Rows of the K/V tiles and of Q: chunks of at most 128 bytes (the
  // widest swizzle); P^T and V^T rows are 64 keys.
  static constexpr int kRowBytes =
      kHeadDim * kElemBytes < 128 ? kHeadDim * kElemBytes : 128;
  static constexpr int kChunks = kHeadDim * kElemBytes / kRowBytes;
  static constexpr int kKeyRowBytes = kTileKeys * kElemBytes;

  static constexpr int kStageBytes = kTileKeys * kHeadDim * kElemBytes;
  // Query terms a Q part holds, one below the other: FP8 caches keep room
  // for the residual term of 16-bit queries' two-term E4M3 split
  // (quantize16_e4m3_two_terms).
  static constexpr int kQTerms = kFp8 ? 2 : 1;
  static constexpr int kQTermRows = kWgRows * kQTerms;  // rows of a Q part
  static constexpr int kQBytes = kQParts * kQTermRows * kHeadDim * kElemBytes;
  // Two terms in one S^T product up to 32 term rows; above, one product a
  // term (the wider product's accumulators beside O^T's would spill).
  static constexpr bool kTermsInOneProduct = kQTerms > 1 && kQTermRows <= 32;
  static constexpr int kQScaleBytes = kFp8 ? kRows * 4 : 0;
  static constexpr int kPBytes = kWgRows * kTileKeys * kElemBytes;  // per wg
  using Softmax = attention::ColumnSoftmax<kWgRows, kFp8 ? 8 : 0>;
  static constexpr int kReduceBytes = Softmax::kScratchFloats * 4;  // per wg
  // Taking turns: warpgroup 1's state for warpgroup 0 to merge, each of
  // its 128 threads' registers: its share of O^T, then its columns' maxima
  // and sums (decode_epilogue.cuh).
  static constexpr int kMergeFloatsPerThread =
      kHeadDim * kWgRows / 128 + 2 * Softmax::kSlots;
  static constexpr int kMergeBytes =
      kSplitRows ? 0 : 128 * kMergeFloatsPerThread * 4;

  static constexpr int kQOffset = 0;
  static constexpr int kQScaleOffset = kQOffset + kQBytes;
  // P^T on a 1024-byte boundary: wgmma applies the swizzle to absolute
  // shared-memory addresses.
  static constexpr int kPOffset =
      (kQScaleOffset + kQScaleBytes + 1023) / 1024 * 1024;
  static constexpr int kReduceOffset = kPOffset + 2 * kPBytes;
  static constexpr int kMergeOffset = kReduceOffset + 2 * kReduceBytes;
  // Stages on 1024-byte boundaries (the swizzle atoms).
  static constexpr int kKOffset =
      (kMergeOffset + kMergeBytes + 1023) / 1024 * 1024;

  // Shared memory a CTA may use on one SM; one CTA per SM. FP8: V^T
  // stages (the transposition runs a tile or more ahead) and raw V slots
  // beside K; 16-bit: K and V stages alike.
  static constexpr int kSmemPerSm = 227 * 1024;
  static constexpr int kMaxStages = 8;
  static constexpr int kSlots = (kSmemPerSm - 2048 - kKOffset) / kStageBytes;
  // Taking turns, warpgroup w reads the tiles of parity w. The consumers'
  // rings (K, V or V^T) then have an even depth, so that each stage serves
  // one warpgroup and a warpgroup only waits on a stage whose previous fill
  // it consumed itself: a parity wait cannot tell a fill from the one two
  // phases on, and with an odd depth a warpgroup running ahead would take
  // the other's unfinished fill for its own. Splitting rows, both
  // warpgroups read every tile in order, and any depth is safe.
  static constexpr int kRingMultiple = kSplitRows ? 1 : 2;
  // FP8: V^T stages as deep as the K ring where the shared memory holds
  // three full rings (head sizes 64 and 128), so the transposing warps run
  // as far ahead of the consumers as the copies do; otherwise what is left
  // after K and raw V rings of useful depth.
  static constexpr int kVtStages =
      kSlots >= 3 * kMaxStages
          ? kMaxStages
          : (kSplitRows ? 3 : ((kSlots - 4) / 2 >= 4 ? 4 : 2));
  static constexpr int kStagesFit = (kFp8 ? kSlots - kVtStages : kSlots) / 2;
  static constexpr int kStages =
      (kStagesFit < kMaxStages ? kStagesFit : kMaxStages) / kRingMultiple *
      kRingMultiple;
  static constexpr int kVStages = kFp8 ? kVtStages : kStages;
  static constexpr int kRawSlots = kFp8 ? kStages : 0;
  static_assert(kStages >= 2, "rings of at least two stages");
  static_assert(kStages % kRingMultiple == 0 && kVStages % kRingMultiple == 0,
                "taking turns: rings of even depth");
  static constexpr int kVOffset = kKOffset + kStages * kStageBytes;
  static constexpr int kRawOffset = kVOffset + kVStages * kStageBytes;
  static constexpr int kTileBytes = kRawOffset + kRawSlots * kStageBytes;
  static constexpr int kSmemBytes = kTileBytes + 1024;  // alignment slack
  static_assert(kTileBytes + 2048 <= kSmemPerSm, "shared memory");

  // Register budgets after reallocation.
  static constexpr int kProducerRegs = kFp8 ? 56 : 40;
  static constexpr int kConsumerRegs = kFp8 ? 224 : 232;

  using KAtom = attention::KMajorAtom<Element, kRowBytes>;
  using KeyRowAtom = attention::KMajorAtom<Element, kKeyRowBytes>;
  // K stages: (key, channel, stage), [chunk][key][kRowBytes] per stage.
  using SmemLayoutK = decltype(cute::tile_to_shape(
      KAtom{}, cute::Shape<cute::Int<kTileKeys>, cute::Int<kHeadDim>,
                           cute::Int<kStages>>{}));
  // Q: (term row, channel, part), part = the warpgroup's half under
  // kSplitRows; term row = term x kWgRows + row, [chunk][term row][row
  // bytes] per part, so both terms are one K-major operand of kQTermRows
  // rows.
  using SmemLayoutQTerms = decltype(cute::tile_to_shape(
      KAtom{}, cute::Shape<cute::Int<kQTermRows>, cute::Int<kHeadDim>,
                           cute::Int<kQParts>>{}));
  // Each term alone: (row, channel, term, part).
  using SmemLayoutQ = decltype(cute::composition(
      SmemLayoutQTerms{},
      cute::make_layout(
          cute::Shape<cute::Int<kWgRows>, cute::Int<kHeadDim>,
                      cute::Int<kQTerms>, cute::Int<kQParts>>{},
          cute::Stride<cute::_1, cute::Int<kQTermRows>, cute::Int<kWgRows>,
                       cute::Int<kQTermRows * kHeadDim>>{})));
  // V^T over the V stages, (channel, key, stage).
  using SmemLayoutVt =
      decltype(attention::value_operand_layout<Element, kHeadDim, kTileKeys,
                                               kVStages>());
  // P^T of one warpgroup: (row, key), K-major (one row of 64 keys per query
  // row).
  using SmemLayoutP = decltype(cute::tile_to_shape(
      KeyRowAtom{}, cute::Shape<cute::Int<kWgRows>, cute::Int<kTileKeys>>{}));

  template <int kN>
  using TiledMmaSOf = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<
          Element, Element, float,
          cute::Shape<cute::_64, cute::Int<kN>, cute::Int<kHeadDim>>>(),
      cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>{}));
  using TiledMmaS = TiledMmaSOf<kWgRows>;  // one query term
  using TiledMmaSTerms = TiledMmaSOf<kQTermRows>;
  using TiledMmaO = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<
          Element, Element, float,
          cute::Shape<cute::_64, cute::Int<kWgRows>, cute::Int<kTileKeys>>,
          kFp8 ? cute::GMMA::Major::K : cute::GMMA::Major::MN,
          cute::GMMA::Major::K>(),
      cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>{}));
};

}  // namespace decode
}  // namespace hpc
