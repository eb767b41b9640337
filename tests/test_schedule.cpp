// SPDX-License-Identifier: Apache-2.0
// Host-only: partitions (maps, inverses, permutations) and the ring's work
// model against the properties the papers state, for P = 2..8.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <set>

using namespace blockattn;

namespace {

template <class Partition>
void check_partition(index_type N, int P) {
  std::set<index_type> seen;
  for (int r = 0; r < P; ++r) {
    const auto map = Partition::positions(N, P, r);
    for (index_type i = 0; i < N / P; ++i) {
      const index_type g = map(i);
      CHECK(g >= 0);
      CHECK(g < N);
      if (i > 0) CHECK(map(i - 1) < g);  // strictly increasing
      const Owner o = Partition::owner(N, P, g);
      CHECK(o.rank == r);
      CHECK(o.local == i);
      seen.insert(g);
    }
  }
  CHECK(index_type(seen.size()) == N);  // a permutation of 0..N-1
}

}  // namespace

TEST_CASE("partitions are permutations with inverse and increasing local order") {
  for (int P = 1; P <= 8; ++P) {
    check_partition<ContiguousPartition>(24 * P, P);
    check_partition<StripedPartition>(24 * P, P);
    check_partition<ZigzagPartition>(24 * P, P);
  }
  // Striped: token t on rank t mod P (Striped Attention (arXiv:2311.09431) Figure 1).
  CHECK(StripedPartition::positions(16, 4, 1)(2) == 9);
  // Zigzag: rank r holds chunks r and 2P - 1 - r.
  CHECK(ZigzagPartition::positions(16, 4, 0)(2) == 14);
}

TEST_CASE("N must be a multiple of what the partition needs") {
  CHECK_NOTHROW(require_partitionable<ZigzagPartition>("t", 24, 3));
  try {
    require_partitionable<ZigzagPartition>("t", 21, 3);
    FAIL("no exception");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("N must be a positive multiple of 6") != std::string::npos);
  }
  CHECK_THROWS_AS(require_partitionable<StripedPartition>("t", 10, 4), invalid_argument);
}

TEST_CASE(
    "contiguous causal ring: from step 1 some ranks skip everything, others do a full block") {
  const int b = 16;  // tile size
  for (int P = 2; P <= 8; ++P) {
    const index_type n = 4 * b, N = n * P;
    const std::int64_t tiles = (n / b) * (n / b);
    for (int s = 1; s < P; ++s) {
      int idle = 0, full = 0;
      for (int r = 0; r < P; ++r) {
        const TileCounts t = ring_step_work<ContiguousPartition>(CausalMask{}, N, P, r, s, b, b);
        if (t.skipped == tiles) ++idle;
        if (t.full == tiles) ++full;
        CHECK((t.skipped == tiles || t.full == tiles));
        CHECK(block_is_empty<ContiguousPartition>(CausalMask{}, N, P, r, ring_source(r, s, P)) ==
              (t.skipped == tiles));
      }
      CHECK(idle == s);      // ranks r < s hold a block from their future
      CHECK(full == P - s);  // the others a block entirely in their past
    }
  }
}

TEST_CASE(
    "striped causal ring: per-step work is Work(i, j) of Striped Attention (arXiv:2311.09431)") {
  // Work(i, j) = c(c+1)/2 if i >= j else c(c-1)/2, c tokens per rank.
  for (int P = 2; P <= 8; ++P) {
    const index_type c = 40, N = c * P;
    for (int s = 0; s < P; ++s)
      for (int r = 0; r < P; ++r) {
        const int j = ring_source(r, s, P);
        const TileCounts t = ring_step_work<StripedPartition>(CausalMask{}, N, P, r, s, 16, 16);
        CHECK(t.allowed_pairs == (r >= j ? c * (c + 1) / 2 : c * (c - 1) / 2));
        // A triangle on every step: no rank is idle, and the tiles above the
        // local diagonal are skipped.
        CHECK_FALSE(block_is_empty<StripedPartition>(CausalMask{}, N, P, r, j));
        CHECK(t.skipped > 0);
        CHECK(t.computed() > 0);
      }
  }
}

TEST_CASE("zigzag causal ring: per-step work is equal across ranks") {
  for (int P = 2; P <= 8; ++P) {
    const index_type chunk = 24, N = 2 * P * chunk;
    for (int s = 0; s < P; ++s) {
      std::set<std::int64_t> pairs;
      for (int r = 0; r < P; ++r)
        pairs.insert(ring_step_work<ZigzagPartition>(CausalMask{}, N, P, r, s, 8, 8).allowed_pairs);
      CHECK(pairs.size() == 1);
      // Off the diagonal step a rank computes exactly half of the block.
      if (s > 0) CHECK(*pairs.begin() == 2 * chunk * chunk);
    }
  }
}

TEST_CASE("the ring's steps together compute every allowed pair once") {
  for (int P = 1; P <= 6; ++P) {
    const index_type N = 12 * P;
    std::int64_t total = 0;
    for (int r = 0; r < P; ++r)
      for (int s = 0; s < P; ++s)
        total += ring_step_work<ZigzagPartition>(SlidingWindowMask{5, 3}, N, P, r, s, 4, 4)
                     .allowed_pairs;
    std::int64_t want = 0;
    for (index_type q = 0; q < N; ++q)
      for (index_type k = 0; k < N; ++k) want += SlidingWindowMask{5, 3}.allowed(q, k);
    CHECK(total == want);
  }
}

TEST_CASE("balanced schedule: every block pair once, the paper's idle fractions") {
  for (int P = 1; P <= 16; ++P) {
    std::vector<int> seen(std::size_t(P) * P, 0);
    int idle = 0;
    for (int t = 0; t < balanced_steps(P); ++t)
      for (int p = 0; p < P; ++p) {
        const BlockTask task = balanced_task(p, t, P);
        if (task.idle()) {
          ++idle;
          continue;
        }
        // A rank works on its own queries or on its own keys.
        CHECK((task.q_rank == p || task.k_rank == p));
        CHECK(task.k_rank <= task.q_rank);
        ++seen[std::size_t(task.q_rank) * P + task.k_rank];
        if (task.q_rank != p) {
          CHECK(balanced_helps(p, t, P) == task.q_rank);
          CHECK(balanced_helper_of(task.q_rank, t, P) == p);
        }
      }
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < P; ++j) CHECK(seen[std::size_t(i) * P + j] == (j <= i ? 1 : 0));
    // DistFlashAttn (arXiv:2310.03294) eq. (2): idle fraction (idle rank-steps over P^2) 0 for
    // odd P, 1 / (2P) for even P; the plain ring's (P^2 - P) / (2 P^2).
    const double balanced = double(idle) / (double(P) * P);
    CHECK(balanced == doctest::Approx(P % 2 ? 0.0 : 1.0 / (2.0 * P)));
    int ring_idle = 0;
    for (int s = 0; s < P; ++s)
      for (int p = 0; p < P; ++p)
        ring_idle += block_is_empty<ContiguousPartition>(CausalMask{}, index_type(P) * 8, P, p,
                                                         ring_source(p, s, P))
                         ? 1
                         : 0;
    CHECK(double(ring_idle) / (double(P) * P) ==
          doctest::Approx((double(P) * P - P) / (2.0 * P * P)));
  }
}
