// SPDX-License-Identifier: Apache-2.0
// Multi-rank: the distributed forward equals the single-device forward on the
// same global sequence, for every partition x mask, on this binary's backend.
// Run under mpiexec with any number of ranks (ctest: 1, 2, 3, 4).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend.hpp"
#include "distributed_check.hpp"
#include "reference.hpp"
#include "user_masks.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

template <class T, class Partition, class Comm>
void all_masks(Comm comm, const Case& c, std::uint64_t seed) {
  const index_type N = index_type(c.n_local) * comm.size();
  check_against_single<T, Partition>(comm, c, FullMask{}, seed);
  check_against_single<T, Partition>(comm, c, CausalMask{}, seed + 10);
  check_against_single<T, Partition>(comm, c, SlidingWindowMask{N / 5, N / 7}, seed + 20);
  check_against_single<T, Partition>(comm, c, PrefixLMMask{N / 3}, seed + 30);
  // Packed documents of uneven lengths (one of 1 token, one crossing ranks).
  const Documents<MemSpace> docs(uneven_documents(N));
  check_against_single<T, Partition>(comm, c, docs.mask(true, N / 4, 0), seed + 40);
}

// Local lengths are even (zigzag) and not multiples of the tile sizes.
const Case cases[] = {{1, 74, 1, 1, 64}, {2, 38, 2, 1, 40}, {1, 130, 2, 2, 128}};

}  // namespace

TEST_CASE_TEMPLATE("distributed forward equals single-device forward", T, double, float) {
  Mpi comm(MPI_COMM_WORLD);
  std::uint64_t seed = 100;
  for (const Case& c : cases) {
    all_masks<T, ContiguousPartition>(comm, c, seed += 100);
    all_masks<T, StripedPartition>(comm, c, seed += 100);
    all_masks<T, ZigzagPartition>(comm, c, seed += 100);
  }
}

TEST_CASE("the size-1 communicator runs the same code without MPI") {
  check_against_single<double, StripedPartition>(SelfCommunicator{}, {1, 50, 2, 1, 64},
                                                 CausalMask{}, 7);
  check_against_single<float, ZigzagPartition>(SelfCommunicator{}, {2, 66, 1, 1, 40},
                                               PrefixLMMask{20}, 8);
}

TEST_CASE("accounting: bytes and steps match the ring") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size(), n = 64, d = 64;
  V4<float> q("q", 1, n, 2, d), o("o", 1, n, 2, d);
  V3<float> lse("lse", 1, 2, n);
  DistributedAttention<ContiguousPartition, CausalMask, RingSchedule, Mpi, ExecSpace> attn(comm);
  const RunStats s = attn.forward(q, q, q, o, lse);
  REQUIRE(int(s.steps.size()) == P);
  for (int i = 0; i < P; ++i) {
    CHECK(s.steps[i].source == ring_source(comm.rank(), i, P));
    // Contiguous causal: the block of a later rank is skipped whole.
    CHECK(s.steps[i].computed == (s.steps[i].source <= comm.rank()));
    // K^T and V of the local block (padded to whole tiles), except after the last step.
    const std::int64_t padded = (n + s.block_k - 1) / s.block_k * s.block_k;
    CHECK(s.steps[i].bytes_sent == (i + 1 < P ? 2 * padded * d * 2 * 4 : 0));  // 2 kv heads, fp32
  }
}

TEST_CASE_TEMPLATE("balanced schedule equals single-device forward", T, double, float) {
  Mpi comm(MPI_COMM_WORLD);
  std::uint64_t seed = 5000;
  for (const Case& c : cases) {
    const index_type N = index_type(c.n_local) * comm.size();
    check_against_single<T, ContiguousPartition, BalancedSchedule>(comm, c, CausalMask{},
                                                                   seed += 10);
    check_against_single<T, ContiguousPartition, BalancedSchedule>(comm, c, causal_window(N / 3),
                                                                   seed += 10);
    check_against_single<T, ContiguousPartition, BalancedSchedule>(
        comm, c, test::DocumentCausalMask{N / 3 + 1}, seed += 10);
  }
}

TEST_CASE("balanced schedule: steps follow the task model, idle fraction of the paper") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size(), rank = comm.rank();
  const RunStats s = check_against_single<double, ContiguousPartition, BalancedSchedule>(
      comm, {1, 96, 2, 1, 64}, CausalMask{}, 77);
  REQUIRE(int(s.steps.size()) == balanced_steps(P));
  std::int64_t idle = 0, full_blocks = 0;
  for (int t = 0; t < int(s.steps.size()); ++t) {
    const BlockTask task = balanced_task(rank, t, P);
    CHECK(s.steps[t].source == task.k_rank);
    CHECK(s.steps[t].query_source == task.q_rank);
    CHECK(s.steps[t].computed == !task.idle());
    idle += task.idle() ? 1 : 0;
    if (t > 0 && !task.idle()) {
      // Every non-diagonal step is one whole block below the diagonal.
      CHECK(s.steps[t].tiles.partial == 0);
      CHECK(s.steps[t].tiles.skipped == 0);
      full_blocks += 1;
    }
  }
  // DistFlashAttn (arXiv:2310.03294) eq. (2): idle rank-steps / P^2 = 0 (odd P), 1 / (2P) (even P);
  // every off-diagonal block pair computed once: P (P - 1) / 2 of them.
  CHECK(comm.allreduce(idle, ReduceOp::sum) == (P % 2 == 0 ? P / 2 : 0));
  CHECK(comm.allreduce(full_blocks, ReduceOp::sum) == std::int64_t(P) * (P - 1) / 2);
}

TEST_CASE("balanced schedule rejects a mask that attends to later blocks, on every rank") {
  Mpi comm(MPI_COMM_WORLD);
  const int n = 32, d = 64;
  V4<double> q("q", 1, n, 1, d), o("o", 1, n, 1, d);
  V3<double> lse("lse", 1, 1, n);
  DistributedAttention<ContiguousPartition, PrefixLMMask, BalancedSchedule, Mpi, ExecSpace> attn(
      comm, PrefixLMMask{n + 1});  // the prefix reaches into rank 1's block
  if (comm.size() == 1) {
    CHECK_NOTHROW(attn.forward(q, q, q, o, lse));
  } else {
    try {
      attn.forward(q, q, q, o, lse);
      FAIL("expected blockattn::invalid_argument");
    } catch (const invalid_argument& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("argument 'mask'") != std::string::npos);
      CHECK(what.find("RingSchedule") != std::string::npos);
    }
  }
}

TEST_CASE("planner: workspace, bytes and tiles per step equal the run's (ring and balanced)") {
  Mpi comm(MPI_COMM_WORLD);
  for (const Case& c : cases) {
    check_plan_matches_run<ContiguousPartition, RingSchedule>(comm, c, CausalMask{});
    check_plan_matches_run<StripedPartition, RingSchedule>(comm, c, CausalMask{});
    check_plan_matches_run<ZigzagPartition, RingSchedule>(comm, c, causal_window(40));
    check_plan_matches_run<ContiguousPartition, BalancedSchedule>(comm, c, CausalMask{});
    check_plan_matches_run<ContiguousPartition, BalancedSchedule>(comm, c, causal_window(40));
  }
}

// Bad arguments and configurations that differ between ranks: test_consensus.cpp.

namespace {

template <class T, class Schedule, class Partition>
void backward_all_masks(Mpi& comm, const Case& c, std::uint64_t seed) {
  const index_type N = index_type(c.n_local) * comm.size();
  check_backward<T, Schedule, Partition>(comm, c, FullMask{}, seed);
  check_backward<T, Schedule, Partition>(comm, c, CausalMask{}, seed + 1);
  check_backward<T, Schedule, Partition>(comm, c, SlidingWindowMask{N / 5, N / 7}, seed + 2);
  check_backward<T, Schedule, Partition>(comm, c, PrefixLMMask{N / 3}, seed + 3);
}

template <class T, class Schedule>
void backward_all(Mpi& comm) {
  const Case cases2[] = {{1, 38, 2, 1, 40}, {2, 70, 1, 1, 64}};
  std::uint64_t seed = 900;
  for (const Case& c : cases2) {
    backward_all_masks<T, Schedule, ContiguousPartition>(comm, c, seed += 10);
    backward_all_masks<T, Schedule, StripedPartition>(comm, c, seed += 10);
    backward_all_masks<T, Schedule, ZigzagPartition>(comm, c, seed += 10);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("distributed backward (KV ring) matches the fp64 gradients", T, double, float) {
  Mpi comm(MPI_COMM_WORLD);
  backward_all<T, RingSchedule>(comm);
}

TEST_CASE_TEMPLATE("distributed backward (Q ring) matches the fp64 gradients", T, double, float) {
  Mpi comm(MPI_COMM_WORLD);
  backward_all<T, BurstSchedule>(comm);
}

TEST_CASE_TEMPLATE("balanced backward matches the fp64 gradients", T, double, float) {
  Mpi comm(MPI_COMM_WORLD);
  const Case cases2[] = {{1, 38, 2, 1, 40}, {2, 70, 1, 1, 64}, {1, 130, 2, 2, 128}};
  std::uint64_t seed = 7000;
  for (const Case& c : cases2) {
    const index_type N = index_type(c.n_local) * comm.size();
    check_backward<T, BalancedSchedule, ContiguousPartition>(comm, c, CausalMask{}, seed += 10);
    check_backward<T, BalancedSchedule, ContiguousPartition>(comm, c, causal_window(N / 3),
                                                             seed += 10);
    check_backward<T, BalancedSchedule, ContiguousPartition>(
        comm, c, test::DocumentCausalMask{N / 3 + 1}, seed += 10);
    const Documents<MemSpace> docs(uneven_documents(N));
    check_backward<T, BalancedSchedule, ContiguousPartition>(comm, c, docs.mask(), seed += 10);
    check_backward<T, RingSchedule, ZigzagPartition>(comm, c, docs.mask(false, N / 3, N / 4),
                                                     seed += 10);
  }
}

TEST_CASE("backward bytes per rank: BurstAttention Table 1") {
  // Local length a multiple of the backward tiles (they depend on the host
  // ISA) and D = 64: no padding, so the bytes are exactly the tensors'. B = 1,
  // Z = 2 heads (1 kv head for the GQA case).
  Mpi comm(MPI_COMM_WORLD);
  using Tiles = BackwardTileShape<float, impl::is_host_space_v<ExecSpace>>;
  const int P = comm.size(), n = std::lcm(Tiles::block_q, Tiles::block_k), d = 64, Z = 2;
  const std::int64_t N = std::int64_t(n) * P, f = sizeof(float);
  auto run = [&](auto schedule, int kv_heads) {
    using S = decltype(schedule);
    V4<float> q("q", 1, n, Z, d), k("k", 1, n, kv_heads, d), o("o", 1, n, Z, d),
        dq("dq", 1, n, Z, d), dk("dk", 1, n, kv_heads, d), dv("dv", 1, n, kv_heads, d);
    V3<float> lse("lse", 1, Z, n);
    DistributedAttention<StripedPartition, CausalMask, S, Mpi, ExecSpace> attn(comm);
    attn.forward(q, k, k, o, lse);
    return attn.backward(q, k, k, o, lse, o, dq, dk, dv).bytes_sent();
  };
  // Q ring: Q, dO, LSE, D hop P - 1 times, dQ P times (the last hop brings it
  // home) = Table 1's 3 B Z N d + 2 B Z N minus the one hop of Q, dO, LSE, D
  // the last step does not need.
  const std::int64_t q_ring = run(BurstSchedule{}, Z);
  // One rank moves nothing (its own block never leaves it).
  const std::int64_t hops = P > 1 ? 1 : 0;
  CHECK(q_ring == hops * ((3 * Z * N * d + 2 * Z * N) * f - (2 * Z * n * d + 2 * Z * n) * f));
  // KV ring: K, V hop P - 1 times, dK, dV P times: 4 B Z N d minus one hop of
  // K and V, below Table 1's 6 B Z N d for RingAttention (which sends K and V
  // in separate rounds).
  const std::int64_t kv_ring = run(RingSchedule{}, Z);
  CHECK(kv_ring == hops * (4 * Z * N * d * f - 2 * Z * n * d * f));
  CHECK(kv_ring < 6 * Z * N * d * f);
  // With GQA (1 kv head for 2 query heads) the KV ring moves half as much,
  // while the Q ring is unchanged: the KV ring wins.
  const std::int64_t kv_gqa = run(RingSchedule{}, 1);
  CHECK(kv_gqa == hops * (4 * N * d * f - 2 * n * d * f));
  CHECK(run(BurstSchedule{}, 1) == q_ring);
}

namespace {

/// One NaN (or Inf) in a global input: the distributed forward and backward
/// give non-finite values exactly where the single-device run does (whose
/// pattern test_nan.cpp checks against the semantics), and equal values
/// elsewhere. `where`: 0 = Q, 1 = K, 2 = V, 3 = dO.
template <class Schedule>
void check_poisoned(Mpi& comm, int where, int token, double value) {
  using T = double;
  const int P = comm.size(), rank = comm.rank(), n = 38, N = n * P, H = 2, d = 40;
  const SlidingWindowMask mask = causal_window(N / 3 + 2);
  V4<T> q("q", 1, N, H, d), k("k", 1, N, 1, d), v("v", 1, N, 1, d), dO("do", 1, N, H, d),
      o("o", 1, N, H, d), dq("dq", 1, N, H, d), dk("dk", 1, N, 1, d), dv("dv", 1, N, 1, d);
  V3<T> lse("lse", 1, H, N);
  fill_random(q, 41);
  fill_random(k, 42);
  fill_random(v, 43);
  fill_random(dO, 44);
  {
    const V4<T>& t = where == 0 ? q : where == 1 ? k : where == 2 ? v : dO;
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t);
    h(0, token, 0, 3) = value;
    Kokkos::deep_copy(t, h);
  }
  attention_forward(ExecSpace{}, q, k, v, o, lse, mask);
  attention_backward(ExecSpace{}, q, k, v, o, lse, dO, dq, dk, dv, mask);
  using Part = ContiguousPartition;
  V4<T> ql("ql", 1, n, H, d), kl("kl", 1, n, 1, d), vl("vl", 1, n, 1, d), dol("dol", 1, n, H, d),
      ol("ol", 1, n, H, d), dql("dql", 1, n, H, d), dkl("dkl", 1, n, 1, d), dvl("dvl", 1, n, 1, d);
  V3<T> ll("ll", 1, H, n);
  to_local<Part>(ExecSpace{}, P, rank, q, ql);
  to_local<Part>(ExecSpace{}, P, rank, k, kl);
  to_local<Part>(ExecSpace{}, P, rank, v, vl);
  to_local<Part>(ExecSpace{}, P, rank, dO, dol);
  DistributedAttention<Part, SlidingWindowMask, Schedule, Mpi, ExecSpace> attn(comm, mask);
  attn.forward(ql, kl, vl, ol, ll);
  attn.backward(ql, kl, vl, ol, ll, dol, dql, dkl, dvl);
  Kokkos::fence();
  int pattern_mismatch = 0, nonfinite = 0;
  double err = 0;
  auto compare = [&](const auto& local, const auto& global) {
    std::decay_t<decltype(local)> mine("mine", local.layout());
    to_local<Part>(ExecSpace{}, P, rank, global, mine);
    auto w = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), mine);
    auto g = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), local);
    for (std::size_t i = 0; i < g.span(); ++i) {
      const double a = g.data()[i], b = w.data()[i];
      if (std::isfinite(a) != std::isfinite(b) || std::isnan(a) != std::isnan(b))
        ++pattern_mismatch;
      else if (std::isfinite(a))
        err = std::max(err, std::abs(a - b));
      else
        ++nonfinite;
    }
  };
  compare(ol, o);
  compare(ll, lse);
  compare(dql, dq);
  compare(dkl, dk);
  compare(dvl, dv);
  INFO("rank ", rank, "/", P, " ", std::string(Schedule::name()), " where=", where,
       " token=", token, " value=", value);
  CHECK(pattern_mismatch == 0);
  CHECK(err <= 1e-11);
  // Somewhere (on some rank) the poison is visible.
  CHECK(comm.allreduce(std::int64_t(nonfinite), ReduceOp::sum) > 0);
}

}  // namespace

TEST_CASE("NaN and Inf cross ranks exactly to the outputs that can see them") {
  Mpi comm(MPI_COMM_WORLD);
  const int N = 38 * comm.size();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (int where = 0; where < 4; ++where)
    for (int token : {N / 2 + 1, N - 3}) {
      const double value = where >= 2 && token == N - 3 ? inf : nan;
      check_poisoned<RingSchedule>(comm, where, token, value);
      check_poisoned<BurstSchedule>(comm, where, token, value);
      check_poisoned<BalancedSchedule>(comm, where, token, value);
    }
}

namespace {

/// The same distributed forward and backward on LayoutRight Views and on
/// LayoutLeft ones (Kokkos' default on GPUs) must agree bitwise: the kernels
/// pack to their own layout, and every element-wise step (merging partials,
/// adding partial gradients) indexes by (batch, token, head, dim).
template <class Schedule>
void check_layouts(Mpi& comm) {
  using T = double;
  using R4 = Kokkos::View<T****, Kokkos::LayoutRight, MemSpace>;
  using R3 = Kokkos::View<T***, Kokkos::LayoutRight, MemSpace>;
  using L4 = Kokkos::View<T****, Kokkos::LayoutLeft, MemSpace>;
  using L3 = Kokkos::View<T***, Kokkos::LayoutLeft, MemSpace>;
  const int rank = comm.rank(), n = 45, H = 2, Hkv = 1, d = 40;
  R4 q("q", 2, n, H, d), k("k", 2, n, Hkv, d), v("v", 2, n, Hkv, d), dO("do", 2, n, H, d),
      o("o", 2, n, H, d), dq("dq", 2, n, H, d), dk("dk", 2, n, Hkv, d), dv("dv", 2, n, Hkv, d);
  R3 lse("lse", 2, H, n);
  fill_random(q, 61 + 10 * rank);
  fill_random(k, 62 + 10 * rank);
  fill_random(v, 63 + 10 * rank);
  fill_random(dO, 64 + 10 * rank);
  L4 ql("ql", 2, n, H, d), kl("kl", 2, n, Hkv, d), vl("vl", 2, n, Hkv, d), dOl("dol", 2, n, H, d),
      ol("ol", 2, n, H, d), dql("dql", 2, n, H, d), dkl("dkl", 2, n, Hkv, d),
      dvl("dvl", 2, n, Hkv, d);
  L3 lsel("lsel", 2, H, n);
  Kokkos::deep_copy(ql, q);
  Kokkos::deep_copy(kl, k);
  Kokkos::deep_copy(vl, v);
  Kokkos::deep_copy(dOl, dO);
  DistributedAttention<ContiguousPartition, CausalMask, Schedule, Mpi, ExecSpace> attn(comm);
  attn.forward(q, k, v, o, lse);
  attn.backward(q, k, v, o, lse, dO, dq, dk, dv);
  attn.forward(ql, kl, vl, ol, lsel);
  attn.backward(ql, kl, vl, ol, lsel, dOl, dql, dkl, dvl);
  Kokkos::fence();
  auto differ = [](const auto& right, const auto& left) {
    std::decay_t<decltype(right)> back("back", right.layout());
    Kokkos::deep_copy(back, left);
    auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), right);
    auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), back);
    int count = 0;
    for (std::size_t i = 0; i < a.span(); ++i) count += !(a.data()[i] == b.data()[i]);
    return count;
  };
  INFO("rank ", rank, "/", comm.size(), " ", std::string(Schedule::name()));
  CHECK(differ(o, ol) == 0);
  CHECK(differ(lse, lsel) == 0);
  CHECK(differ(dq, dql) == 0);
  CHECK(differ(dk, dkl) == 0);
  CHECK(differ(dv, dvl) == 0);
}

}  // namespace

TEST_CASE("LayoutLeft Views give bitwise the results of LayoutRight ones (every schedule)") {
  Mpi comm(MPI_COMM_WORLD);
  check_layouts<RingSchedule>(comm);
  check_layouts<BurstSchedule>(comm);
  check_layouts<BalancedSchedule>(comm);
}
