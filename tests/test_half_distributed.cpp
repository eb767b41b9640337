// SPDX-License-Identifier: Apache-2.0
// bf16 and fp16 storage under the distributed schedules (K/V and Q travel in
// 16 bits; partial results, the O sum and gradient partials in fp32): every
// schedule, forward and backward, against the fp64 reference of the rounded
// inputs, with a bound that does not depend on P. The same global problem
// (N = 1680, a multiple of 2P for P = 1 ... 8) runs at every P of the ctests
// distributed_*_np1 ... np8, and rank 0 prints the largest error at that P,
// so that the error can be compared across P (it must not grow with P).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <algorithm>
#include <cmath>
#include <string>

#include "backend.hpp"
#include "distributed_check.hpp"
#include "forward_check.hpp"
#include "reference.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

/// One schedule x partition in storage type S: forward and backward on this
/// communicator against the fp64 reference. Bounds (test_half_attention.cpp):
/// the fp32 bound e32 plus one rounding to S of the largest entry,
///   O:  e32 + u16 (max|O| + e32) + 2^-25 (half fp16's smallest subnormal),
///   dQ, dK, dV: e32g + u16 (max|g| + e32g) + 2^-25 with e32g = 1e-4 max|g|;
/// LSE stays fp32: e32; plus the fused bound's term where the host matrix
/// engine runs. None depends on P: partial results and gradient sums stay
/// fp32 across ranks and are rounded to S once.
template <class S, class Partition, class Schedule>
void check_half(Mpi& comm, const Case& c, const GlobalProblem& g) {
  const int P = comm.size(), rank = comm.rank();
  const index_type N = g.q.n;
  const int n = c.n_local;
  const V4<S> q = local_rows<S, Partition>(g.q, P, rank),
              k = local_rows<S, Partition>(g.k, P, rank),
              v = local_rows<S, Partition>(g.v, P, rank),
              dout = local_rows<S, Partition>(g.dout, P, rank);
  V4<S> o("o", c.b, n, c.h, c.d), dq("dq", c.b, n, c.h, c.d), dk("dk", c.b, n, c.hkv, c.d),
      dv("dv", c.b, n, c.hkv, c.d);
  V3<float> lse("lse", c.b, c.h, n);
  DistributedAttention<Partition, CausalMask, Schedule, Mpi, ExecSpace> attn(comm);
  const RunStats fwd = attn.forward(q, k, v, o, lse);
  const RunStats bwd = attn.backward(q, k, v, o, lse, dout, dq, dk, dv);
  Kokkos::fence();
  const ScheduleContext ctx = schedule_context<Partition>(CausalMask{}, N, P);
  CHECK(int(fwd.steps.size()) == schedule_steps<Schedule>(ctx));
  CHECK(int(bwd.steps.size()) == Schedule::backward_type::steps(ctx));

  const auto map = Partition::positions(N, P, rank);
  bool finite = true;
  double so[2] = {0, 0}, sg[2] = {0, 0};
  const double eo = max_error(o, g.ref.o, map, finite, so);
  double el = 0.0;
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  for (int b = 0; b < c.b; ++b)
    for (int x = 0; x < c.h; ++x)
      for (int i = 0; i < n; ++i) {
        const double w = g.ref.lse[(std::size_t(b) * c.h + x) * std::size_t(N) + map(i)];
        el = std::max(el, std::abs(double(lh(b, x, i)) - w));
      }
  const double eg = std::max({max_error(dq, g.grads.dq, map, finite, sg),
                              max_error(dk, g.grads.dk, map, finite, sg),
                              max_error(dv, g.grads.dv, map, finite, sg)});
  const double gmax =
      std::max({largest(g.grads.dq), largest(g.grads.dk), largest(g.grads.dv), 1e-300});
  const double e32 = tolerance<float>(g.ref, c.d, int(N)), e32g = 1e-4 * gmax;
  const double sub = 2.9802322387695312e-08, u = S::unit_roundoff;
  // bf16 on the host matrix engine (AMX): P (and in the backward dS) rounded
  // to bf16 before their products, the fused bound's 2 u max|V| and 2 u max|g|
  // more (test_half_attention.cpp, fused_bound).
  const bool engine = std::is_same<S, bf16>::value && impl::is_host_space_v<ExecSpace> &&
                      dispatched_host_isa() == HostIsa::avx512 &&
                      impl::matrix_path(HostMatrix::automatic) != impl::MatrixPath::none;
  const double bound_o =
      e32 + u * (largest(g.ref.o) + e32) + sub + (engine ? 2 * u * largest(g.v) : 0.0);
  const double bound_g = e32g + u * (gmax + e32g) + sub + (engine ? 2 * u * gmax : 0.0);
  // The worst rank's errors and the mean errors, reported once per P.
  const double wo = comm.allreduce(eo, ReduceOp::max), wl = comm.allreduce(el, ReduceOp::max),
               wg = comm.allreduce(eg, ReduceOp::max);
  double sums[4] = {so[0], so[1], sg[0], sg[1]}, all[4];
  comm.allreduce(sums, all, 4, ReduceOp::sum);
  if (rank == 0)
    MESSAGE(std::string(value_type_name<S>()), " ", std::string(Schedule::name()), " + ",
            std::string(Partition::name()), " P=", P, ": O max ", wo, " (", wo / bound_o,
            " of the bound) mean ", all[0] / all[1], "; LSE max ", wl, "; grads max/max|g| ",
            wg / gmax, " (", wg / bound_g, " of the bound) mean/max|g| ", all[2] / all[3] / gmax);
  INFO("rank ", rank, "/", P, " ", std::string(value_type_name<S>()), " ",
       std::string(Schedule::name()), " ", std::string(Partition::name()), " o ", eo, "/", bound_o,
       " lse ", el, "/", e32, " grad ", eg, "/", bound_g);
  CHECK(finite);
  CHECK(eo <= bound_o);
  CHECK(el <= e32);
  CHECK(eg <= bound_g);
}

// GQA (2 query heads per K/V head), a head dim that is padded in the packed
// blocks, and N = 1680: a multiple of 2P for every P = 1 ... 8.
constexpr int global_n = 1680;

template <class S>
void check_every_schedule(Mpi& comm) {
  const int P = comm.size();
  REQUIRE(global_n % (2 * P) == 0);
  const Case c{1, global_n / P, 2, 1, 40};
  const GlobalProblem g = global_problem<S>(c.b, global_n, c.h, c.hkv, c.d, CausalMask{}, 20261123);
  check_half<S, ZigzagPartition, RingSchedule>(comm, c, g);
  check_half<S, StripedPartition, BurstSchedule>(comm, c, g);
  check_half<S, ContiguousPartition, BalancedSchedule>(comm, c, g);
  check_half<S, ContiguousPartition, AllGatherSchedule>(comm, c, g);
}

}  // namespace

TEST_CASE("16-bit storage: distributed bf16 error within the P-independent bound") {
  Mpi comm(MPI_COMM_WORLD);
  check_every_schedule<bf16>(comm);
}

TEST_CASE("16-bit storage: distributed fp16 error within the P-independent bound") {
  Mpi comm(MPI_COMM_WORLD);
  check_every_schedule<fp16>(comm);
}
