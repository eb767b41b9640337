// SPDX-License-Identifier: Apache-2.0
// Element-wise kernels on rank-4 Views of one shape: a = b converted to a's
// value type (widening exactly, or rounding once into 16-bit storage), and
// a += b. Blocks travel in their storage type while partial results and sums
// stay in the compute type; a user's dQ, dK, dV may be LayoutLeft (Kokkos'
// default on GPUs) or strided sub-views, the library's own buffers are
// LayoutRight. The seam's convert_views / add_views (block_product.hpp) call
// these.
#pragma once

#include <blockattn/core/config.hpp>

#include <cstdint>
#include <type_traits>

namespace blockattn::impl {

/// One element of combine_into: a = A(b) (converted) or a += b. (A class
/// rather than `if constexpr` in the kernels' lambdas: nvcc rejects an
/// extended lambda that first captures a variable inside `if constexpr`.)
template <bool Add>
struct Combine {
  template <class A, class B>
  KOKKOS_INLINE_FUNCTION static void apply(A& a, const B& b) {
    a = A(b);
  }
};
template <>
struct Combine<true> {
  template <class A, class B>
  KOKKOS_INLINE_FUNCTION static void apply(A& a, const B& b) {
    a += b;
  }
};

/// a = b (Add false, converted) or a += b (Add true) for i < n of flat spans.
template <bool Add, class ExecSpace, class TA, class TB>
void combine_flat(const ExecSpace& exec, TA* const pa, const TB* const pb, const std::int64_t n) {
  Kokkos::parallel_for(
      Add ? "blockattn::add_into" : "blockattn::convert",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
      KOKKOS_LAMBDA(const std::int64_t i) { Combine<Add>::apply(pa[i], pb[i]); });
}

/// a = b or a += b element-wise (see the top of this file). Same
/// (non-strided) layout and both contiguous: one flat loop without index
/// arithmetic (8x faster than the indexed loop for 4M floats on 2 Zen 3
/// cores, measured under load); the schedules' own buffers take it.
template <bool Add, class ExecSpace, class AV, class BV>
void combine_into(const ExecSpace& exec, const AV& a, const BV& b) {
  static_assert(unsigned(AV::rank) == 4 && unsigned(BV::rank) == 4,
                "blockattn::impl::combine_into: rank-4 Views");
  const std::int64_t n1 = std::int64_t(a.extent(1)), n2 = std::int64_t(a.extent(2)),
                     n3 = std::int64_t(a.extent(3));
  const std::int64_t n = std::int64_t(a.extent(0)) * n1 * n2 * n3;
  constexpr bool same_layout =
      std::is_same<typename AV::array_layout, typename BV::array_layout>::value &&
      !std::is_same<typename AV::array_layout, Kokkos::LayoutStride>::value;
  if (same_layout && a.span_is_contiguous() && b.span_is_contiguous() &&
      std::int64_t(a.span()) == n && std::int64_t(b.span()) == n) {
    combine_flat<Add>(exec, a.data(), b.data(), n);
    return;
  }
  Kokkos::parallel_for(
      Add ? "blockattn::add_into" : "blockattn::convert",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const std::int64_t d = i % n3, r = i / n3, h = r % n2, r2 = r / n2, q = r2 % n1,
                           bb = r2 / n1;
        Combine<Add>::apply(a(bb, q, h, d), b(bb, q, h, d));
      });
}

}  // namespace blockattn::impl
