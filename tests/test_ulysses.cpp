// SPDX-License-Identifier: Apache-2.0
// UlyssesAttention (head-parallel all-to-all) under MPI, P = 1 ... 4: forward
// and backward against the fp64 reference of the global sequence for every
// partition, masks over global positions (causal, a two-sided window,
// prefix-LM, a user document mask), GQA with K/V heads sharded and replicated,
// fp64, fp32 and bf16; shapes Ulysses cannot shard are rejected on every rank;
// RunStats' bytes are the all-to-all volumes.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "backend.hpp"
#include "distributed_check.hpp"
#include "forward_check.hpp"
#include "reference.hpp"
#include "user_masks.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

/// N = n_local P + extra tokens: with extra > 0 the ranks hold different numbers.
struct UCase {
  int b, n_local, h, hkv, d;
  int extra = 0;
};

/// Forward and backward of one partition x mask in value type S on this
/// communicator, against the fp64 reference of the inputs rounded to S.
/// Bounds: forward_check.hpp's (fp64/fp32), gradients 1e-11 / 1e-4 of the
/// largest entry; bf16 adds one rounding of the result (test_half_attention.cpp).
template <class S, class Partition, class Mask>
void check(Mpi& comm, const UCase& c, const Mask& mask, std::uint64_t seed) {
  using C = compute_t<S>;
  const int P = comm.size(), rank = comm.rank();
  const int N = c.n_local * P + c.extra, n = int(local_length<Partition>(N, P, rank));
  const int most = int(max_local_length<Partition>(N, P));  // rows of an all-to-all chunk
  const GlobalProblem g = global_problem<S>(c.b, N, c.h, c.hkv, c.d, mask, seed);
  const V4<S> ql = local_rows<S, Partition>(g.q, P, rank),
              kl = local_rows<S, Partition>(g.k, P, rank),
              vl = local_rows<S, Partition>(g.v, P, rank),
              dol = local_rows<S, Partition>(g.dout, P, rank);
  V4<S> o("o", c.b, n, c.h, c.d), dq("dq", c.b, n, c.h, c.d), dk("dk", c.b, n, c.hkv, c.d),
      dv("dv", c.b, n, c.hkv, c.d);
  V3<C> lse("lse", c.b, c.h, n);
  UlyssesAttention<Partition, Mask, Mpi, ExecSpace> attn(comm, mask);
  const RunStats fs = attn.forward(ql, kl, vl, o, lse);
  const RunStats bs = attn.backward(ql, kl, vl, o, lse, dol, dq, dk, dv);
  Kokkos::fence();

  const auto map = Partition::positions(N, P, rank);
  check_against_reference<S>(g.ref, g.grads, map, N, o, lse, dq, dk, dv, 1,
                             "rank " + std::to_string(rank) + "/" + std::to_string(P) + " " +
                                 std::string(Partition::name()) + " Hkv=" + std::to_string(c.hkv));

  // One step each; the bytes are the all-to-all volumes: (P-1)/P of what
  // travels. Forward: Q, K, V in (K/V once per receiving rank), O in S and
  // LSE in the compute type back. Backward: Q, K, V, O, dO in S and LSE in
  // the compute type in; dQ in S, dK and dV in the compute type back.
  REQUIRE(fs.steps.size() == 1);
  REQUIRE(bs.steps.size() == 1);
  const UlyssesHeads u = UlyssesHeads::make(c.h, c.hkv, P);
  const std::int64_t rows = std::int64_t(c.b) * most * c.d * (P - 1);  // per head of a chunk
  const std::int64_t s = sizeof(S), cs = sizeof(C);
  const std::int64_t hq = u.heads_per_rank, hk = u.kv_heads_per_rank;
  CHECK(fs.steps[0].bytes_sent ==
        rows * s * (2 * hq + 2 * hk) + std::int64_t(c.b) * most * (P - 1) * hq * cs);
  CHECK(bs.steps[0].bytes_sent == rows * s * (3 * hq + 2 * hk) +
                                      std::int64_t(c.b) * most * (P - 1) * hq * cs +
                                      rows * (hq * s + 2 * hk * cs));
  CHECK(fs.steps[0].computed);

  // The planner reads the same description: bytes, peak workspace, tiles.
  const plan::Problem pb = plan::problem_for<S, ExecSpace>(N, P, c.b, c.h, c.hkv, c.d);
  const plan::Prediction pr = plan::predict_ulysses<Partition>(pb, mask, plan::Hardware{});
  REQUIRE(pr.valid);
  const plan::RankPlan& mine = pr.ranks[std::size_t(rank)];
  CHECK(pb.block_q == fs.block_q);
  CHECK(pb.block_k == fs.block_k);
  CHECK(mine.workspace_bytes == fs.workspace_bytes);
  REQUIRE(mine.steps.size() == 1);
  CHECK(mine.steps[0].bytes_sent == fs.steps[0].bytes_sent);
  CHECK(mine.steps[0].tiles.full == fs.steps[0].tiles.full);
  CHECK(mine.steps[0].tiles.partial == fs.steps[0].tiles.partial);
  // The backward: its all-to-alls' bytes, its peak workspace, its tiles.
  plan::Problem pbb = pb;
  pbb.pass = plan::Pass::backward;
  const plan::Prediction prb = plan::predict_ulysses<Partition>(pbb, mask, plan::Hardware{});
  REQUIRE(prb.valid);
  const plan::RankPlan& back = prb.ranks[std::size_t(rank)];
  CHECK(pbb.backward_block_q() == bs.block_q);
  CHECK(pbb.backward_block_k() == bs.block_k);
  CHECK(back.workspace_bytes == bs.workspace_bytes);
  REQUIRE(back.steps.size() == 1);
  CHECK(back.steps[0].bytes_sent == bs.steps[0].bytes_sent);
  CHECK(back.steps[0].tiles.full == bs.steps[0].tiles.full);
  CHECK(back.steps[0].tiles.partial == bs.steps[0].tiles.partial);
}

template <class S, class Partition>
void check_masks(Mpi& comm, const UCase& c, std::uint64_t seed) {
  const index_type N = index_type(c.n_local) * comm.size() + c.extra;
  check<S, Partition>(comm, c, CausalMask{}, seed);
  check<S, Partition>(comm, c, SlidingWindowMask{N / 5, N / 7}, seed + 1);
  check<S, Partition>(comm, c, PrefixLMMask{N / 3}, seed + 2);
  check<S, Partition>(comm, c, DocumentCausalMask{N / 3 + 1}, seed + 3);
}

}  // namespace

TEST_CASE("ulysses: every partition and mask, fp64, sharded and replicated K/V heads") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  // 12 query heads divide by P = 1 ... 4. K/V heads: 12 (no GQA) down to 1
  // (one K/V head replicated to every rank); the shapes Ulysses cannot shard
  // at this P are skipped here and rejected in the test case below.
  int run = 0, replicated = 0;
  for (const int hkv : {12, 6, 4, 2, 1}) {
    if (!UlyssesHeads::why_not(12, hkv, P).empty()) continue;
    const UCase c{1, 10, 12, hkv, 24};
    check_masks<double, ContiguousPartition>(comm, c, 100 + hkv);
    check_masks<double, StripedPartition>(comm, c, 200 + hkv);
    check_masks<double, ZigzagPartition>(comm, c, 300 + hkv);
    ++run;
    replicated += UlyssesHeads::make(12, hkv, P).replicated ? 1 : 0;
  }
  CHECK(run >= 3);
  if (P > 1) CHECK(replicated >= 1);
}

TEST_CASE("ulysses: any length: ranks one token apart, ranks without a token") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  // 12 heads and the fewest K/V heads of 4, 6, 12 that Ulysses shards at
  // this P; N = 7P + 1 and 7P + 2P - 1.
  int hkv = 12;
  for (const int x : {6, 4})
    if (UlyssesHeads::why_not(12, x, P).empty()) hkv = x;
  for (const int extra : {1, 2 * P - 1}) {
    const UCase c{1, 7, 12, hkv, 24, extra};
    check_masks<double, ContiguousPartition>(comm, c, 500 + extra);
    check<double, ZigzagPartition>(comm, c, CausalMask{}, 600 + extra);
    check<double, StripedPartition>(comm, c, SlidingWindowMask{9, 3}, 700 + extra);
  }
  // N = P - 1 (the last rank holds nothing) and N = 1 (one rank holds the only token).
  for (const int N : {P > 1 ? P - 1 : 1, 1}) {
    const UCase c{1, 0, 12, hkv, 8, N};
    check<double, ContiguousPartition>(comm, c, CausalMask{}, 800 + N);
    check<double, ZigzagPartition>(comm, c, FullMask{}, 900 + N);
  }
}

TEST_CASE("ulysses: fp32 and bf16, batch 2, padded head dim") {
  Mpi comm(MPI_COMM_WORLD);
  const UCase c{2, 38, 12, 2, 40};
  const int P = comm.size();
  if (UlyssesHeads::why_not(c.h, c.hkv, P).empty()) {
    check<float, ZigzagPartition>(comm, c, CausalMask{}, 400);
    check<bf16, StripedPartition>(comm, c, SlidingWindowMask{64, 0}, 401);
    check<bf16, ContiguousPartition>(comm, c, CausalMask{}, 402);
  } else {
    // P = 3: 4 query heads per rank, K/V groups of 6: neither covers the other.
    CHECK(P == 3);
  }
}

TEST_CASE("ulysses: shapes it cannot shard are rejected on every rank") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  auto run = [&](int h, int hkv) {
    V4<float> q("q", 1, 8, h, 16), k("k", 1, 8, hkv, 16), o("o", 1, 8, h, 16);
    V3<float> lse("lse", 1, h, 8);
    UlyssesAttention<ContiguousPartition, CausalMask, Mpi, ExecSpace> attn(comm);
    std::string what;
    try {
      attn.forward(q, k, k, o, lse);
    } catch (const invalid_argument& e) {
      what = e.what();
    }
    return what;
  };
  if (P == 3) {
    const std::string a = run(4, 4);
    CHECK(a.find("UlyssesAttention::forward") != std::string::npos);
    CHECK(a.find("is not a multiple of the number of ranks P = 3") != std::string::npos);
    const std::string b = run(12, 2);
    CHECK(b.find("kv heads (k.extent(2)) = 2") != std::string::npos);
  } else {
    CHECK(run(4, 4).empty());
    if (P == 4) CHECK(run(6, 6).find("heads (q.extent(2)) = 6") != std::string::npos);
  }
  // A local length the partition does not give: the consensus names it on every rank.
  if (P > 1) {
    const int n = comm.rank() == 0 ? 8 : 6;
    V4<float> q("q", 1, n, 4, 16), o("o", 1, n, 4, 16);
    V3<float> lse("lse", 1, 4, n);
    UlyssesAttention<ContiguousPartition, CausalMask, Mpi, ExecSpace> attn(comm);
    std::string what;
    try {
      attn.forward(q, q, q, o, lse);
    } catch (const invalid_argument& e) {
      what = e.what();
    }
    // Rank 0 differs from the majority (P > 2); at P = 2 every rank's length.
    CHECK(what.find(P > 2 ? "rank 0 holds 8 tokens (q.extent(1)) where the other " +
                                std::to_string(P - 1) + " hold 6"
                          : std::string("the ranks hold 6 tokens on rank 1; 8 tokens on rank 0")) !=
          std::string::npos);
    CHECK(what.find("the contiguous partition of N = " + std::to_string(8 + 6 * (P - 1))) !=
          std::string::npos);
  }
}
