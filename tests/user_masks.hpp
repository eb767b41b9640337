// SPDX-License-Identifier: Apache-2.0
// A user-defined mask as tests use it (examples/custom_mask.cpp shows the same
// pattern to users): causal documents of one fixed length. (Prefix-LM and
// variable-length documents are library masks: mask.hpp, document_mask.hpp.)
#pragma once

#include <blockattn/policy/mask.hpp>

namespace blockattn::test {

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
