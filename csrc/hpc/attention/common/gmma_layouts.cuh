// Shared-memory layouts of the wgmma operands the attention kernels share:
// the K-major atom of the paged copies' rows, and the value operand of
// O += P V (or its transpose) over a ring of V stages.
#pragma once

#include <type_traits>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

namespace hpc {
namespace attention {

// The K-major shared-memory atom of rows of kRowBytes bytes, 128 or 64 (the
// swizzle of the copies that fill it).
template <class Element, int kRowBytes>
using KMajorAtom = std::conditional_t<kRowBytes == 128,
                                      cute::GMMA::Layout_K_SW128_Atom<Element>,
                                      cute::GMMA::Layout_K_SW64_Atom<Element>>;

// V over the V stages as (channel, key, stage). 16-bit: the bytes the paged
// copies land ([channel chunk][key][128 bytes]), MN-major (keys tile first,
// then channel chunks, then stages). FP8 (whose wgmma takes K-major
// operands only): V^T, channel rows of kKeys keys, K-major.
template <class Element, int kHeadDim, int kKeys, int kStages>
constexpr auto value_operand_layout() {
  using Shape =
      cute::Shape<cute::Int<kHeadDim>, cute::Int<kKeys>, cute::Int<kStages>>;
  if constexpr (std::is_same_v<Element, cute::float_e4m3_t>) {
    return cute::tile_to_shape(KMajorAtom<Element, kKeys>{}, Shape{});
  } else {
    return cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<Element>{},
                               Shape{},
                               cute::Step<cute::_2, cute::_1, cute::_3>{});
  }
}

}  // namespace attention
}  // namespace hpc
