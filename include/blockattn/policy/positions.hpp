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
