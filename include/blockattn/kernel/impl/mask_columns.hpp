// SPDX-License-Identifier: Apache-2.0
// The mask of one query row over one key tile as a column range, for masks
// whose allowed keys form one interval (allowed_keys, policy/mask.hpp): the
// kernels then mask a partial tile with two straight fills instead of testing
// every pair, and compute only the columns in between.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>

#include <type_traits>

namespace blockattn::impl {

/// The first c in [0, n] with c == n or kpos(k0 + c) >= x: the position map is
/// strictly increasing (positions.hpp), so a binary search; for an offset map
/// one subtraction.
template <class KPos>
KOKKOS_INLINE_FUNCTION int first_position_at_least(const KPos& kpos, int k0, int n, index_type x) {
  if (n <= 0 || kpos(k0) >= x) return 0;
  if (kpos(k0 + n - 1) < x) return n;
  // Here kpos(k0) < x <= kpos(k0 + n - 1).
  if constexpr (std::is_same<KPos, OffsetPositions>::value) {
    return static_cast<int>(x - kpos(k0));
  } else if constexpr (std::is_same<KPos, AffinePositions>::value) {
    // The first local row i >= k0 with kpos(i) >= x, piece by piece:
    // ceil((x - start) / stride) rows into a piece.
    const auto rows_before = [&](index_type start) {
      const index_type d = x - start;
      return d <= 0 ? index_type(0) : (d + kpos.stride - 1) / kpos.stride;
    };
    index_type i = rows_before(kpos.first);
    if (i >= kpos.split) i = kpos.split + rows_before(kpos.second);
    // Here kpos(k0) < x <= kpos(k0 + n - 1): the answer is in [1, n - 1].
    return static_cast<int>(i - k0);
  } else {
    int lo = 1, hi = n - 1;  // the answer is in [1, n - 1]
    while (lo < hi) {
      const int mid = lo + (hi - lo) / 2;
      if (kpos(k0 + mid) >= x)
        hi = mid;
      else
        lo = mid + 1;
    }
    return lo;
  }
}

/// The columns [lo, hi) of the key tile k0 .. k0 + n - 1 that query position
/// q sees (lo == hi: none). Only for masks with allowed_keys().
struct ColumnRange {
  int lo, hi;
};
template <class Mask, class KPos>
KOKKOS_INLINE_FUNCTION ColumnRange allowed_columns(const Mask& mask, index_type q, const KPos& kpos,
                                                   int k0, int n) {
  const KeyInterval iv = mask.allowed_keys(q);
  const int lo = first_position_at_least(kpos, k0, n, iv.begin);
  const int hi = first_position_at_least(kpos, k0, n, iv.end);
  return ColumnRange{lo, hi > lo ? hi : lo};
}

}  // namespace blockattn::impl
