// SPDX-License-Identifier: Apache-2.0
// Host-only tests: every mask's classify() agrees with its allowed() on every
// box of small position ranges (exhaustive), and the policy concept checks.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <limits>
#include <string>
#include <vector>

#include "user_masks.hpp"

using namespace blockattn;

namespace {

/// The truth for a box: empty / full / partial, from allowed() on every pair.
template <class Mask>
TileKind brute_force(const Mask& m, index_type qb, index_type qe, index_type kb, index_type ke) {
  bool any = false, all = true;
  for (index_type q = qb; q < qe; ++q)
    for (index_type k = kb; k < ke; ++k) {
      const bool a = m.allowed(q, k);
      any = any || a;
      all = all && a;
    }
  return !any ? TileKind::empty : (all ? TileKind::full : TileKind::partial);
}

/// classify must be conservative (never claim empty/full wrongly) and, for the
/// built-in masks, exact on contiguous boxes.
template <class Mask>
void check_classify(const Mask& m, bool exact) {
  const index_type lo = -3, hi = 12;
  int checked = 0;
  for (index_type qb = lo; qb < hi; ++qb)
    for (index_type qe = qb + 1; qe <= hi; ++qe)
      for (index_type kb = lo; kb < hi; ++kb)
        for (index_type ke = kb + 1; ke <= hi; ++ke) {
          const TileKind truth = brute_force(m, qb, qe, kb, ke);
          const TileKind got = m.classify(qb, qe, kb, ke);
          if (got != TileKind::partial) CHECK(got == truth);
          if (exact) CHECK(got == truth);
          ++checked;
        }
  CHECK(checked > 10000);
}

}  // namespace

TEST_CASE("library prefix-LM and document masks: classify agrees with allowed") {
  SUBCASE("prefix-LM (exact)") {
    for (index_type prefix : {-5, 0, 1, 4, 11, 20}) check_classify(PrefixLMMask{prefix}, true);
  }
  // Documents of 1, 3, 5 and 3 tokens in [0, 12); positions outside belong to none.
  const Documents<Kokkos::HostSpace> docs(std::vector<index_type>{0, 1, 4, 9, 12});
  SUBCASE("documents, causal") {
    check_classify(docs.mask(), false);
  }
  SUBCASE("documents, bidirectional") {
    check_classify(docs.mask(false), false);
  }
  SUBCASE("documents, causal window of 3") {
    check_classify(docs.mask(true, 2, 0), false);
  }
  SUBCASE("documents, two-sided window") {
    check_classify(docs.mask(false, 1, 2), false);
  }
  SUBCASE("exact where it matters: a box in one document is full or empty as the truth says") {
    const DocumentMask m = docs.mask(false);
    for (index_type qb = 0; qb < 12; ++qb)
      for (index_type qe = qb + 1; qe <= 12; ++qe)
        for (index_type kb = 0; kb < 12; ++kb)
          for (index_type ke = kb + 1; ke <= 12; ++ke) {
            if (m.document(qb) != m.document(qe - 1) || m.document(kb) != m.document(ke - 1))
              continue;
            CHECK(m.classify(qb, qe, kb, ke) == brute_force(m, qb, qe, kb, ke));
          }
  }
  SUBCASE("allowed_keys(q) is exactly the keys allowed(q, .) accepts") {
    // Windows bounded, unbounded and one-sided past the query (negative left:
    // keys at least 1 after q; negative right: at least 1 before).
    const index_type big = std::numeric_limits<index_type>::max();
    const Documents<Kokkos::HostSpace> offset_docs(std::vector<index_type>{3, 4, 8, 15, 16, 40});
    int intervals = 0, nonempty = 0;
    for (const auto* d : {&docs, &offset_docs})
      for (bool causal : {true, false})
        for (index_type left : {big, index_type(0), index_type(2), index_type(-1)})
          for (index_type right : {big, index_type(0), index_type(3), index_type(-2)}) {
            const DocumentMask m = d->mask(causal, left, right);
            for (index_type q = -3; q < 44; ++q) {
              const KeyInterval iv = m.allowed_keys(q);
              for (index_type k = -3; k < 44; ++k)
                CHECK(m.allowed(q, k) == (iv.begin <= k && k < iv.end));
              ++intervals;
              nonempty += iv.begin < iv.end;
            }
          }
    CHECK(intervals == 2 * 2 * 4 * 4 * 47);
    CHECK(nonempty > intervals / 4);
    static_assert(impl::has_allowed_keys<DocumentMask>::value &&
                  !impl::has_allowed_keys<FullMask>::value &&
                  !impl::has_allowed_keys<test::DocumentCausalMask>::value);
  }
  SUBCASE("offsets must increase") {
    std::string msg;
    try {
      Documents<Kokkos::HostSpace> bad(std::vector<index_type>{0, 5, 5, 9});
    } catch (const invalid_argument& e) {
      msg = e.what();
    }
    CHECK(msg.find("offsets[2] = 5 after offsets[1] = 5") != std::string::npos);
  }
  static_assert(is_mask_policy_v<PrefixLMMask> && is_mask_policy_v<DocumentMask>);
}

TEST_CASE("built-in interval masks: allowed_keys(q) is exactly what allowed(q, .) accepts") {
  // Small positions exhaustively, and positions near the +-2^62 bound with
  // windows that are unbounded (INT64_MAX), huge, empty or one-sided.
  constexpr index_type bound = index_type(1) << 62;
  const std::vector<index_type> qs = {-bound + 1, -bound + 7, -5, 0, 3, 17, bound - 9, bound - 1};
  auto check = [&](const auto& m, const std::string& what, bool some_allowed = true) {
    CAPTURE(what);
    int nonempty = 0;
    auto one = [&](index_type q, index_type k) {
      const KeyInterval iv = m.allowed_keys(q);
      CAPTURE(q);
      CAPTURE(k);
      CHECK(m.allowed(q, k) == (iv.begin <= k && k < iv.end));
      nonempty += iv.begin <= k && k < iv.end;
    };
    for (index_type q = -6; q < 20; ++q)
      for (index_type k = -6; k < 20; ++k) one(q, k);
    for (index_type q : qs)
      for (index_type dk = -8; dk <= 8; ++dk) {
        if (q + dk <= -bound || q + dk >= bound) continue;
        one(q, q + dk);
        for (index_type k : qs) one(q, k);
      }
    CHECK((nonempty > 0) == some_allowed);
  };
  static_assert(impl::has_allowed_keys<CausalMask>::value &&
                impl::has_allowed_keys<PrefixLMMask>::value &&
                impl::has_allowed_keys<SlidingWindowMask>::value);
  check(CausalMask{}, "causal");
  for (index_type prefix : {-bound + 2, index_type(-5), index_type(0), index_type(4), bound - 3})
    check(PrefixLMMask{prefix}, "prefix-LM");
  const index_type max = std::numeric_limits<index_type>::max();
  for (index_type left : {max, bound, index_type(0), index_type(3), index_type(-2)})
    for (index_type right : {max, bound, index_type(0), index_type(5), index_type(-1)})
      check(SlidingWindowMask{left, right}, "sliding window", left >= -right);
}

TEST_CASE("allowed_columns: the columns of a key tile a query row sees, per position map") {
  // Brute force: every column whose position allowed() accepts; the kernels
  // rely on this being one range [lo, hi).
  auto check = [](const auto& mask, const auto& kpos, int k0, int n) {
    for (index_type q = -4; q < 60; ++q) {
      const impl::ColumnRange cols = impl::allowed_columns(mask, q, kpos, k0, n);
      CAPTURE(q);
      REQUIRE(0 <= cols.lo);
      REQUIRE(cols.lo <= cols.hi);
      REQUIRE(cols.hi <= n);
      for (int c = 0; c < n; ++c)
        CHECK(mask.allowed(q, kpos(k0 + c)) == (cols.lo <= c && c < cols.hi));
    }
  };
  const Documents<Kokkos::HostSpace> docs(std::vector<index_type>{0, 5, 6, 20, 41, 56});
  const std::vector<index_type> table = {1, 2, 4, 7, 8, 13, 21, 22, 23, 30, 34, 40, 47, 51, 55};
  const TablePositions tp{table.data(), table.data()};
  for (int n : {0, 1, 5, 11}) {
    CAPTURE(n);
    for (int k0 : {0, 3}) {
      check(CausalMask{}, OffsetPositions{k0 == 0 ? 0 : 17}, k0, n);
      check(SlidingWindowMask{4, 2}, OffsetPositions{5}, k0, n);
      check(PrefixLMMask{9}, StridedPositions{2, 3}, k0, n);
      check(causal_window(6), StridedPositions{-3, 5}, k0, n);
      check(docs.mask(), StridedPositions{1, 4}, k0, n);
      check(docs.mask(false, 3, 1), tp, k0, n);
      check(CausalMask{}, tp, k0, n);
      // The kernels' form of the built-in maps (canonical_positions): one
      // piece, and two pieces as zigzag's (the second starting later, with a gap).
      check(CausalMask{}, canonical_positions(OffsetPositions{k0 == 0 ? 0 : 17}), k0, n);
      check(causal_window(6), canonical_positions(StridedPositions{-3, 5}), k0, n);
      check(SlidingWindowMask{4, 2}, canonical_positions(ZigzagPositions{4, 2, 30}), k0, n);
      check(docs.mask(), canonical_positions(ZigzagPositions{7, 0, 41}), k0, n);
      check(PrefixLMMask{9}, AffinePositions{3, -2, 20, 3}, k0, n);
    }
  }
}

TEST_CASE("canonical_positions: the built-in maps as AffinePositions, value for value") {
  for (index_type i = 0; i < 50; ++i) {
    CAPTURE(i);
    CHECK(canonical_positions(OffsetPositions{-7})(i) == OffsetPositions{-7}(i));
    CHECK(canonical_positions(StridedPositions{3, 4})(i) == StridedPositions{3, 4}(i));
    const ZigzagPositions z = ZigzagPartition::positions(103, 4, 1);
    CHECK(canonical_positions(z)(i) == z(i));
  }
  // Maps of other types pass through unchanged.
  const std::vector<index_type> table = {1, 2, 4};
  const TablePositions tp{table.data(), table.data()};
  CHECK(canonical_positions(tp).host == tp.host);
}

TEST_CASE("mask classify agrees with allowed on every small box") {
  SUBCASE("full") {
    check_classify(FullMask{}, true);
  }
  SUBCASE("causal") {
    check_classify(CausalMask{}, true);
  }
  SUBCASE("sliding window, symmetric") {
    check_classify(SlidingWindowMask{2, 2}, true);
  }
  SUBCASE("sliding window, left only") {
    check_classify(SlidingWindowMask{3, 0}, true);
  }
  SUBCASE("sliding window, shifted band") {
    check_classify(SlidingWindowMask{-1, 4}, true);
  }
  SUBCASE("causal_window") {
    check_classify(causal_window(4), true);
  }
  SUBCASE("user prefix-LM (conservative)") {
    check_classify(PrefixLMMask{5}, false);
  }
}

TEST_CASE("causal is a sliding window with unbounded left side") {
  const SlidingWindowMask w{index_type(1) << 40, 0};
  for (index_type q = 0; q < 20; ++q)
    for (index_type k = 0; k < 20; ++k) CHECK(w.allowed(q, k) == CausalMask{}.allowed(q, k));
}

namespace {
struct NoClassify {
  bool allowed(index_type, index_type) const { return true; }
};
struct WrongReturn {
  int classify(index_type, index_type, index_type, index_type) const { return 0; }
  bool allowed(index_type, index_type) const { return true; }
};
}  // namespace

TEST_CASE("mask policy concept") {
  static_assert(is_mask_policy_v<FullMask>);
  static_assert(is_mask_policy_v<CausalMask>);
  static_assert(is_mask_policy_v<SlidingWindowMask>);
  static_assert(is_mask_policy_v<PrefixLMMask>);
  static_assert(!is_mask_policy_v<NoClassify>);
  static_assert(!is_mask_policy_v<WrongReturn>);
  static_assert(!is_mask_policy_v<int>);
  CHECK(is_mask_policy_v<CausalMask>);
  CHECK_FALSE(is_mask_policy_v<NoClassify>);
}
