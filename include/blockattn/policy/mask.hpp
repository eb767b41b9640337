// SPDX-License-Identifier: Apache-2.0
// Mask policies on *global* token positions.
//
// A mask policy is a small, trivially copyable struct with two members:
//
//   KOKKOS_FUNCTION TileKind classify(index_type q_begin, index_type q_end,
//                                     index_type k_begin, index_type k_end) const;
//   KOKKOS_FUNCTION bool allowed(index_type q, index_type k) const;
//
// classify() receives half-open ranges that *bound* the global positions of
// the queries and keys of one tile (a partition may leave gaps inside them) and
// must be conservative: answer `empty` only if no pair in the box is allowed,
// `full` only if every pair is. When unsure, answer `partial`: the kernel then
// calls allowed() for every pair of the tile. Empty tiles are never loaded.
//
// Optional: when the keys every query sees form one interval of global
// positions, say so with
//
//   KOKKOS_FUNCTION KeyInterval allowed_keys(index_type q) const;
//
// returning [begin, end) such that allowed(q, k) == (begin <= k && k < end)
// for every k (begin >= end: q sees nothing). The kernels then call it once
// per query row of a partial tile, find the row's columns [lo, hi) from the
// key positions (kernel/impl/mask_columns.hpp), mask the rest with straight
// fills and compute softmax terms only in between, instead of calling
// allowed() for every pair (which stays scalar; DocumentMask: two binary
// searches per pair). The causal, sliding-window, prefix-LM and document
// masks have one.
//
// Optional: when, inside a box of positions, the mask is a band of diagonals,
// say so with a host member
//
//   MaskBand band(index_type q_begin, index_type q_end,
//                 index_type k_begin, index_type k_end) const;
//
// returning MaskBand::of(lo, hi) when allowed(q, k) == (lo <= k - q && k - q
// <= hi) for every q in [q_begin, q_end) and k in [k_begin, k_end) (lo / hi
// may be INT64_MIN / INT64_MAX: unbounded), and MaskBand::none() when it is
// not. Boxes that classify() calls empty or full need no answer. A block pair
// whose mask is a band over its positions can run on a vendor's fused
// attention (kernel/band.hpp maps it; cuDNN on CUDA); every other pair runs
// on our kernels. The full, causal, sliding-window, prefix-LM and document
// masks have one.
//
// Optional: a host member `parameters()` returning a std::array (or any range)
// of numbers. The distributed entry points compare the mask's type on every
// rank, and with parameters() also its values (e.g. a window of 32 on one
// rank and 64 on another is an error on every rank, not a wrong result).
#pragma once

#include <blockattn/core/config.hpp>

#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace blockattn {

enum class TileKind : int { empty = 0, partial = 1, full = 2 };

namespace impl {
/// a + b, clamped to the range of index_type.
KOKKOS_INLINE_FUNCTION constexpr index_type saturating_add(index_type a, index_type b) {
  return b > 0 && a > INT64_MAX - b ? INT64_MAX : b < 0 && a < INT64_MIN - b ? INT64_MIN : a + b;
}
}  // namespace impl

/// The global key positions one query sees, [begin, end) (see allowed_keys above).
struct KeyInterval {
  index_type begin = 0;
  index_type end = 0;
};

/// What band() answers: whether the mask is a band of diagonals k - q in
/// [lo, hi] over a box of positions (see the top of this file).
struct MaskBand {
  bool is_band = false;
  index_type lo = INT64_MIN;  // INT64_MIN: no lower bound
  index_type hi = INT64_MAX;  // INT64_MAX: no upper bound
  static constexpr MaskBand of(index_type lo, index_type hi) { return MaskBand{true, lo, hi}; }
  static constexpr MaskBand none() { return MaskBand{}; }
};

/// No masking: every query sees every key.
struct FullMask {
  KOKKOS_INLINE_FUNCTION constexpr TileKind classify(index_type, index_type, index_type,
                                                     index_type) const {
    return TileKind::full;
  }
  KOKKOS_INLINE_FUNCTION constexpr bool allowed(index_type, index_type) const { return true; }
  constexpr MaskBand band(index_type, index_type, index_type, index_type) const {
    return MaskBand::of(INT64_MIN, INT64_MAX);
  }
};

/// Query q sees keys k with q - left <= k <= q + right (global positions).
/// `left` / `right` may be very large to mean "unbounded".
struct SlidingWindowMask {
  index_type left = 0;
  index_type right = 0;

  KOKKOS_INLINE_FUNCTION constexpr bool allowed(index_type q, index_type k) const {
    const index_type d = k - q;  // positions are bounded by 2^62: no overflow
    return d >= -left && d <= right;
  }
  /// [q - left, q + right + 1), saturated: `left` / `right` may be huge.
  KOKKOS_INLINE_FUNCTION constexpr KeyInterval allowed_keys(index_type q) const {
    const index_type last = impl::saturating_add(q, right);
    return KeyInterval{impl::saturating_add(q, left == INT64_MIN ? INT64_MAX : -left),
                       last == INT64_MAX ? INT64_MAX : last + 1};
  }
  KOKKOS_INLINE_FUNCTION constexpr TileKind classify(index_type q_begin, index_type q_end,
                                                     index_type k_begin, index_type k_end) const {
    const index_type q_last = q_end - 1, k_last = k_end - 1;
    // The allowed band is k - q in [-left, right].
    const index_type lo = k_begin - q_last;  // smallest k - q in the box
    const index_type hi = k_last - q_begin;  // largest k - q in the box
    if (hi < -left || lo > right) return TileKind::empty;
    if (lo >= -left && hi <= right) return TileKind::full;
    return TileKind::partial;
  }
  /// k - q in [-left, right] everywhere.
  constexpr MaskBand band(index_type, index_type, index_type, index_type) const {
    return MaskBand::of(left == INT64_MIN ? INT64_MAX : -left, right);
  }
  /// Compared across ranks by the distributed entry points (see below).
  std::array<index_type, 2> parameters() const { return {{left, right}}; }
};

/// Causal (autoregressive): query q sees keys k <= q.
struct CausalMask {
  KOKKOS_INLINE_FUNCTION constexpr bool allowed(index_type q, index_type k) const { return k <= q; }
  /// The keys q sees: every position up to q (see allowed_keys above).
  KOKKOS_INLINE_FUNCTION constexpr KeyInterval allowed_keys(index_type q) const {
    return KeyInterval{INT64_MIN, q + 1};  // positions are bounded by 2^62: no overflow
  }
  KOKKOS_INLINE_FUNCTION constexpr TileKind classify(index_type q_begin, index_type q_end,
                                                     index_type k_begin, index_type k_end) const {
    if (k_begin > q_end - 1) return TileKind::empty;
    if (k_end - 1 <= q_begin) return TileKind::full;
    return TileKind::partial;
  }
  /// k - q <= 0 everywhere.
  constexpr MaskBand band(index_type, index_type, index_type, index_type) const {
    return MaskBand::of(INT64_MIN, 0);
  }
};

/// Prefix-LM (T5 / UniLM style): the keys before `prefix` are seen by every
/// query (a bidirectional prefix), causal after it. classify() is exact.
struct PrefixLMMask {
  index_type prefix = 0;

  KOKKOS_INLINE_FUNCTION constexpr bool allowed(index_type q, index_type k) const {
    return k < prefix || k <= q;
  }
  /// k < prefix or k <= q: the keys before max(prefix, q + 1).
  KOKKOS_INLINE_FUNCTION constexpr KeyInterval allowed_keys(index_type q) const {
    return KeyInterval{INT64_MIN, prefix > q + 1 ? prefix : q + 1};
  }
  KOKKOS_INLINE_FUNCTION constexpr TileKind classify(index_type q_begin, index_type q_end,
                                                     index_type k_begin, index_type k_end) const {
    // Some pair is allowed iff k_begin < prefix or k_begin <= the last query;
    // every pair iff no key reaches max(prefix, q_begin + 1).
    if (k_begin >= prefix && k_begin > q_end - 1) return TileKind::empty;
    const index_type first_unseen = prefix > q_begin + 1 ? prefix : q_begin + 1;
    if (k_end - 1 < first_unseen) return TileKind::full;
    return TileKind::partial;
  }
  /// Causal over keys at or after the prefix; boxes that straddle it are
  /// not a band (unless classify() calls them full).
  constexpr MaskBand band(index_type, index_type, index_type k_begin, index_type) const {
    return k_begin >= prefix ? MaskBand::of(INT64_MIN, 0) : MaskBand::none();
  }
  std::array<index_type, 1> parameters() const { return {{prefix}}; }
};

/// A sliding window of `window` keys ending at the query (causal local attention).
KOKKOS_INLINE_FUNCTION constexpr SlidingWindowMask causal_window(index_type window) {
  return SlidingWindowMask{window - 1, 0};
}

namespace impl {

template <class M, class = void>
struct has_classify : std::false_type {};
template <class M>
struct has_classify<M, std::void_t<decltype(std::declval<const M&>().classify(
                           index_type{}, index_type{}, index_type{}, index_type{}))>>
    : std::is_same<decltype(std::declval<const M&>().classify(index_type{}, index_type{},
                                                              index_type{}, index_type{})),
                   TileKind> {};

template <class M, class = void>
struct has_allowed : std::false_type {};
template <class M>
struct has_allowed<
    M, std::void_t<decltype(std::declval<const M&>().allowed(index_type{}, index_type{}))>>
    : std::is_convertible<decltype(std::declval<const M&>().allowed(index_type{}, index_type{})),
                          bool> {};

template <class M, class = void>
struct has_allowed_keys : std::false_type {};
template <class M>
struct has_allowed_keys<M,
                        std::void_t<decltype(std::declval<const M&>().allowed_keys(index_type{}))>>
    : std::is_same<decltype(std::declval<const M&>().allowed_keys(index_type{})), KeyInterval> {};

template <class M, class = void>
struct has_band : std::false_type {};
template <class M>
struct has_band<M, std::void_t<decltype(std::declval<const M&>().band(index_type{}, index_type{},
                                                                      index_type{}, index_type{}))>>
    : std::is_same<decltype(std::declval<const M&>().band(index_type{}, index_type{}, index_type{},
                                                          index_type{})),
                   MaskBand> {};

/// The mask of one query row, as the kernels apply it to a partial tile:
/// allowed(q, k) per key, or, for masks with allowed_keys(), two comparisons
/// against the row's interval (computed once). `check` false: every key kept.
template <class M, bool = has_allowed_keys<M>::value>
struct RowMask {
  M mask;
  index_type q;
  bool check;
  KOKKOS_INLINE_FUNCTION RowMask(const M& m, index_type q_, bool check_)
      : mask(m), q(q_), check(check_) {}
  KOKKOS_INLINE_FUNCTION bool operator()(index_type k) const {
    return !check || mask.allowed(q, k);
  }
};
template <class M>
struct RowMask<M, true> {
  index_type begin, end;
  KOKKOS_INLINE_FUNCTION RowMask(const M& m, index_type q, bool check) {
    if (check) {
      const KeyInterval iv = m.allowed_keys(q);
      begin = iv.begin;
      end = iv.end;
    } else {
      begin = INT64_MIN;  // index_type is std::int64_t; macros are usable in device code
      end = INT64_MAX;
    }
  }
  KOKKOS_INLINE_FUNCTION bool operator()(index_type k) const { return begin <= k && k < end; }
};

}  // namespace impl

/// True when M models the mask-policy concept described at the top of this file.
template <class M>
inline constexpr bool is_mask_policy_v = impl::has_classify<M>::value&&
    impl::has_allowed<M>::value&& std::is_trivially_copyable<M>::value;

namespace impl {
/// One readable static_assert per requirement; called by every entry point.
template <class M>
constexpr void check_mask_policy() {
  static_assert(has_classify<M>::value,
                "BlockAttn: the mask policy must have a const member "
                "`TileKind classify(index_type q_begin, index_type q_end, index_type k_begin, "
                "index_type k_end) const` (see blockattn/policy/mask.hpp)");
  static_assert(has_allowed<M>::value,
                "BlockAttn: the mask policy must have a const member "
                "`bool allowed(index_type q, index_type k) const` (see blockattn/policy/mask.hpp)");
  static_assert(std::is_trivially_copyable<M>::value,
                "BlockAttn: the mask policy must be trivially copyable, because it is "
                "copied into device kernels; hold Kokkos::Views, not std:: containers");
}
}  // namespace impl

}  // namespace blockattn
