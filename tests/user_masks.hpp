// SPDX-License-Identifier: Apache-2.0
// A user-defined mask as tests use it (examples/custom_mask.cpp shows the same
// pattern to users): prefix-LM, bidirectional on a prefix, causal after it.
#pragma once

#include <blockattn/mask.hpp>

namespace blockattn::test {

struct PrefixLMMask {
  index_type prefix = 0;
  KOKKOS_INLINE_FUNCTION bool allowed(index_type q, index_type k) const {
    return k < prefix || k <= q;
  }
  KOKKOS_INLINE_FUNCTION TileKind classify(index_type q_begin, index_type q_end, index_type k_begin,
                                           index_type k_end) const {
    if (k_end <= prefix || k_end - 1 <= q_begin) return TileKind::full;
    if (k_begin >= prefix && k_begin > q_end - 1) return TileKind::empty;
    return TileKind::partial;
  }
};

/// Causal attention inside packed documents of `length` tokens each: a
/// causal-lower mask (no query sees a later key) with whole blocks skipped.
struct DocumentCausalMask {
  index_type length = 1;
  KOKKOS_INLINE_FUNCTION bool allowed(index_type q, index_type k) const {
    return k <= q && k / length == q / length;
  }
  KOKKOS_INLINE_FUNCTION TileKind classify(index_type q_begin, index_type q_end, index_type k_begin,
                                           index_type k_end) const {
    const index_type q_last = q_end - 1, k_last = k_end - 1;
    if (k_begin > q_last || k_last / length < q_begin / length ||
        k_begin / length > q_last / length)
      return TileKind::empty;
    if (k_begin / length == q_last / length && k_last / length == q_begin / length &&
        k_last <= q_begin)
      return TileKind::full;
    return TileKind::partial;
  }
};

}  // namespace blockattn::test
