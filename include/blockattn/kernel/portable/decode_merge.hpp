// SPDX-License-Identifier: Apache-2.0
// The second pass of split-KV decode (decode_kernel.hpp): each row merged
// from its splits' open states (the online-softmax rules of
// softmax_state.hpp), the sink folded into the normalisation.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/impl/softmax_state.hpp>
#include <blockattn/kernel/portable/decode_layout.hpp>
#include <blockattn/kernel/sinks.hpp>

#include <cstdint>

namespace blockattn {
namespace impl {

/// The merge pass: row (b, h, i) from its splits' open states.
/// m' = max m_s, l = sum 2^(m_s - m') l_s, O = sum 2^(m_s - m') O_s / l;
/// a split that saw no key (l_s = 0) adds nothing, a NaN l_s makes the row NaN.
template <class ExecSpace, class T, class OS>
struct DecodeMerge {
  using mem = typename ExecSpace::memory_space;
  Kokkos::View<OS****, Kokkos::LayoutStride, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> o;
  Kokkos::View<T***, Kokkos::LayoutStride, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> lse;
  Kokkos::View<T*, mem> part_o, part_m, part_l;
  DecodeGrid g;
  sink_view<mem> sinks;  // folded into the normalisation (empty: none)
  /// Key ranges of sequence b (empty: g.splits for all); a sequence of one
  /// range was written by the kernel.
  Kokkos::View<const int*, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> seq_splits;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t row) const {
    const int i = int(row % g.rows);
    const int h = int((row / g.rows) % g.heads);
    const int b = int(row / (std::int64_t(g.rows) * g.heads));
    const std::int64_t n = g.state_rows();
    const int D = g.dim;
    const int splits = seq_splits.data() ? seq_splits(b) : g.splits;
    if (splits == 1) return;
    T mx = -infinity<T>();
    bool nan = false;
    for (int s = 0; s < splits; ++s) {
      const T l = part_l(s * n + row);
      if (l != l) nan = true;
      if (l != T(0) && part_m(s * n + row) > mx) mx = part_m(s * n + row);
    }
    if (nan) {
      for (int d = 0; d < D; ++d) o(b, i, h, d) = OS(quiet_nan<T>());
      lse(b, h, i) = quiet_nan<T>();
      return;
    }
    T w[max_decode_splits];
    T l = T(0);
    for (int s = 0; s < splits; ++s) {
      const T ls = part_l(s * n + row);
      w[s] = ls != T(0) ? kmath::exp2(part_m(s * n + row) - mx) : T(0);
      l += w[s] * ls;
    }
    // The sink in the normalisation: O rounded once into a 16-bit o.
    T f;
    lse(b, h, i) = fold_sink(SoftmaxRow<T>::lse(mx, l), sink_of<T>(sinks, h), f);
    const T inv = SoftmaxRow<T>::inverse_sum(l);
    for (int d = 0; d < D; ++d) {
      T acc = T(0);
      for (int s = 0; s < splits; ++s)
        if (w[s] != T(0)) acc += w[s] * part_o((s * n + row) * D + d);
      o(b, i, h, d) = OS(acc * inv * f);
    }
  }
};

}  // namespace impl
}  // namespace blockattn
