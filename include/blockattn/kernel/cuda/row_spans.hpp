// SPDX-License-Identifier: Apache-2.0
// Key-tile kinds from the query rows' key intervals, host and device.
//
// A mask with allowed_keys() (policy/mask.hpp) gives each query row one
// interval [begin, end) of key positions. The GPU tensor-core forwards
// (cuda/flash_forward.hpp, cuda/flash_forward_f32.hpp) ask for every row of a CTA's query
// block once, keep the intervals in shared memory and reduce them to
// RowSpanBounds: from then on a key tile's kind takes four comparisons and a
// partial tile's mask two per key, where mask.classify() and allowed_keys()
// per tile cost a DocumentMask two to four binary searches over its offsets
// in global memory each time (dependent loads on the critical path of every
// tile). tests/test_row_spans.cpp checks kind() against allowed() by brute
// force for the built-in masks and position maps.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/policy/mask.hpp>

namespace blockattn::impl {

/// What the rows of one query block see, from their intervals: the hull
/// [lo, hi) of their union (lo >= hi: no row sees a key) and the
/// intersection [all_lo, all_hi) (the keys every row sees; all_lo >= all_hi:
/// none).
/// Trivial (the kernels keep one in shared memory): start from none().
struct RowSpanBounds {
  index_type lo, hi;
  index_type all_lo, all_hi;

  /// The bounds of no rows.
  KOKKOS_INLINE_FUNCTION static RowSpanBounds none() {
    return RowSpanBounds{INT64_MAX, INT64_MIN, INT64_MIN, INT64_MAX};
  }

  /// One row's interval (an empty one empties the intersection alone).
  KOKKOS_INLINE_FUNCTION void add(const KeyInterval& iv) {
    if (iv.begin < iv.end) {
      lo = iv.begin < lo ? iv.begin : lo;
      hi = iv.end > hi ? iv.end : hi;
    }
    all_lo = iv.begin > all_lo ? iv.begin : all_lo;
    all_hi = iv.end < all_hi ? iv.end : all_hi;
  }

  /// The bounds of both sets of rows.
  KOKKOS_INLINE_FUNCTION void merge(const RowSpanBounds& o) {
    lo = o.lo < lo ? o.lo : lo;
    hi = o.hi > hi ? o.hi : hi;
    all_lo = o.all_lo > all_lo ? o.all_lo : all_lo;
    all_hi = o.all_hi < all_hi ? o.all_hi : all_hi;
  }

  /// The kind of a key tile whose key positions lie in [p_first, p_last]
  /// (its first and last key's; positions increase with the index): full
  /// when every row sees all of [p_first, p_last]; empty when the hull
  /// misses it; partial otherwise. Exact for full. Exact for empty where
  /// some row sees every position of the hull (a contiguous block of rows
  /// under the built-in masks); elsewhere a tile inside the hull that no row
  /// sees is called partial, computed and masked whole: slower, never wrong.
  KOKKOS_INLINE_FUNCTION TileKind kind(index_type p_first, index_type p_last) const {
    if (p_last < lo || p_first >= hi) return TileKind::empty;
    if (all_lo <= p_first && p_last < all_hi) return TileKind::full;
    return TileKind::partial;
  }
};

/// One row's mask in a partial tile, from its interval: key position k is
/// seen iff begin <= k < end ({INT64_MIN, INT64_MAX}: no mask).
struct KeySpanTest {
  index_type begin = INT64_MIN, end = INT64_MAX;
  KOKKOS_INLINE_FUNCTION bool operator()(index_type k) const { return begin <= k && k < end; }
};

}  // namespace blockattn::impl
