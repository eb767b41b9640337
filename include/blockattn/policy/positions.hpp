// SPDX-License-Identifier: Apache-2.0
// Position maps: local row index -> global token position.
//
// A position map is a trivially copyable struct with
//   KOKKOS_FUNCTION index_type operator()(index_type local) const;
// that is strictly increasing in `local`. Kernels bound the positions of a tile
// by [map(first), map(last) + 1) and hand that box to the mask's classify().
// Partition policies (distributed issue) produce such maps for each rank.
#pragma once

#include <blockattn/core/config.hpp>

#include <type_traits>
#include <utility>

namespace blockattn {

/// Global position = offset + local index (one contiguous chunk of a sequence).
struct OffsetPositions {
  index_type offset = 0;
  KOKKOS_INLINE_FUNCTION constexpr index_type operator()(index_type local) const {
    return offset + local;
  }
};

/// Global position = offset + stride * local (e.g. one stripe of a striped partition).
struct StridedPositions {
  index_type offset = 0;
  index_type stride = 1;
  KOKKOS_INLINE_FUNCTION constexpr index_type operator()(index_type local) const {
    return offset + stride * local;
  }
};

/// A piecewise-affine map of two pieces, the form of every built-in
/// partition's map (offset, strided, zigzag):
///   local i <  split: first + stride * i
///   local i >= split: second + stride * (i - split)
/// The kernels run every built-in map as this one type (canonical_positions),
/// so that a partition does not multiply the kernels a program compiles.
struct AffinePositions {
  index_type split = index_type(1) << 62;  // rows of the first piece (default: all)
  index_type first = 0;                    // position of local row 0
  index_type second = 0;                   // position of local row `split`
  index_type stride = 1;                   // >= 1
  KOKKOS_INLINE_FUNCTION constexpr index_type operator()(index_type i) const {
    return i < split ? first + stride * i : second + stride * (i - split);
  }
};

/// The map the kernels run a position map as: AffinePositions for the
/// built-in affine maps, the map itself otherwise (tables, your own).
template <class P>
constexpr const P& canonical_positions(const P& p) {
  return p;
}
constexpr AffinePositions canonical_positions(const OffsetPositions& p) {
  return AffinePositions{index_type(1) << 62, p.offset, 0, 1};
}
constexpr AffinePositions canonical_positions(const StridedPositions& p) {
  return AffinePositions{index_type(1) << 62, p.offset, 0, p.stride};
}
constexpr AffinePositions canonical_positions(const AffinePositions& p) {
  return p;
}

namespace impl {
template <class P, class = void>
struct is_position_map : std::false_type {};
template <class P>
struct is_position_map<P, std::void_t<decltype(std::declval<const P&>()(index_type{}))>>
    : std::bool_constant<std::is_convertible<decltype(std::declval<const P&>()(index_type{})),
                                             index_type>::value &&
                         std::is_trivially_copyable<P>::value> {};

template <class P>
constexpr void check_position_map() {
  static_assert(
      is_position_map<P>::value,
      "BlockAttn: a position map must be trivially copyable and have a const member "
      "`index_type operator()(index_type local) const` (see blockattn/policy/positions.hpp)");
}
}  // namespace impl

}  // namespace blockattn
