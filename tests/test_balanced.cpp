// SPDX-License-Identifier: Apache-2.0
// BalancedSchedule (DistFlashAttn) across ranks: forward and backward equal the
// fp64 reference, its steps follow the paper's task model, and it rejects on
// every rank a mask it cannot balance. P = 1..5 (odd P > 3 has helpers at floor(P/2)).
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

// Local lengths are even (zigzag) and not multiples of the tile sizes.
const Case cases[] = {{1, 74, 1, 1, 64}, {2, 38, 2, 1, 40}, {1, 130, 2, 2, 128}};

}  // namespace

// Each mask in one value type, the types alternating over the masks and
// between forward and backward (compile time: one instantiation each).
TEST_CASE("balanced schedule equals single-device forward") {
  Mpi comm(MPI_COMM_WORLD);
  std::uint64_t seed = 5000;
  for (const Case& c : cases) {
    const index_type N = index_type(c.n_local) * comm.size();
    check_against_single<double, ContiguousPartition, BalancedSchedule>(comm, c, CausalMask{},
                                                                        seed += 10);
    check_against_single<float, ContiguousPartition, BalancedSchedule>(
        comm, c, causal_window(N / 3), seed += 10);
    check_against_single<double, ContiguousPartition, BalancedSchedule>(
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

TEST_CASE("balanced backward matches the fp64 gradients") {
  Mpi comm(MPI_COMM_WORLD);
  const Case cases2[] = {{1, 38, 2, 1, 40}, {2, 70, 1, 1, 64}, {1, 130, 2, 2, 128}};
  std::uint64_t seed = 7000;
  for (const Case& c : cases2) {
    const index_type N = index_type(c.n_local) * comm.size();
    check_backward<float, BalancedSchedule, ContiguousPartition>(comm, c, CausalMask{}, seed += 10);
    check_backward<double, BalancedSchedule, ContiguousPartition>(comm, c, causal_window(N / 3),
                                                                  seed += 10);
    check_backward<float, BalancedSchedule, ContiguousPartition>(
        comm, c, test::DocumentCausalMask{N / 3 + 1}, seed += 10);
    const Documents<MemSpace> docs(uneven_documents(N));
    check_backward<double, BalancedSchedule, ContiguousPartition>(comm, c, docs.mask(), seed += 10);
  }
}
