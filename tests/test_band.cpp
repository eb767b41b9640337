// SPDX-License-Identifier: Apache-2.0
// Host-only tests of the band mapping (kernel/band.hpp), by brute force: for
// every built-in mask and partition, at several P, N and offsets, every block
// pair's band pieces hold each allowed (row, key) exactly once and nothing
// else, every row and key of a piece is used, and cuDNN's form of a piece
// (a model of its top-left diagonal band) allows the same pairs.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/kernel/band.hpp>

#include <cstdint>
#include <random>
#include <vector>

#include "user_masks.hpp"

using namespace blockattn;

namespace {

struct Tally {
  long pairs = 0, expressible = 0, pieces = 0, cudnn = 0, cells = 0;
};

/// cuDNN's SDPA mask (top-left alignment) as documented for its frontend:
/// key j is seen by row i iff j <= i + right_bound and j > i - left_bound.
bool cudnn_allows(const CudnnBand& c, index_type i, index_type j) {
  return (!c.has_right || j <= i + c.right_bound) && (!c.has_left || j > i - c.left_bound);
}

template <class Mask, class QPos, class KPos>
void check_pair(const Mask& mask, const QPos& qpos, index_type nq, const KPos& kpos, index_type nk,
                bool must_express, Tally& t) {
  const BandSplit s = band_split(mask, qpos, nq, kpos, nk);
  ++t.pairs;
  if (must_express) REQUIRE(s.expressible);
  if (!s.expressible) {
    CHECK(s.count == 0);
    return;
  }
  ++t.expressible;
  std::vector<int> cover(std::size_t(nq * nk), 0);
  for (const BandPiece& p : s) {
    ++t.pieces;
    REQUIRE(0 <= p.row_begin);
    REQUIRE(p.row_begin < p.row_end);
    REQUIRE(p.row_end <= nq);
    REQUIRE(0 <= p.col_begin);
    REQUIRE(p.col_begin < p.col_end);
    REQUIRE(p.col_end <= nk);
    CHECK(p.lo <= 0);
    CHECK(p.hi >= 0);
    CHECK(p.lo >= -(p.rows() - 1));
    CHECK(p.hi <= p.cols() - 1);
    CHECK(p.rows() - 1 + p.lo <= p.cols() - 1);  // the last row sees a key
    CHECK(p.cols() - 1 - p.hi <= p.rows() - 1);  // the last key is seen
    const CudnnBand c = cudnn_band(p);
    if (c.supported) {
      ++t.cudnn;
      CHECK((!c.has_right || c.right_bound >= 0));
      CHECK((!c.has_left || (c.left_bound >= 1 && p.rows() <= p.cols())));
    }
    for (index_type i = p.row_begin; i < p.row_end; ++i)
      for (index_type j = p.col_begin; j < p.col_end; ++j) {
        const bool a = p.allowed(i, j);
        if (c.supported) REQUIRE(cudnn_allows(c, i - p.row_begin, j - p.col_begin) == a);
        if (a) ++cover[std::size_t(i * nk + j)];
      }
  }
  for (index_type i = 0; i < nq; ++i)
    for (index_type j = 0; j < nk; ++j) {
      ++t.cells;
      const int want = mask.allowed(qpos(i), kpos(j)) ? 1 : 0;
      if (cover[std::size_t(i * nk + j)] != want) {
        INFO("row " << i << " at " << qpos(i) << ", key " << j << " at " << kpos(j));
        REQUIRE(cover[std::size_t(i * nk + j)] == want);
      }
    }
}

/// Every (query rank, key rank) pair of a partition of N over P.
template <class Mask, class Partition>
void check_partition(const Mask& mask, const Partition& part, index_type N, int P,
                     bool must_express, Tally& t) {
  for (int rq = 0; rq < P; ++rq)
    for (int rk = 0; rk < P; ++rk) {
      INFO(Partition::name() << " N " << N << " P " << P << " pair (" << rq << ", " << rk << ")");
      check_pair(mask, part.positions(N, P, rq), local_length(part, N, P, rq),
                 part.positions(N, P, rk), local_length(part, N, P, rk), must_express, t);
    }
}

TablePartition<Kokkos::HostSpace> random_table(index_type N, int P, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<index_type>> ranks(std::size_t(P), std::vector<index_type>{});
  for (index_type t = 0; t < N; ++t)
    ranks[std::size_t(std::uniform_int_distribution<int>(0, P - 1)(rng))].push_back(t);
  return TablePartition<Kokkos::HostSpace>(ranks);
}

/// The mask on every partition and on single-device offsets. `banded`: the
/// mask is a band wherever its positions are affine (the affine partitions
/// must then always be expressible).
template <class Mask>
Tally check_mask(const Mask& mask, bool banded) {
  Tally t;
  for (index_type N : {1, 7, 37, 64})
    for (int P : {1, 2, 3, 4, 8}) {
      check_partition(mask, ContiguousPartition{}, N, P, banded, t);
      check_partition(mask, StripedPartition{}, N, P, banded, t);
      check_partition(mask, ZigzagPartition{}, N, P, banded, t);
      if (N >= P) check_partition(mask, random_table(N, P, unsigned(N * 31 + P)), N, P, false, t);
    }
  // One device: queries at q_offset + i, keys at k_offset + j.
  for (index_type qo : {-20, -3, 0, 5, 30})
    for (index_type ko : {-7, 0, 11})
      for (index_type nq : {1, 9, 40})
        for (index_type nk : {1, 13, 40}) {
          INFO("offsets " << qo << ", " << ko << " rows " << nq << " keys " << nk);
          check_pair(mask, OffsetPositions{qo}, nq, OffsetPositions{ko}, nk, banded, t);
        }
  // Strided pieces that do not start at the same phase (k - q not a multiple of the stride).
  for (index_type qo : {0, 1, 2})
    for (index_type ko : {0, 1, 2}) {
      INFO("strided offsets " << qo << ", " << ko);
      check_pair(mask, StridedPositions{qo, 3}, 17, StridedPositions{ko, 3}, 15, banded, t);
    }
  return t;
}

}  // namespace

TEST_SUITE("band") {
  TEST_CASE("band pieces of the band masks on every partition") {
    const std::vector<SlidingWindowMask> windows = {causal_window(1),
                                                    causal_window(3),
                                                    causal_window(17),
                                                    SlidingWindowMask{5, 2},
                                                    SlidingWindowMask{0, 0},
                                                    SlidingWindowMask{2, -1},
                                                    SlidingWindowMask{-2, 5},
                                                    SlidingWindowMask{40, 40},
                                                    SlidingWindowMask{INT64_MAX, INT64_MAX},
                                                    SlidingWindowMask{INT64_MAX, 0}};
    for (const auto& m : windows) {
      INFO("window " << m.left << " " << m.right);
      // (check_mask requires every pair of an affine partition to be expressible.)
      const Tally t = check_mask(m, true);
      CHECK(t.pieces > 0);
    }
    const Tally causal = check_mask(CausalMask{}, true);
    const Tally full = check_mask(FullMask{}, true);
    CHECK(full.expressible == full.pairs);  // full is a band on any positions, tables included
    CHECK(full.cudnn == full.pieces);
    MESSAGE("causal: " << causal.pairs << " pairs, " << causal.pieces << " pieces, " << causal.cudnn
                       << " in cuDNN's form");
  }

  TEST_CASE("band pieces of the prefix-LM and document masks") {
    for (index_type prefix : {0, 7, 20, 64}) {
      INFO("prefix " << prefix);
      const Tally t = check_mask(PrefixLMMask{prefix}, false);
      CHECK(t.expressible > 0);
    }
    Documents<Kokkos::HostSpace> docs(std::vector<index_type>{0, 5, 20, 21, 50, 64});
    for (bool causal : {true, false}) {
      INFO("documents, causal " << causal);
      const Tally a = check_mask(docs.mask(causal), false);
      const Tally b = check_mask(docs.mask(causal, 3, causal ? 0 : 2), false);
      CHECK(a.expressible > 0);
      CHECK(b.expressible > 0);
    }
    // Inside one document the mask is the document's band.
    Documents<Kokkos::HostSpace> one(std::vector<index_type>{0, 64});
    const Tally t = check_mask(one.mask(true), false);
    Tally c;
    for (int P : {1, 2, 4}) check_partition(one.mask(true), ZigzagPartition{}, 64, P, true, c);
    CHECK(t.expressible > 0);
  }

  TEST_CASE("a mask without band() is expressible only where classify() is exact") {
    const test::DocumentCausalMask m{8};
    Tally t;
    for (int P : {1, 2, 4}) check_partition(m, ContiguousPartition{}, 64, P, false, t);
    CHECK(t.expressible > 0);
    CHECK(t.expressible < t.pairs);
    // A pair the mask cuts partially is never expressible.
    const BandSplit s = band_split(m, OffsetPositions{0}, 16, OffsetPositions{0}, 16);
    CHECK_FALSE(s.expressible);
  }

  TEST_CASE("cuDNN's form of a band piece") {
    // Causal on a square pair: right bound 0, no left bound.
    const BandSplit causal = band_split(CausalMask{}, OffsetPositions{0}, 8, OffsetPositions{0}, 8);
    REQUIRE(causal.count == 1);
    const CudnnBand c = cudnn_band(causal.pieces[0]);
    CHECK(c.supported);
    CHECK(c.has_right);
    CHECK(c.right_bound == 0);
    CHECK_FALSE(c.has_left);
    // Keys before the queries (a ring's earlier block): full, no mask.
    const BandSplit before = band_split(CausalMask{}, OffsetPositions{8}, 8, OffsetPositions{0}, 8);
    REQUIRE(before.count == 1);
    CHECK(before.pieces[0].full());
    // Queries behind the keys' start (negative offset): the first rows see
    // nothing and are cut off; the rest is causal.
    const BandSplit behind = band_split(CausalMask{}, OffsetPositions{0}, 8, OffsetPositions{3}, 8);
    REQUIRE(behind.count == 1);
    CHECK(behind.pieces[0].row_begin == 3);
    CHECK(behind.pieces[0].hi == 0);
    // A striped pair: causal becomes a diagonal offset of 0 or -1.
    const BandSplit striped =
        band_split(CausalMask{}, StridedPositions{0, 4}, 8, StridedPositions{2, 4}, 8);
    REQUIRE(striped.count == 1);
    CHECK(striped.pieces[0].row_begin == 1);  // query 0 (position 0) sees no key (2, 6, ...)
    // A window wider than the keys: the left bound needs no more rows than keys.
    const BandSplit tall =
        band_split(causal_window(4), OffsetPositions{0}, 40, OffsetPositions{0}, 13);
    REQUIRE(tall.count == 1);
    CHECK(tall.pieces[0].rows() == 16);  // rows 16.. see no key below 13
    CHECK_FALSE(cudnn_band(tall.pieces[0]).supported);
  }
}
