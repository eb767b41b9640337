// SPDX-License-Identifier: Apache-2.0
// The online-softmax state of a set of query rows over the key blocks seen so
// far (Milakov & Gimelshein's online softmax, FlashAttention-2's O, m, l):
// the unnormalised output O (kept in the caller's o View between blocks), the
// running maximum m of the scaled logits in base 2 and the running sum l of
// 2^(logit - m). One type for every user of the state: the forward kernel's
// resume / finish, the schedules' merge of a partial result computed on
// another rank, the final normalisation, and the merge of two states (decode
// over a sharded KV cache).
//
// Semantics, per row: a row that saw no allowed key has m = -inf, l = 0 and
// finalises to O = 0, LSE = -inf; a row whose allowed logits held a NaN has
// l = NaN and finalises to O = NaN, LSE = NaN; a partial with LSE = -inf
// contributes nothing, a partial with LSE = NaN makes the row NaN.
#pragma once

#include <blockattn/core/config.hpp>

#include <cstdint>
#include <string>

namespace blockattn {
namespace impl {

/// The per-row rules, shared by the kernels (scalars in registers or scratch)
/// and by SoftmaxState's element-wise kernels (the same formulas, so a state
/// finalised here is bitwise what the kernel's finish writes).
template <class T>
struct SoftmaxRow {
  /// 1 / l, or 0 for a row that saw no key (so O = 0).
  KOKKOS_INLINE_FUNCTION static T inverse_sum(T l) { return l != T(0) ? T(1) / l : T(0); }
  /// Natural-log LSE of the row: (m + log2 l) ln 2, or -inf without a key.
  KOKKOS_INLINE_FUNCTION static T lse(T m, T l) {
    return l != T(0) ? (m + kmath::log2(l)) * ln2<T> : -infinity<T>();
  }
  /// Weights (a, w) of the old state and of a term with base-2 max m2 when
  /// both are rescaled to the new max m' = max(m, m2): a = 2^(m - m'),
  /// w = 2^(m2 - m'). Returns m'.
  KOKKOS_INLINE_FUNCTION static T rescale(T m, T m2, T& a, T& w) {
    const T mn = m > m2 ? m : m2;
    a = kmath::exp2(m - mn);  // 0 when the state had no key yet (m = -inf)
    w = kmath::exp2(m2 - mn);
    return mn;
  }
};

/// f(b, i, h) for every row of o (batch, queries, heads, ...), on exec.
template <class ExecSpace, class OV, class F>
void for_each_row(const ExecSpace& exec, const char* label, const OV& o, const F& f) {
  const int queries = int(o.extent(1)), heads = int(o.extent(2));
  const std::int64_t rows = std::int64_t(o.extent(0)) * queries * heads;
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, rows),
      KOKKOS_LAMBDA(const std::int64_t idx) {
        const int h = int(idx % heads);
        const int i = int((idx / heads) % queries);
        const int b = int(idx / (std::int64_t(heads) * queries));
        f(b, i, h);
      });
}

/// The state (m, l) of (batch, heads, queries) rows; O is the caller's
/// (batch, queries, heads, >= dim) View, unnormalised while the state is open.
template <class T, class MemorySpace>
struct SoftmaxState {
  using view_type = Kokkos::View<T***, Kokkos::LayoutRight, MemorySpace>;
  view_type m, l;  // base-2 running max of the scaled logits, running sum

  SoftmaxState() = default;
  SoftmaxState(int batch, int heads, int queries, const std::string& label = "blockattn::softmax")
      : m(Kokkos::view_alloc(Kokkos::WithoutInitializing, label + "_m"), batch, heads, queries),
        l(Kokkos::view_alloc(Kokkos::WithoutInitializing, label + "_l"), batch, heads, queries) {}

  bool allocated() const { return m.data() != nullptr; }
  std::int64_t bytes() const { return std::int64_t(m.span() + l.span()) * std::int64_t(sizeof(T)); }

  /// Empty state: O = 0, m = -inf, l = 0 (no key seen).
  template <class ExecSpace, class OV>
  void init(const ExecSpace& exec, const OV& o, int dim) const {
    const view_type ms = m, ls = l;
    for_each_row(
        exec, "blockattn::softmax_init", o, KOKKOS_LAMBDA(int b, int i, int h) {
          ms(b, h, i) = -infinity<T>();
          ls(b, h, i) = T(0);
          for (int d = 0; d < dim; ++d) o(b, i, h, d) = T(0);
        });
  }

  /// Merges a normalised partial result over other keys (part_o, of T or a
  /// 16-bit storage type, and its natural-log part_lse of shape (batch,
  /// heads, queries)) into the state:
  ///   m' = max(m, lse2), O = 2^(m - m') O + 2^(lse2 - m') part_o,
  ///   l = 2^(m - m') l + 2^(lse2 - m'),   lse2 = part_lse * log2(e).
  template <class ExecSpace, class OV, class PO, class PL>
  void merge_partial(const ExecSpace& exec, const OV& o, const PO& part_o, const PL& part_lse,
                     int dim) const {
    const view_type ms = m, ls = l;
    for_each_row(
        exec, "blockattn::softmax_merge_partial", o, KOKKOS_LAMBDA(int b, int i, int h) {
          const T lp = part_lse(b, h, i);
          if (lp == -infinity<T>()) return;  // saw no key; a NaN LSE merges as NaN
          T a, w;
          ms(b, h, i) = SoftmaxRow<T>::rescale(ms(b, h, i), lp * log2e<T>, a, w);
          ls(b, h, i) = ls(b, h, i) * a + w;
          for (int d = 0; d < dim; ++d)
            o(b, i, h, d) = o(b, i, h, d) * a + T(part_o(b, i, h, d)) * w;
        });
  }

  /// Merges another open state (other_o unnormalised, other's m and l) of the
  /// same rows over other keys: m' = max(m, m2), O = a O + w O2, l = a l + w l2.
  template <class ExecSpace, class OV, class PO>
  void merge_state(const ExecSpace& exec, const OV& o, const SoftmaxState& other, const PO& other_o,
                   int dim) const {
    const view_type ms = m, ls = l, m2 = other.m, l2 = other.l;
    for_each_row(
        exec, "blockattn::softmax_merge_state", o, KOKKOS_LAMBDA(int b, int i, int h) {
          if (l2(b, h, i) == T(0)) return;  // the other state saw no key
          T a, w;
          ms(b, h, i) = SoftmaxRow<T>::rescale(ms(b, h, i), m2(b, h, i), a, w);
          ls(b, h, i) = ls(b, h, i) * a + l2(b, h, i) * w;
          for (int d = 0; d < dim; ++d) o(b, i, h, d) = o(b, i, h, d) * a + other_o(b, i, h, d) * w;
        });
  }

  /// Normalises the state into o and lse (natural log); closes the state.
  template <class ExecSpace, class OV, class LV>
  void finalize(const ExecSpace& exec, const OV& o, const LV& lse, int dim) const {
    finalize(exec, o, o, lse, dim);
  }

  /// Same, with the unnormalised O in `acc` (type T) and the normalised O
  /// written to `o` in its storage type (rounded once: bf16 / fp16 storage).
  template <class ExecSpace, class AV, class OV, class LV>
  void finalize(const ExecSpace& exec, const AV& acc, const OV& o, const LV& lse, int dim) const {
    using OS = typename OV::non_const_value_type;
    const view_type ms = m, ls = l;
    for_each_row(
        exec, "blockattn::softmax_finalize", o, KOKKOS_LAMBDA(int b, int i, int h) {
          const T inv_l = SoftmaxRow<T>::inverse_sum(ls(b, h, i));
          for (int d = 0; d < dim; ++d) o(b, i, h, d) = OS(acc(b, i, h, d) * inv_l);
          lse(b, h, i) = SoftmaxRow<T>::lse(ms(b, h, i), ls(b, h, i));
        });
  }
};

}  // namespace impl
}  // namespace blockattn
