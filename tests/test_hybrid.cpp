// SPDX-License-Identifier: Apache-2.0
// HybridAttention (all-to-all over heads inside groups x ring across groups)
// under MPI, P = 1 ... 4 on every grid P_a x P_r of P (1x1; 2x1, 1x2; 3x1,
// 1x3; 4x1, 2x2, 1x4): forward and backward against the fp64 reference of
// the global sequence, for the ring (zigzag), Q ring (striped), balanced
// (contiguous) and all-gather (zigzag) schedules across groups, masks over
// global positions (causal, a two-sided window, packed documents, a user
// mask), GQA with K/V heads sharded and replicated inside a group, fp64,
// fp32, bf16 and fp16. RunStats equals the planner's predict_hybrid
// (all-to-all bytes, ring bytes, tiles, peak workspace); bad grids and
// shapes are rejected on every rank.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>

#include "backend.hpp"
#include "distributed_check.hpp"
#include "forward_check.hpp"
#include "reference.hpp"
#include "user_masks.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

/// This rank's rows of a global tensor under the hybrid layout, built on the
/// host from the layout's definition (not from hybrid_to_local, which the
/// last test case checks against it).
/// Member a's piece of a group of Ng tokens: the first Ng mod P_a members
/// hold one token more. {first token, tokens}.
std::pair<index_type, index_type> piece(index_type Ng, const HybridGrid& g, int rank) {
  const index_type base = Ng / g.ulysses, more = Ng % g.ulysses, a = g.member(rank);
  return {a * base + std::min(a, more), base + (a < more ? 1 : 0)};
}

template <class S, class Partition>
V4<S> local_rows(const HostTensor& t, const HybridGrid& g, int rank) {
  // Not a structured binding: a lambda cannot capture one before C++20 (nvcc says so).
  const auto p = piece(local_length<Partition>(t.n, g.ring, g.group(rank)), g, rank);
  const index_type first = p.first, n = p.second;
  const auto group = Partition::positions(t.n, g.ring, g.group(rank));
  return test::local_rows<S>(t, n, [&](index_type i) { return group(first + i); });
}

/// N = n_local P + extra: with extra > 0 ranks hold different numbers of tokens.
struct HCase {
  int b, n_local, h, hkv, d;
  int extra = 0;
};

/// Forward and backward of one partition x schedule x mask in value type S
/// on the grid with `ulysses` ranks per group, against the fp64 reference of
/// the inputs rounded to S. Bounds as test_ulysses.cpp (forward_check.hpp's
/// for fp64/fp32; gradients 1e-11 / 1e-4 of the largest entry; 16-bit adds
/// one rounding of the result, and for gradients a second one: a replicated
/// K/V head's partials arrive rounded to S before their fp32 sum).
template <class S, class Partition, class Schedule, class Mask>
void check(Mpi& comm, const HCase& c, const Mask& mask, int ulysses, std::uint64_t seed) {
  using C = compute_t<S>;
  const int P = comm.size(), rank = comm.rank();
  const int N = c.n_local * P + c.extra;
  const HybridGrid g = HybridGrid::make(P, ulysses);
  const index_type Ng = local_length<Partition>(N, g.ring, g.group(rank));
  const int n = int(piece(Ng, g, rank).second);
  const int most = int((Ng + ulysses - 1) / ulysses);  // rows of the group's all-to-all chunks
  const GlobalProblem gp = global_problem<S>(c.b, N, c.h, c.hkv, c.d, mask, seed);
  const V4<S> ql = local_rows<S, Partition>(gp.q, g, rank),
              kl = local_rows<S, Partition>(gp.k, g, rank),
              vl = local_rows<S, Partition>(gp.v, g, rank),
              dol = local_rows<S, Partition>(gp.dout, g, rank);
  V4<S> o("o", c.b, n, c.h, c.d), dq("dq", c.b, n, c.h, c.d), dk("dk", c.b, n, c.hkv, c.d),
      dv("dv", c.b, n, c.hkv, c.d);
  V3<C> lse("lse", c.b, c.h, n);
  HybridAttention<Partition, Mask, Schedule, Mpi, ExecSpace> attn(comm, ulysses, mask);
  REQUIRE(attn.grid().ring == P / ulysses);
  const RunStats fs = attn.forward(ql, kl, vl, o, lse);
  const RunStats bs = attn.backward(ql, kl, vl, o, lse, dol, dq, dk, dv);
  Kokkos::fence();

  const auto map = hybrid_position_map<Partition>(N, g, rank);
  const UlyssesHeads u = UlyssesHeads::make(c.h, c.hkv, ulysses);
  const int roundings = u.replicated ? 1 + c.h / c.hkv / u.heads_per_rank : 1;
  check_against_reference<S>(gp.ref, gp.grads, map, N, o, lse, dq, dk, dv, roundings,
                             "rank " + std::to_string(rank) + "/" + std::to_string(P) + " grid " +
                                 std::to_string(ulysses) + "x" + std::to_string(g.ring) + " " +
                                 std::string(Partition::name()) + " " +
                                 std::string(Schedule::name()) + " Hkv=" + std::to_string(c.hkv));

  // All-to-all bytes inside the group: Ulysses' volumes on P_a ranks.
  const std::int64_t rows = std::int64_t(c.b) * most * c.d * (ulysses - 1);  // one head
  const std::int64_t s = sizeof(S), cs = sizeof(C);
  const std::int64_t hq = u.heads_per_rank, hk = u.kv_heads_per_rank;
  CHECK(fs.alltoall_bytes ==
        rows * s * (2 * hq + 2 * hk) + std::int64_t(c.b) * most * (ulysses - 1) * hq * cs);
  CHECK(bs.alltoall_bytes == rows * s * (3 * hq + 2 * hk) +
                                 std::int64_t(c.b) * most * (ulysses - 1) * hq * cs +
                                 rows * (hq * s + 2 * hk * s));
  // The ring's steps: as many as the schedule takes on P_r ranks.
  std::int64_t ring_bytes = 0;
  for (const auto& st : fs.steps) ring_bytes += st.bytes_sent;
  CHECK(fs.bytes_sent() == ring_bytes + fs.alltoall_bytes);
  if (g.ring == 1) CHECK(ring_bytes == 0);

  // The planner reads the same descriptions: bytes, tiles, peak workspace.
  const plan::Problem pb = plan::problem_for<S, ExecSpace>(N, P, c.b, c.h, c.hkv, c.d);
  const plan::Prediction pr =
      plan::predict_hybrid<Partition, Schedule>(pb, mask, plan::Hardware{}, ulysses);
  REQUIRE(pr.valid);
  const plan::RankPlan& mine = pr.ranks[std::size_t(rank)];
  CHECK(pb.block_q == fs.block_q);
  CHECK(pb.block_k == fs.block_k);
  CHECK(mine.alltoall_bytes == fs.alltoall_bytes);
  CHECK(mine.workspace_bytes == fs.workspace_bytes);
  REQUIRE(mine.steps.size() == fs.steps.size());
  for (std::size_t i = 0; i < fs.steps.size(); ++i) {
    INFO("step ", i);
    CHECK(mine.steps[i].bytes_sent == fs.steps[i].bytes_sent);
    CHECK(mine.steps[i].tiles.full == fs.steps[i].tiles.full);
    CHECK(mine.steps[i].tiles.partial == fs.steps[i].tiles.partial);
  }
  plan::Problem pbb = pb;
  pbb.pass = plan::Pass::backward;
  const plan::Prediction prb =
      plan::predict_hybrid<Partition, Schedule>(pbb, mask, plan::Hardware{}, ulysses);
  REQUIRE(prb.valid);
  const plan::RankPlan& back = prb.ranks[std::size_t(rank)];
  CHECK(back.alltoall_bytes == bs.alltoall_bytes);
  CHECK(back.workspace_bytes == bs.workspace_bytes);
  REQUIRE(back.steps.size() == bs.steps.size());
  for (std::size_t i = 0; i < bs.steps.size(); ++i) {
    INFO("backward step ", i);
    CHECK(back.steps[i].bytes_sent == bs.steps[i].bytes_sent);
    CHECK(back.steps[i].tiles.full == bs.steps[i].tiles.full);
    CHECK(back.steps[i].tiles.partial == bs.steps[i].tiles.partial);
  }
}

/// Every group size that divides P.
std::vector<int> grids(int P) {
  std::vector<int> a;
  for (int x = 1; x <= P; ++x)
    if (P % x == 0) a.push_back(x);
  return a;
}

}  // namespace

TEST_CASE("hybrid: every grid, zigzag ring, every mask, fp64, sharded and replicated K/V") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  int replicated = 0;
  for (const int a : grids(P)) {
    // 12 query heads divide by every group size 1 ... 4. K/V heads: 12 on
    // one rank, 1 (replicated to both) on groups of 2, 6 (sharded, 2 each) on
    // groups of 3, 2 (each replicated to 2 ranks) on groups of 4.
    const int hkv = a == 1 ? 12 : a == 2 ? 1 : a == 3 ? 6 : 2;
    const HCase c{1, 12, 12, hkv, 24};
    const index_type N = index_type(c.n_local) * P;
    const std::uint64_t seed = 100 * std::uint64_t(a) + std::uint64_t(P);
    check<double, ZigzagPartition, RingSchedule>(comm, c, CausalMask{}, a, seed);
    check<double, ZigzagPartition, RingSchedule>(comm, c, SlidingWindowMask{N / 5, N / 7}, a,
                                                 seed + 1);
    check<double, ZigzagPartition, RingSchedule>(comm, c, DocumentCausalMask{N / 3 + 1}, a,
                                                 seed + 2);
    const Documents<MemSpace> docs(uneven_documents(N));
    check<double, ZigzagPartition, RingSchedule>(comm, c, docs.mask(), a, seed + 3);
    replicated += UlyssesHeads::make(c.h, c.hkv, a).replicated ? 1 : 0;
  }
  if (P == 2 || P == 4) CHECK(replicated >= 1);
  CHECK(UlyssesHeads::why_not(12, 2, 3).find("kv heads (k.extent(2)) = 2") != std::string::npos);
}

TEST_CASE("hybrid: any length: uneven groups and pieces, members and groups without a token") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  for (const int a : grids(P)) {
    const int hkv = a == 3 ? 6 : 4;  // 12 query heads; K/V sharded or replicated
    const std::uint64_t seed = 5000 + 10 * std::uint64_t(a) + std::uint64_t(P);
    // N = 9P + 1 and 9P + 2P - 1, then N = P - 1 and N = 1.
    for (const int extra : {1, 2 * P - 1}) {
      const HCase c{1, 9, 12, hkv, 24, extra};
      check<double, ZigzagPartition, RingSchedule>(comm, c, CausalMask{}, a, seed + extra);
      check<double, StripedPartition, BurstSchedule>(comm, c, CausalMask{}, a, seed + 2 + extra);
    }
    for (const int N : {P > 1 ? P - 1 : 1, 1}) {
      const HCase c{1, 0, 12, hkv, 8, N};
      check<double, ZigzagPartition, RingSchedule>(comm, c, CausalMask{}, a, seed + 50 + N);
      check<float, ContiguousPartition, BalancedSchedule>(comm, c, CausalMask{}, a, seed + 60 + N);
    }
  }
}

TEST_CASE("hybrid: Q ring, balanced and all-gather across groups; fp32, bf16, fp16") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  for (const int a : grids(P)) {
    const std::uint64_t seed = 1000 + 10 * std::uint64_t(a) + std::uint64_t(P);
    const HCase c{2, 10, 4, 4, 40};  // batch 2, padded head dim
    const HCase gqa{1, 16, 4, 1, 32};
    if (!UlyssesHeads::why_not(c.h, c.hkv, a).empty()) continue;  // 3 does not divide 4 heads
    check<double, StripedPartition, BurstSchedule>(comm, c, CausalMask{}, a, seed);
    check<float, ContiguousPartition, BalancedSchedule>(comm, c, CausalMask{}, a, seed + 1);
    check<float, ZigzagPartition, AllGatherSchedule>(comm, gqa, CausalMask{}, a, seed + 2);
    check<bf16, ZigzagPartition, RingSchedule>(comm, gqa, CausalMask{}, a, seed + 3);
    check<fp16, StripedPartition, BurstSchedule>(comm, c, SlidingWindowMask{24, 0}, a, seed + 4);
  }
}

TEST_CASE("hybrid: hybrid_to_local and hybrid_from_local invert each other") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size(), rank = comm.rank();
  for (const int a : grids(P))
    for (const index_type extra : {index_type(0), index_type(P + 1)}) {
      const HybridGrid g = HybridGrid::make(P, a);
      const index_type N = 4 * index_type(P) * 3 + extra;
      const auto p = piece(local_length<ZigzagPartition>(N, g.ring, g.group(rank)), g, rank);
      const index_type first = p.first, n = p.second;
      CHECK(n == hybrid_length<ZigzagPartition>(N, g, rank));
      V4<double> global("global", 1, N, 2, 3), back("back", 1, N, 2, 3);
      V4<double> local("local", 1, n, 2, 3);
      fill_random(global, 7 + std::uint64_t(a));
      hybrid_to_local<ZigzagPartition>(ExecSpace(), g, rank, global, local);
      hybrid_from_local<ZigzagPartition>(ExecSpace(), g, rank, local, back);
      const auto ids = hybrid_local_positions<ZigzagPartition>(N, g, rank);
      auto gh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), global);
      auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), local);
      auto bh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), back);
      const auto map = ZigzagPartition::positions(N, g.ring, g.group(rank));
      bool ok = true;
      for (index_type i = 0; i < n; ++i) {
        const index_type t = map(first + i);
        ok = ok && ids(i) == t;
        for (int h = 0; h < 2; ++h)
          for (int d = 0; d < 3; ++d) ok = ok && lh(0, i, h, d) == gh(0, t, h, d);
        for (int h = 0; h < 2; ++h)
          for (int d = 0; d < 3; ++d) ok = ok && bh(0, t, h, d) == gh(0, t, h, d);
      }
      CHECK(ok);
      // The ranks together hold every position once.
      std::vector<int> seen(std::size_t(N), 0);
      for (int r = 0; r < P; ++r) {
        const auto m = hybrid_position_map<ZigzagPartition>(N, g, r);
        for (index_type i = 0; i < hybrid_length<ZigzagPartition>(N, g, r); ++i)
          ++seen[std::size_t(m(i))];
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int x) { return x == 1; }));
    }
}

TEST_CASE("hybrid: bad grids, lengths and shapes are rejected on every rank") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  using Attn = HybridAttention<ZigzagPartition, CausalMask, RingSchedule, Mpi, ExecSpace>;
  auto message = [](auto&& f) {
    std::string what;
    try {
      f();
    } catch (const invalid_argument& e) {
      what = e.what();
    }
    return what;
  };
  // A group size that does not divide P.
  const std::string bad = message([&] { Attn attn(comm, P + 1); });
  CHECK(bad.find("ulysses") != std::string::npos);
  CHECK(bad.find("does not divide the number of ranks P = " + std::to_string(P)) !=
        std::string::npos);
  // A group size that differs between ranks.
  if (P > 1) {
    const std::string differ = message([&] { Attn attn(comm, comm.rank() == 0 ? 1 : P); });
    CHECK(differ.find("differs between ranks") != std::string::npos);
  }
  // Heads the groups cannot split, and a length the layout cannot split.
  if (P >= 2) {
    Attn attn(comm, P);
    V4<float> q("q", 1, 4, P + 1, 16), o("o", 1, 4, P + 1, 16);
    V3<float> lse("lse", 1, P + 1, 4);
    const std::string heads = message([&] { attn.forward(q, q, q, o, lse); });
    CHECK(heads.find("HybridAttention::forward") != std::string::npos);
    CHECK(heads.find("heads (q.extent(2)) = " + std::to_string(P + 1)) != std::string::npos);
  }
  if (P >= 2) {
    // P groups of one; N = 3P + 1 gives rank 0 three zigzag tokens, not four.
    Attn attn(comm, 1);
    const int n = comm.rank() == 0 ? 4 : 3;
    V4<float> q("q", 1, n, 2, 16), o("o", 1, n, 2, 16);
    V3<float> lse("lse", 1, 2, n);
    const std::string len = message([&] { attn.forward(q, q, q, o, lse); });
    CHECK(len.find((P > 2 ? "rank 0 holds 4 tokens (q.extent(1)) where the other " +
                                std::to_string(P - 1) + " hold 3; "
                          : std::string("the ranks hold 3 tokens on rank 1; 4 tokens on rank 0")) +
                   std::string(P > 2 ? "the hybrid layout (zigzag partition over " : "")) !=
          std::string::npos);
    CHECK(len.find("the hybrid layout (zigzag partition over " + std::to_string(P) +
                   " ring groups of 1) of N = " + std::to_string(3 * P + 1) +
                   " tokens (the sum over the ranks) gives ") != std::string::npos);
  }
}
