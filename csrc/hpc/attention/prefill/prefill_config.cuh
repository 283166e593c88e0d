// Compile-time configuration of the paged prefill kernel for one head size
// and MMA element type: tile shape, stage counts, shared-memory layouts and
// the wgmma tilings.
//
// A CTA computes a 128-row query tile (prefill_plan.h) against key tiles of
// kBlockN keys. Consumer warpgroup w owns rows [64w, 64w + 64):
//   S = Q K^T   wgmma, both operands in shared memory (K-major)
//   O += P V    wgmma, P from registers (the S accumulator converted in
//               place), V from shared memory.
// 16-bit caches (Element bf16 or fp16): the m64nN accumulator and the
// m64nDk16 A fragment hold the same elements in the same register order,
// and V is read as an MN-major operand of the tile the paged TMA copies
// write ([head-dim chunk of 64][key][64] with the 128-byte swizzle, which is
// both the copies' layout and wgmma's).
// FP8 caches (Element E4M3, attention/common/fp8_operands.cuh): both
// products run on FP8 tensor cores, which take K-major operands only. Q is
// E4M3 (the queries' own, or 16-bit queries quantized per row in the
// kernel), K comes straight from the copies, P is rounded to E4M3 in
// registers, and producer warps write V^T into a ring of its own from a
// ring of raw V tiles.
#pragma once

#include <type_traits>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "attention/common/fp8_operands.cuh"
#include "attention/common/gmma_layouts.cuh"
#include "attention/common/online_softmax.cuh"
#include "attention/prefill/prefill_params.h"
#include "attention/prefill/prefill_pipeline.cuh"
#include "attention/prefill/prefill_plan.h"

namespace hpc {
namespace prefill {

// Shared memory a CTA may use on one SM (every Hopper part).
constexpr int kSmemPerSm = 227 * 1024;
// Registers a CTA holds at launch (the kernel's cap for 384 threads, one
// CTA per SM) and hands between its warpgroups.
constexpr int kCtaRegisters = 168 * kPrefillThreads;

// Element: cute::bfloat16_t, cute::half_t or cute::float_e4m3_t, the cache
// and MMA operand type.
template <int kHeadDimValue, class ElementType>
struct PrefillConfig {
  using Element = ElementType;
  static constexpr int kHeadDim = kHeadDimValue;
  static constexpr bool kFp8 = std::is_same_v<Element, cute::float_e4m3_t>;
  static constexpr int kElemBytes = kFp8 ? 1 : 2;
  static constexpr int kBlockM = kTileRows;
  // Keys per stage: the S accumulator (kBlockN / 2 registers) and O
  // (kHeadDim / 2) share a consumer thread's registers.
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  // Q and K rows: chunks of at most 128 bytes (the widest swizzle).
  static constexpr int kRowBytes =
      kHeadDim * kElemBytes < 128 ? kHeadDim * kElemBytes : 128;
  static constexpr int kChunkElems = kRowBytes / kElemBytes;
  static constexpr int kChunks = kHeadDim / kChunkElems;
  static_assert(kHeadDim % 64 == 0, "head size: a multiple of 64");
  static_assert(kRowBytes == 64 || kRowBytes == 128, "64- or 128-byte rows");

  static constexpr int kQBytes = kBlockM * kHeadDim * kElemBytes;
  static constexpr int kStageBytes = kBlockN * kHeadDim * kElemBytes;
  // FP8 only: 16-bit queries land in a staging tile ([chunk of 64][row]
  // [128 bytes], StagedRows16) and are quantized into the Q tile with one
  // scale per row, which the consumers derive from the staging tile; V lands in
  // a ring of raw tiles ([chunk][key][kRowBytes]) that producer warps transpose
  // into the V stages.
  static constexpr int kQStagingBytes = kFp8 ? kBlockM * kHeadDim * 2 : 0;
  // Stages of kStageBytes that fit beside Q: K and V stages, and for FP8
  // three V^T stages (the transposition runs a tile or two ahead of the
  // consumers) with the rest as raw V tiles (the copies in flight).
  static constexpr int kSlots =
      (kSmemPerSm - 2048 - kQBytes - kQStagingBytes) / kStageBytes;
  static constexpr int kVtStages = 3;
  static constexpr int kMaxStages = 4;
  static constexpr int kMaxRawSlots = 4;
  static constexpr int kStagesFit = (kFp8 ? kSlots - kVtStages : kSlots) / 2;
  static constexpr int kStages =
      kStagesFit < kMaxStages ? kStagesFit : kMaxStages;
  static constexpr int kVStages = kFp8 ? kVtStages : kStages;
  static constexpr int kRawFit = kFp8 ? kSlots - kStages - kVStages : 0;
  static constexpr int kRawSlots =
      kRawFit < kMaxRawSlots ? kRawFit : kMaxRawSlots;
  static_assert(kStages >= 2 && (!kFp8 || kRawSlots >= 2),
                "rings of at least two stages");
  static constexpr int kQStagingOffset = kQBytes;
  static constexpr int kKOffset = kQStagingOffset + kQStagingBytes;
  static constexpr int kVOffset = kKOffset + kStages * kStageBytes;
  static constexpr int kRawOffset = kVOffset + kVStages * kStageBytes;
  static constexpr int kTileBytes = kRawOffset + kRawSlots * kStageBytes;
  // The tiles, 1024-byte aligned for the swizzle.
  static constexpr int kSmemBytes = kTileBytes + 1024;
  static_assert(kSmemBytes + 1024 <= kSmemPerSm, "shared memory");

  // FP8 caches with 16-bit queries: the transposing warps write the Q tile
  // from the staging tile, with one scale per row.
  __device__ static bool quantizes_queries(const PrefillParams& p) {
    return kFp8 && p.q_type != ElemType::kFp8E4m3;
  }
  using StagedQ = attention::StagedRows16<kHeadDim, kBlockM>;

  using Barriers = PipelineBarriers<kStages, kVStages, kRawSlots>;
  using Pipeline = PipelineState<kStages, kVStages, kRawSlots>;

  // Consumer warpgroups issue their wgmma in turns (prefill_mainloop.cuh)
  // where a warpgroup's softmax is long beside its matrix products.
  static constexpr bool kTakeTurns = kHeadDim <= 128;

  // Register budgets after reallocation.
  static constexpr int kProducerRegs = kFp8 ? 56 : 40;
  static constexpr int kConsumerRegs = kFp8 ? 224 : 232;
  static_assert(kProducerThreads * kProducerRegs +
                    kConsumerThreads * kConsumerRegs <=
                kCtaRegisters);

  // FP8: probabilities are scaled by 2^8 before rounding to E4M3 (at most
  // 256 of E4M3's 448), so small ones keep their mantissa bits; O / l
  // cancels the factor.
  using Softmax = attention::OnlineSoftmax<kFp8 ? 8 : 0>;

  using SmemLayoutQ = decltype(cute::tile_to_shape(
      attention::KMajorAtom<Element, kRowBytes>{},
      cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      attention::KMajorAtom<Element, kRowBytes>{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>,
                  cute::Int<kStages>>{}));
  using SmemLayoutVt =
      decltype(attention::value_operand_layout<Element, kHeadDim, kBlockN,
                                               kVStages>());

  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<
          Element, Element, float,
          cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<
          Element, Element, float,
          cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockN>>,
          cute::GMMA::Major::K,
          kFp8 ? cute::GMMA::Major::K : cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
};

}  // namespace prefill
}  // namespace hpc
