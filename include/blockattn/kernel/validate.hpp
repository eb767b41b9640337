// SPDX-License-Identifier: Apache-2.0
// Argument checks of the entry points (attention_forward, attention_backward)
// and of the distributed drivers: the View types at compile time (one
// static_assert per requirement, each naming the fix), extents, memory spaces,
// offsets and the scale at run time. Every failure names the argument.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/options.hpp>

#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

namespace blockattn {

/// Sizes of one block pair: batch, query heads, key/value heads, query rows,
/// key rows, head dim (host side, CUTLASS's "Arguments").
struct BlockExtents {
  int batch = 0, heads = 0, kv_heads = 0, queries = 0, keys = 0, dim = 0;
};

namespace impl {

template <class V>
using value_of = typename V::non_const_value_type;

/// True when q, k, v, o, lse are Views of the ranks and value types attention_forward takes.
template <class QV, class KV, class VV, class OV, class LV>
constexpr bool forward_views_ok() {
  if constexpr (Kokkos::is_view<QV>::value && Kokkos::is_view<KV>::value &&
                Kokkos::is_view<VV>::value && Kokkos::is_view<OV>::value &&
                Kokkos::is_view<LV>::value) {
    using T = value_of<OV>;
    return QV::rank == 4 && KV::rank == 4 && VV::rank == 4 && OV::rank == 4 && LV::rank == 3 &&
           is_value_type_v<T> && std::is_same<value_of<QV>, T>::value &&
           std::is_same<value_of<KV>, T>::value && std::is_same<value_of<VV>, T>::value &&
           std::is_same<value_of<LV>, compute_t<T>>::value &&
           !std::is_const<typename OV::value_type>::value &&
           !std::is_const<typename LV::value_type>::value;
  } else {
    return false;
  }
}

/// One static_assert per requirement, each naming the fix.
template <class QV, class KV, class VV, class OV, class LV>
constexpr void check_forward_view_types() {
  constexpr bool views = Kokkos::is_view<QV>::value && Kokkos::is_view<KV>::value &&
                         Kokkos::is_view<VV>::value && Kokkos::is_view<OV>::value &&
                         Kokkos::is_view<LV>::value;
  static_assert(views, "BlockAttn: attention_forward takes Kokkos::Views q, k, v, o, lse");
  if constexpr (views) {
    static_assert(QV::rank == 4 && KV::rank == 4 && VV::rank == 4 && OV::rank == 4,
                  "BlockAttn: q, k, v and o must be rank-4 Views (batch, seq, heads, head_dim)");
    static_assert(LV::rank == 3, "BlockAttn: lse must be a rank-3 View (batch, heads, seq)");
    using T = value_of<OV>;
    static_assert(is_value_type_v<T>,
                  "BlockAttn: the value type of o must be float, double, blockattn::bf16 or "
                  "blockattn::fp16");
    static_assert(std::is_same<value_of<QV>, T>::value && std::is_same<value_of<KV>, T>::value &&
                      std::is_same<value_of<VV>, T>::value,
                  "BlockAttn: q, k, v and o must have the same value type (mixed storage types "
                  "are not supported: convert the inputs)");
    static_assert(std::is_same<value_of<LV>, compute_t<T>>::value,
                  "BlockAttn: lse must have the compute type of the values: float for float, "
                  "bf16 and fp16, double for double");
    static_assert(!std::is_const<typename OV::value_type>::value &&
                      !std::is_const<typename LV::value_type>::value,
                  "BlockAttn: o and lse are outputs and must not be Views of const");
  }
}

/// Validates shapes and spaces of a forward call; returns the extents.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
BlockExtents validate_forward(const char* fn, const QV& q, const KV& k, const VV& v, const OV& o,
                              const LV& lse, double scale, bool empty_seq_ok = false) {
  require_accessible<ExecSpace, typename QV::memory_space>(fn, "q");
  require_accessible<ExecSpace, typename KV::memory_space>(fn, "k");
  require_accessible<ExecSpace, typename VV::memory_space>(fn, "v");
  require_accessible<ExecSpace, typename OV::memory_space>(fn, "o");
  require_accessible<ExecSpace, typename LV::memory_space>(fn, "lse");
  const char* names[4] = {"batch", "seq", "heads", "head_dim"};
  for (int d = 0; d < 4; ++d) {
    if (d == 1 && empty_seq_ok) continue;  // a rank of a distributed call may hold no token
    require_positive_extent(fn, "q", q, d, names[d]);
    require_positive_extent(fn, "k", k, d, names[d]);
  }
  require_extent(fn, "k", k, 0, "batch", q.extent(0), "the batch of q");
  require_extent(fn, "k", k, 3, "head_dim", q.extent(3), "the head_dim of q");
  for (int d = 0; d < 4; ++d)
    require_extent(fn, "v", v, d, names[d], k.extent(d), "the same extent of k");
  for (int d = 0; d < 4; ++d)
    require_extent(fn, "o", o, d, names[d], q.extent(d), "the same extent of q");
  require_extent(fn, "lse", lse, 0, "batch", q.extent(0), "q.extent(0)");
  require_extent(fn, "lse", lse, 1, "heads", q.extent(2), "q.extent(2)");
  require_extent(fn, "lse", lse, 2, "seq", q.extent(1), "q.extent(1)");
  if (q.extent(2) % k.extent(2) != 0)
    fail(fn, "argument 'k' has extent(2) (heads) = ", k.extent(2),
         ", expected a divisor of the heads of q (", q.extent(2), ")");
  if (q.extent(3) > std::size_t(max_head_dim))
    fail(fn, "argument 'q' has extent(3) (head_dim) = ", q.extent(3), ", expected at most ",
         max_head_dim);
  constexpr std::size_t int_max = std::size_t(std::numeric_limits<int>::max());
  if (q.extent(1) > int_max / 2 || k.extent(1) > int_max / 2)
    fail(fn, "sequence length ", q.extent(1) > k.extent(1) ? q.extent(1) : k.extent(1),
         " exceeds the per-call limit of ", int_max / 2, " rows");
  if (!std::isnan(scale) && !(std::isfinite(scale) && scale != 0.0))
    fail(fn, "argument 'scale' is ", scale, ", expected a finite non-zero value");
  using T = compute_t<value_of<OV>>;
  // The kernels multiply by scale * log2(e) in T: it must be a normal number of T.
  const double limit = double(std::numeric_limits<T>::max()) / 1.4426950408889634;
  if (!std::isnan(scale) && (std::abs(scale) > limit || std::abs(scale) * 1.4426950408889634 <
                                                            double(std::numeric_limits<T>::min())))
    fail(fn, "argument 'scale' is ", scale, ", which ", std::abs(scale) > limit ? "over" : "under",
         "flows ", std::is_same<T, float>::value ? "float" : "double",
         " (the compute type) once multiplied by log2(e); expected ",
         double(std::numeric_limits<T>::min()) / 1.4426950408889634, " <= |scale| <= ", limit);
  BlockExtents e;
  e.batch = int(q.extent(0));
  e.queries = int(q.extent(1));
  e.heads = int(q.extent(2));
  e.dim = int(q.extent(3));
  e.keys = int(k.extent(1));
  e.kv_heads = int(k.extent(2));
  return e;
}

/// Global positions are bounded by +-2^62, so that differences of positions
/// (masks compare k - q) never overflow 64-bit index_type.
inline constexpr index_type max_position = index_type(1) << 62;

/// The offsets of ForwardOptions: any sign, |offset| <= max_position.
inline void require_offsets(const char* fn, const ForwardOptions& opts) {
  const index_type off[2] = {opts.q_offset, opts.k_offset};
  const char* names[2] = {"opts.q_offset", "opts.k_offset"};
  for (int i = 0; i < 2; ++i)
    if (off[i] > max_position || off[i] < -max_position)
      fail(fn, "argument '", names[i], "' is ", off[i],
           ", expected |offset| <= 2^62 = ", max_position,
           " (global positions are bounded so that k - q never overflows)");
}

/// The softmax scale: the caller's, or 1 / sqrt(head_dim) when NaN (the default).
template <class T>
T softmax_scale(double requested, int head_dim) {
  return std::isnan(requested) ? T(1) / std::sqrt(T(head_dim)) : T(requested);
}

template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class DOV, class DQV,
          class DKV, class DVV>
BlockExtents validate_backward(const char* fn, const QV& q, const KV& k, const VV& v, const OV& o,
                               const LV& lse, const DOV& dout, const DQV& dq, const DKV& dk,
                               const DVV& dv, double scale, bool empty_seq_ok = false) {
  const BlockExtents e = validate_forward<ExecSpace>(fn, q, k, v, o, lse, scale, empty_seq_ok);
  require_accessible<ExecSpace, typename DOV::memory_space>(fn, "dout");
  require_accessible<ExecSpace, typename DQV::memory_space>(fn, "dq");
  require_accessible<ExecSpace, typename DKV::memory_space>(fn, "dk");
  require_accessible<ExecSpace, typename DVV::memory_space>(fn, "dv");
  const char* names[4] = {"batch", "seq", "heads", "head_dim"};
  for (int d = 0; d < 4; ++d) {
    require_extent(fn, "dout", dout, d, names[d], q.extent(d), "the same extent of q");
    require_extent(fn, "dq", dq, d, names[d], q.extent(d), "the same extent of q");
    require_extent(fn, "dk", dk, d, names[d], k.extent(d), "the same extent of k");
    require_extent(fn, "dv", dv, d, names[d], v.extent(d), "the same extent of v");
  }
  return e;
}

/// dout, dq, dk and dv hold the value type V of q (one message for every entry point).
template <class V, class DOV, class DQV, class DKV, class DVV>
constexpr void check_backward_grad_types() {
  static_assert(std::is_same<typename DQV::non_const_value_type, V>::value &&
                    std::is_same<typename DKV::non_const_value_type, V>::value &&
                    std::is_same<typename DVV::non_const_value_type, V>::value &&
                    std::is_same<typename DOV::non_const_value_type, V>::value,
                "BlockAttn: dout, dq, dk and dv must have the value type of q");
}

template <class... Vs>
constexpr bool backward_grad_views_ok() {
  return (... && (Kokkos::is_view<Vs>::value && Vs::rank == 4));
}

/// The compile-time checks of a backward call (one static_assert per failed
/// requirement, each naming the fix); true when every one holds, so that a
/// caller's `if constexpr` stops at the first diagnostic.
template <class QV, class KV, class VV, class OV, class LV, class DOV, class DQV, class DKV,
          class DVV>
constexpr bool check_backward_view_types() {
  check_forward_view_types<QV, KV, VV, OV, LV>();
  static_assert(backward_grad_views_ok<DOV, DQV, DKV, DVV>(),
                "BlockAttn: dout, dq, dk and dv must be rank-4 Kokkos::Views "
                "(batch, seq, heads, head_dim)");
  if constexpr (forward_views_ok<QV, KV, VV, OV, LV>() &&
                backward_grad_views_ok<DOV, DQV, DKV, DVV>()) {
    using V = typename OV::non_const_value_type;
    check_backward_grad_types<V, DOV, DQV, DKV, DVV>();
    return std::is_same<typename DQV::non_const_value_type, V>::value &&
           std::is_same<typename DKV::non_const_value_type, V>::value &&
           std::is_same<typename DVV::non_const_value_type, V>::value &&
           std::is_same<typename DOV::non_const_value_type, V>::value;
  } else {
    return false;
  }
}

}  // namespace impl

}  // namespace blockattn
