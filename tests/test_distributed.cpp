// SPDX-License-Identifier: Apache-2.0
// Properties every schedule keeps across ranks (ring, Q ring, balanced): NaN and
// Inf reach exactly the outputs that can see them; LayoutLeft Views give bitwise
// the LayoutRight results. Per-schedule tests: test_ring.cpp, test_balanced.cpp,
// test_allgather.cpp.
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
