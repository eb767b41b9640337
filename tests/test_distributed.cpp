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
#include "reference.hpp"
#include "user_masks.hpp"

using namespace blockattn;
using blockattn::test::ExecSpace;
using blockattn::test::HostTensor;
using blockattn::test::MemSpace;
using blockattn::test::reference_backward;
using blockattn::test::ReferenceGrads;

// The transfer mode of the communicator under test: HostStaged by default;
// GpuAware for the device builds' CUDA-aware MPI variant (CMake option
// BLOCKATTN_TEST_GPU_AWARE_MPI).
#ifndef BLOCKATTN_TEST_TRANSFER
#define BLOCKATTN_TEST_TRANSFER HostStaged
#endif
using Mpi = MpiCommunicator<BLOCKATTN_TEST_TRANSFER>;

namespace {

template <class T>
using V4 = Kokkos::View<T****, MemSpace>;
template <class T>
using V3 = Kokkos::View<T***, MemSpace>;

template <class View>
void fill_random(const View& v, std::uint64_t seed) {
  auto h = Kokkos::create_mirror_view(v);
  std::mt19937_64 rng(seed);  // the same on every rank: one global sequence
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = typename View::value_type(u(rng));
  Kokkos::deep_copy(v, h);
}

/// max |a - b| / max |b| over finite entries; inf entries must match exactly.
template <class View>
double rel_error(const View& a, const View& b, bool& inf_mismatch) {
  auto ah = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), a);
  auto bh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b);
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < ah.size(); ++i) {
    const double x = ah.data()[i], y = bh.data()[i];
    if (std::isinf(y) || std::isinf(x) || std::isnan(x)) {
      if (!(x == y)) inf_mismatch = true;
      continue;
    }
    num = std::max(num, std::abs(x - y));
    den = std::max(den, std::abs(y));
  }
  return den > 0 ? num / den : num;
}

struct Case {
  int b, n_local, h, hkv, d;
};

/// Tolerance of distributed vs single device: the same tile kernel on the same
/// inputs, with keys visited in another order and merged by the same rescale
/// rule, so the results differ by rounding only: ~1e-16 (fp64) and ~1e-7 (fp32)
/// times a few accumulation steps. The limits leave 10-100x margin.
template <class T>
constexpr double dist_tol() {
  return std::is_same<T, double>::value ? 1e-12 : 1e-5;
}

template <class T, class Partition, class Schedule = RingSchedule, class Mask, class Comm>
RunStats check_against_single(Comm comm, const Case& c, const Mask& mask, std::uint64_t seed) {
  const int P = comm.size(), rank = comm.rank();
  const int N = c.n_local * P;
  V4<T> q("q", c.b, N, c.h, c.d), k("k", c.b, N, c.hkv, c.d), v("v", c.b, N, c.hkv, c.d),
      o("o", c.b, N, c.h, c.d);
  V3<T> lse("lse", c.b, c.h, N);
  fill_random(q, seed);
  fill_random(k, seed + 1);
  fill_random(v, seed + 2);
  attention_forward(ExecSpace{}, q, k, v, o, lse, mask);

  V4<T> ql("ql", c.b, c.n_local, c.h, c.d), kl("kl", c.b, c.n_local, c.hkv, c.d),
      vl("vl", c.b, c.n_local, c.hkv, c.d), ol("ol", c.b, c.n_local, c.h, c.d),
      oref("oref", c.b, c.n_local, c.h, c.d);
  V3<T> ll("ll", c.b, c.h, c.n_local), lref("lref", c.b, c.h, c.n_local);
  to_local<Partition>(ExecSpace{}, P, rank, q, ql);
  to_local<Partition>(ExecSpace{}, P, rank, k, kl);
  to_local<Partition>(ExecSpace{}, P, rank, v, vl);
  to_local<Partition>(ExecSpace{}, P, rank, o, oref);
  to_local<Partition>(ExecSpace{}, P, rank, lse, lref);

  DistributedAttention<Partition, Mask, Schedule, Comm, ExecSpace> attn(comm, mask);
  const RunStats stats = attn.forward(ql, kl, vl, ol, ll);
  Kokkos::fence();
  bool inf_mismatch = false;
  const double eo = rel_error(ol, oref, inf_mismatch);
  const double el = rel_error(ll, lref, inf_mismatch);
  INFO("rank ", rank, "/", P, " partition=", Partition::name(), " schedule=", Schedule::name(),
       " N=", N, " D=", c.d, " o_err=", eo, " lse_err=", el);
  CHECK(eo <= dist_tol<T>());
  CHECK(el <= dist_tol<T>());
  CHECK_FALSE(inf_mismatch);
  CHECK(int(stats.steps.size()) == schedule_steps<Schedule>(P));

  // Gathering the local outputs back into global order gives the global output.
  V4<T> back("back", c.b, N, c.h, c.d);
  from_local<Partition>(ExecSpace{}, P, rank, ol, back);
  auto bh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), back);
  auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
  const auto map = Partition::positions(N, P, rank);
  double gerr = 0.0;
  for (int i = 0; i < c.n_local; ++i)
    gerr = std::max(gerr, std::abs(double(bh(0, map(i), 0, 0)) - double(oh(0, map(i), 0, 0))));
  CHECK(gerr <= dist_tol<T>());
  return stats;
}

/// Document starts cutting [0, N) unevenly: a 1-token document, a long one
/// crossing rank boundaries, and the rest.
inline std::vector<index_type> uneven_documents(index_type N) {
  std::vector<index_type> off{0};
  for (index_type cut : {N / 5, N / 5 + 1, N / 2 + 3})
    if (cut > off.back() && cut < N) off.push_back(cut);
  off.push_back(N);
  return off;
}

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

namespace {
/// The planner's per-rank, per-step model against what the run did.
template <class Partition, class Schedule, class Mask>
void check_plan_matches_run(Mpi& comm, const Case& c, const Mask& mask) {
  const int P = comm.size(), rank = comm.rank();
  const index_type N = index_type(c.n_local) * P;
  V4<float> q("q", c.b, c.n_local, c.h, c.d), k("k", c.b, c.n_local, c.hkv, c.d),
      o("o", c.b, c.n_local, c.h, c.d);
  V3<float> lse("lse", c.b, c.h, c.n_local);
  DistributedAttention<Partition, Mask, Schedule, Mpi, ExecSpace> attn(comm, mask);
  DistributedOptions opts;
  opts.count_pairs = true;
  const RunStats run = attn.forward(q, k, k, o, lse, opts);
  const plan::Problem pb = plan::problem_for<float, ExecSpace>(N, P, c.b, c.h, c.hkv, c.d);
  plan::Hardware hw;
  const plan::Prediction pr = plan::predict<Partition, Schedule>(pb, mask, hw, true);
  REQUIRE(pr.valid);
  const plan::RankPlan& mine = pr.ranks[std::size_t(rank)];
  INFO("rank ", rank, "/", P, " ", Partition::name(), " ", Schedule::name());
  CHECK(pb.block_q == run.block_q);
  CHECK(pb.block_k == run.block_k);
  CHECK(mine.workspace_bytes == run.workspace_bytes);
  REQUIRE(mine.steps.size() == run.steps.size());
  for (std::size_t s = 0; s < run.steps.size(); ++s) {
    INFO("step ", s);
    CHECK(mine.steps[s].bytes_sent == run.steps[s].bytes_sent);
    CHECK(mine.steps[s].bytes_received == run.steps[s].bytes_received);
    CHECK(mine.steps[s].tiles.full == run.steps[s].tiles.full);
    CHECK(mine.steps[s].tiles.partial == run.steps[s].tiles.partial);
    CHECK(mine.steps[s].tiles.allowed_pairs == run.steps[s].tiles.allowed_pairs);
    CHECK(mine.steps[s].idle() == !run.steps[s].computed);
  }
}
}  // namespace

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

HostTensor host_of(const V4<double>& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  HostTensor t(int(v.extent(0)), int(v.extent(1)), int(v.extent(2)), int(v.extent(3)));
  // Index by (b, n, h, d): V4 has the memory space's default layout
  // (LayoutLeft on GPUs), HostTensor is row-major.
  for (int a = 0; a < t.b; ++a)
    for (int n = 0; n < t.n; ++n)
      for (int x = 0; x < t.h; ++x)
        for (int d = 0; d < t.d; ++d) t(a, n, x, d) = h(a, n, x, d);
  return t;
}

/// Distributed backward of one (schedule, partition, mask) against the fp64
/// naive gradients of the global sequence, on this rank's rows.
template <class T, class Schedule, class Partition, class Mask>
void check_backward(Mpi& comm, const Case& c, const Mask& mask, std::uint64_t seed) {
  const int P = comm.size(), rank = comm.rank(), N = c.n_local * P;
  // Global inputs (same on all ranks), rounded to T.
  V4<double> gq("q", c.b, N, c.h, c.d), gk("k", c.b, N, c.hkv, c.d), gv("v", c.b, N, c.hkv, c.d),
      gdo("do", c.b, N, c.h, c.d);
  fill_random(gq, seed);
  fill_random(gk, seed + 1);
  fill_random(gv, seed + 2);
  fill_random(gdo, seed + 3);
  auto to_t = [](const V4<double>& x) {
    V4<T> y("y", x.extent(0), x.extent(1), x.extent(2), x.extent(3));
    auto xh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
    auto yh = Kokkos::create_mirror_view(y);
    for (std::size_t i = 0; i < xh.size(); ++i) {
      yh.data()[i] = T(xh.data()[i]);
      xh.data()[i] = double(yh.data()[i]);
    }
    Kokkos::deep_copy(y, yh);
    Kokkos::deep_copy(x, xh);
    return y;
  };
  V4<T> tq = to_t(gq), tk = to_t(gk), tv = to_t(gv), tdo = to_t(gdo);
  const ReferenceGrads ref = reference_backward(host_of(gq), host_of(gk), host_of(gv), host_of(gdo),
                                                mask, 1.0 / std::sqrt(double(c.d)));
  // This rank's part, forward then backward.
  const int n = c.n_local;
  V4<T> q("q", c.b, n, c.h, c.d), k("k", c.b, n, c.hkv, c.d), v("v", c.b, n, c.hkv, c.d),
      o("o", c.b, n, c.h, c.d), dout("do", c.b, n, c.h, c.d), dq("dq", c.b, n, c.h, c.d),
      dk("dk", c.b, n, c.hkv, c.d), dv("dv", c.b, n, c.hkv, c.d);
  V3<T> lse("lse", c.b, c.h, n);
  to_local<Partition>(ExecSpace{}, P, rank, tq, q);
  to_local<Partition>(ExecSpace{}, P, rank, tk, k);
  to_local<Partition>(ExecSpace{}, P, rank, tv, v);
  to_local<Partition>(ExecSpace{}, P, rank, tdo, dout);
  DistributedAttention<Partition, Mask, Schedule, Mpi, ExecSpace> attn(comm, mask);
  attn.forward(q, k, v, o, lse);
  attn.backward(q, k, v, o, lse, dout, dq, dk, dv);
  Kokkos::fence();
  // Compare with the reference rows this rank owns.
  const auto map = Partition::positions(N, P, rank);
  auto check = [&](const V4<T>& got, const HostTensor& want, const char* name) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), got);
    double num = 0, den = 0;
    bool finite = true;
    for (int b = 0; b < want.b; ++b)
      for (int i = 0; i < n; ++i)
        for (int x = 0; x < want.h; ++x)
          for (int d = 0; d < want.d; ++d) {
            const double g = double(h(b, i, x, d)), w = want(b, int(map(i)), x, d);
            finite = finite && std::isfinite(g);
            num = std::max(num, std::abs(g - w));
          }
    for (double w : want.data) den = std::max(den, std::abs(w));
    const double tol = std::is_same<T, double>::value ? 1e-11 : 1e-4;
    INFO("rank ", rank, "/", P, " ", std::string(Schedule::name()), " ",
         std::string(Partition::name()), " ", std::string(name), " rel err ", num / den);
    CHECK(finite);
    CHECK(num <= tol * den);
  };
  check(dq, ref.dq, "dq");
  check(dk, ref.dk, "dk");
  check(dv, ref.dv, "dv");
}

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
