// SPDX-License-Identifier: Apache-2.0
// The mask contract, checked on demand: classify() must be conservative
// (`empty` only if no pair of the box is allowed, `full` only if every pair
// is), and allowed_keys(q), where the mask has it, must agree with allowed(). A classify that
// breaks it silently skips or unmasks pairs, so the entry points can check it on a sample of boxes
// before any work, in a kernel on the caller's execution space (masks may hold device Views):
//   - always, when compiled with -DBLOCKATTN_CHECK_POLICIES;
//   - per call, with ForwardOptions::check_policies / DistributedOptions::check_policies.
// Off by default: the sample costs about samples x box^2 allowed() calls.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/policy/mask.hpp>

#include <cstdint>

namespace blockattn::impl {

#ifdef BLOCKATTN_CHECK_POLICIES
inline constexpr bool check_policies_always = true;
#else
inline constexpr bool check_policies_always = false;
#endif

/// One sampled box and what went wrong with it (kind 0: none).
struct MaskViolation {
  int kind = 0;  // 1: classify said empty but (q, k) is allowed; 2: full but (q, k) is not;
                 // 3: allowed(q, k) disagrees with allowed_keys(q) = [k_begin, k_end)
  index_type q_begin = 0, q_end = 0, k_begin = 0, k_end = 0, q = 0, k = 0;
};

/// Box `s` of the sample over queries [q_lo, q_hi) x keys [k_lo, k_hi): sizes
/// from 1 to 32 and positions from a 64-bit hash of s (SplitMix64), so every
/// rank and backend draws the same boxes.
KOKKOS_INLINE_FUNCTION std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

template <class Mask>
struct MaskCheckFunctor {
  Mask mask;
  index_type q_lo, q_hi, k_lo, k_hi;
  using value_type = MaskViolation;

  KOKKOS_INLINE_FUNCTION void init(value_type& v) const { v = MaskViolation{}; }
  KOKKOS_INLINE_FUNCTION void join(value_type& a, const value_type& b) const {
    if (a.kind == 0) a = b;
  }
  // Kokkos 3.x also calls join on volatile values.
  KOKKOS_INLINE_FUNCTION void join(volatile value_type& a, const volatile value_type& b) const {
    if (a.kind == 0) {
      a.kind = b.kind;
      a.q_begin = b.q_begin;
      a.q_end = b.q_end;
      a.k_begin = b.k_begin;
      a.k_end = b.k_end;
      a.q = b.q;
      a.k = b.k;
    }
  }

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t s, value_type& v) const {
    if (v.kind != 0) return;
    const std::uint64_t h1 = splitmix(std::uint64_t(s) * 2 + 1), h2 = splitmix(h1);
    const index_type nq = q_hi - q_lo, nk = k_hi - k_lo;
    const index_type sq = 1 + index_type(h1 % 32u), sk = 1 + index_type((h1 >> 8) % 32u);
    const index_type bq = sq < nq ? sq : nq, bk = sk < nk ? sk : nk;
    const index_type q0 = q_lo + index_type((h2 % std::uint64_t(nq - bq + 1)));
    const index_type k0 = k_lo + index_type(((h2 >> 20) % std::uint64_t(nk - bk + 1)));
    if constexpr (has_allowed_keys<Mask>::value) {
      for (index_type q = q0; q < q0 + bq; ++q) {
        const KeyInterval iv = mask.allowed_keys(q);
        for (index_type k = k0; k < k0 + bk; ++k)
          if (mask.allowed(q, k) != (iv.begin <= k && k < iv.end)) {
            v.kind = 3;
            v.q = q;
            v.k = k;
            v.k_begin = iv.begin;
            v.k_end = iv.end;
            return;
          }
      }
    }
    const TileKind kind = mask.classify(q0, q0 + bq, k0, k0 + bk);
    if (kind == TileKind::partial) return;
    for (index_type q = q0; q < q0 + bq; ++q)
      for (index_type k = k0; k < k0 + bk; ++k) {
        const bool a = mask.allowed(q, k);
        if ((kind == TileKind::empty && a) || (kind == TileKind::full && !a)) {
          v.kind = kind == TileKind::empty ? 1 : 2;
          v.q_begin = q0;
          v.q_end = q0 + bq;
          v.k_begin = k0;
          v.k_end = k0 + bk;
          v.q = q;
          v.k = k;
          return;
        }
      }
  }
};

/// Checks `samples` boxes of the mask over queries [q_lo, q_hi) x keys
/// [k_lo, k_hi) on `exec`; throws naming the first box that breaks the
/// contract. Blocking (one reduction to the host).
template <class ExecSpace, class Mask>
void check_mask_contract(const char* fn, const ExecSpace& exec, const Mask& mask, index_type q_lo,
                         index_type q_hi, index_type k_lo, index_type k_hi, int samples = 4096) {
  if (q_hi <= q_lo || k_hi <= k_lo) return;
  MaskViolation v;
  Kokkos::parallel_reduce(
      "blockattn::check_mask_contract",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, samples),
      MaskCheckFunctor<Mask>{mask, q_lo, q_hi, k_lo, k_hi}, v);
  if (v.kind == 3)
    fail(fn, "argument 'mask' breaks the mask contract: allowed_keys(", v.q, ") = [", v.k_begin,
         ", ", v.k_end, ") but allowed(", v.q, ", ", v.k,
         ") = ", (v.k_begin <= v.k && v.k < v.k_end) ? "false" : "true",
         "; expected allowed(q, k) to hold exactly for the keys of allowed_keys(q) (see "
         "blockattn/policy/mask.hpp)");
  if (v.kind != 0)
    fail(fn, "argument 'mask' breaks the mask contract: classify(", v.q_begin, ", ", v.q_end, ", ",
         v.k_begin, ", ", v.k_end, ") = ", v.kind == 1 ? "empty" : "full", " but allowed(", v.q,
         ", ", v.k, ") = ", v.kind == 1 ? "true" : "false",
         "; expected classify() to answer `empty` only when no pair of the box is allowed and "
         "`full` only when every pair is (say `partial` when unsure; see "
         "blockattn/policy/mask.hpp)");
}

}  // namespace blockattn::impl
