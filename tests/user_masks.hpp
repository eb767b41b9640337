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

}  // namespace blockattn::test
