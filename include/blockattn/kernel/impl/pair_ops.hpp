// SPDX-License-Identifier: Apache-2.0
// Operations on a block pair's results and operands that every implementation
// which computes a pair apart from the kernels' softmax state shares (cuDNN,
// the tensor-core kernels, a registered implementation): rows that see no
// key, inf / NaN in a value block, a pair's gradient sums, a normalised
// partial widened into the compute type.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/policy/mask.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace blockattn::impl {

/// Whether every operand has a unit stride in the head dim (cuDNN's layout,
/// the tensor-core kernels').
template <class... Vs>
bool unit_head_stride(const Vs&... v) {
  return (... && (v.extent(3) <= 1 || v.stride(3) == 1));
}

/// O = 0 and LSE = -inf for the rows outside [r0, r1) (rows that see no key).
template <class ExecSpace, class OV, class LV>
void fill_unseen_rows(const ExecSpace& exec, const OV& o, const LV& lse, index_type r0,
                      index_type r1) {
  using V = typename OV::non_const_value_type;
  using L = typename LV::non_const_value_type;
  const int batch = int(o.extent(0)), rows = int(o.extent(1)), heads = int(o.extent(2)),
            dim = int(o.extent(3));
  const int lo = int(r0), hi = int(r1);
  Kokkos::parallel_for(
      "blockattn::unseen_rows",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(exec, {0, 0, 0}, {batch, rows, heads}),
      KOKKOS_LAMBDA(int b, int i, int h) {
        if (i >= lo && i < hi) return;
        for (int d = 0; d < dim; ++d) o(b, i, h, d) = V(0.0f);
        lse(b, h, i) = -infinity<L>();
      });
}

/// Whether any of n 32-bit words (two 16-bit values each) has a value whose
/// exponent field (mask e) is all ones: inf or NaN. (Its own function: nvcc
/// takes no extended lambda that first captures inside `if constexpr`.)
template <class ExecSpace>
bool nonfinite_words(const ExecSpace& exec, const std::uint32_t* w, std::size_t n,
                     std::uint32_t e) {
  int bad = 0;
  Kokkos::parallel_reduce(
      "blockattn::nonfinite_words", Kokkos::RangePolicy<ExecSpace>(exec, 0, n),
      KOKKOS_LAMBDA(std::size_t i, int& acc) {
        const std::uint32_t x = w[i];
        if ((x & e) == e || ((x >> 16) & e) == e) acc = 1;
      },
      Kokkos::Max<int>(bad));
  return bad > 0;  // Max's identity (nothing found) is INT_MIN
}

/// Whether a 4-D View of 16-bit values holds inf or NaN (a reduction whose
/// result the host waits for). A fused provider (or a tensor-core kernel)
/// multiplies the P = 0 of
/// masked keys into V, so an inf or NaN there would reach rows that cannot
/// see it: calls whose mask hides keys check V first and, where it holds
/// one, take BlockAttn's kernels (NaN exactly where visible).
template <class ExecSpace, class View>
bool has_nonfinite(const ExecSpace& exec, const View& v) {
  using V = typename View::non_const_value_type;
  if constexpr (is_half_storage_v<V> && sizeof(V) == 2) {
    if (v.span_is_contiguous() && v.span() % 2 == 0 &&
        reinterpret_cast<std::uintptr_t>(v.data()) % 4 == 0) {
      // One pass over 32-bit words, coalesced: the exponent field all ones.
      return nonfinite_words(exec, reinterpret_cast<const std::uint32_t*>(v.data()), v.span() / 2,
                             std::is_same<V, bf16>::value ? 0x7f80u : 0x7c00u);
    }
  }
  const int n0 = int(v.extent(0)), n1 = int(v.extent(1)), n2 = int(v.extent(2)),
            n3 = int(v.extent(3));
  int bad = 0;
  Kokkos::parallel_reduce(
      "blockattn::nonfinite",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(exec, {0, 0, 0}, {n0, n1, n2}),
      KOKKOS_LAMBDA(int a, int b, int c, int& acc) {
        for (int d = 0; d < n3; ++d) {
          const float x = float(v(a, b, c, d));
          if (!(x - x == 0.0f)) acc = 1;
        }
      },
      Kokkos::Max<int>(bad));
  return bad > 0;  // Max's identity (nothing found) is INT_MIN
}

/// Zero gradients for the rows of g outside [r0, r1).
template <class ExecSpace, class GV>
void zero_rows_outside(const ExecSpace& exec, const GV& g, index_type r0, index_type r1) {
  using V = typename GV::non_const_value_type;
  const int batch = int(g.extent(0)), rows = int(g.extent(1)), heads = int(g.extent(2)),
            dim = int(g.extent(3));
  const int lo = int(r0), hi = int(r1);
  Kokkos::parallel_for(
      "blockattn::zero_rows",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(exec, {0, 0, 0}, {batch, rows, heads}),
      KOKKOS_LAMBDA(int b, int i, int h) {
        if (i >= lo && i < hi) return;
        for (int d = 0; d < dim; ++d) g(b, i, h, d) = V(0.0f);
      });
}

/// g(b, i, h, :) += G(t(b, i, h, :)) for the rows i in [r0, r1): a band
/// piece's gradients (storage type, t) into a block pair's sums (g).
template <class ExecSpace, class GV, class TV>
void add_piece_rows(const ExecSpace& exec, const GV& g, const TV& t, index_type r0, index_type r1) {
  using G = typename GV::non_const_value_type;
  const int batch = int(g.extent(0)), heads = int(g.extent(2)), dim = int(g.extent(3));
  if (r1 <= r0) return;
  Kokkos::parallel_for(
      "blockattn::add_piece",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(exec, {0, int(r0), 0},
                                                        {batch, int(r1), heads}),
      KOKKOS_LAMBDA(int b, int i, int h) {
        for (int d = 0; d < dim; ++d) g(b, i, h, d) += G(float(t(b, i, h, d)));
      });
}

/// A pair's gradient sums before its 16-bit partials are added
/// (add_piece_rows): zeroed, unless the pair accumulates into them.
template <class ExecSpace, class GQ, class GK>
void clear_pair_sums(const ExecSpace& exec, const GQ& dq, const GK& dk, const GK& dv, bool acc_dq,
                     bool acc_dkv) {
  using TQ = typename GQ::non_const_value_type;
  using TK = typename GK::non_const_value_type;
  if (!acc_dq) Kokkos::deep_copy(exec, dq, TQ(0));
  if (!acc_dkv) {
    Kokkos::deep_copy(exec, dk, TK(0));
    Kokkos::deep_copy(exec, dv, TK(0));
  }
}

/// A normalised result of rows [0, rows) in the storage type (part_o;
/// part_lse, natural log, -inf where no key was seen) as a result in the
/// compute type (out_o, out_lse), whose rows with part_lse = -inf are left
/// as they are (fill_unseen_rows: O = 0, LSE = -inf).
template <class ExecSpace, class OO, class OL, class PO, class PL>
void widen_result(const ExecSpace& exec, const OO& out_o, const OL& out_lse, const PO& part_o,
                  const PL& part_lse, index_type rows) {
  using T = typename OO::non_const_value_type;
  const int batch = int(out_o.extent(0)), heads = int(out_o.extent(2)), dim = int(out_o.extent(3));
  if (rows <= 0) return;
  Kokkos::parallel_for(
      "blockattn::widen_result",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(exec, {0, 0, 0}, {batch, int(rows), heads}),
      KOKKOS_LAMBDA(int b, int i, int h) {
        const T lp = T(part_lse(b, h, i));
        if (lp == -infinity<T>()) return;  // saw no key of this row
        out_lse(b, h, i) = lp;
        for (int d = 0; d < dim; ++d) out_o(b, i, h, d) = T(float(part_o(b, i, h, d)));
      });
}

/// Whether the mask allows every (query, key) pair of a block pair.
template <class Mask, class QP, class KP>
bool pair_covers_all(const Mask& mask, const QP& qpos, index_type queries, const KP& kpos,
                     index_type keys) {
  return queries <= 0 || keys <= 0 ||
         mask.classify(qpos(0), qpos(queries - 1) + 1, kpos(0), kpos(keys - 1) + 1) ==
             TileKind::full;
}

/// delta(b, h, i) = rowsum(dO o O) of row (b, i, h), in delta's value type:
/// what a backward pair needs besides the forward's LSE (dS = P o (dP - D)).
template <class ExecSpace, class DOV, class OV, class DV>
void row_delta(const ExecSpace& exec, const DOV& dout, const OV& o, const DV& delta, int dim) {
  using T = typename DV::non_const_value_type;
  const int batch = int(delta.extent(0)), heads = int(delta.extent(1)), rows = int(delta.extent(2));
  if (rows <= 0) return;
  Kokkos::parallel_for(
      "blockattn::row_delta",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(exec, {0, 0, 0}, {batch, rows, heads}),
      KOKKOS_LAMBDA(int b, int i, int h) {
        T d = T(0);
        for (int c = 0; c < dim; ++c) d += T(dout(b, i, h, c)) * T(o(b, i, h, c));
        delta(b, h, i) = d;
      });
}

}  // namespace blockattn::impl
