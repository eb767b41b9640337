// SPDX-License-Identifier: Apache-2.0
// The planner against the run, for every schedule: the workspace each rank
// allocates, the bytes it sends and receives and the tiles it computes at each
// step are what plan::predict() reads from the schedule's description. Linked
// into the multi-rank binary (ctest distributed_*: P = 1..4, and P = 5).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include "backend.hpp"
#include "distributed_check.hpp"
#include "user_masks.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

/// The planner's per-rank, per-step model against what the run did.
/// N = n_local P + extra: with extra > 0 local lengths differ between ranks.
template <class Partition, class Schedule, class Mask, class T = float>
RunStats check_plan_matches_run(Mpi& comm, const Case& c, const Mask& mask, T = {},
                                index_type extra = 0) {
  const int P = comm.size(), rank = comm.rank();
  const index_type N = index_type(c.n_local) * P + extra;
  const int n = int(local_length<Partition>(N, P, rank));
  V4<T> q("q", c.b, n, c.h, c.d), k("k", c.b, n, c.hkv, c.d), o("o", c.b, n, c.h, c.d);
  V3<compute_t<T>> lse("lse", c.b, c.h, n);
  DistributedAttention<Partition, Mask, Schedule, Mpi, ExecSpace> attn(comm, mask);
  DistributedOptions opts;
  opts.count_pairs = true;
  const RunStats run = attn.forward(q, k, k, o, lse, opts);
  const plan::Problem pb = plan::problem_for<T, ExecSpace>(N, P, c.b, c.h, c.hkv, c.d);
  plan::Hardware hw;
  const plan::Prediction pr = plan::predict<Partition, Schedule>(pb, mask, hw, true);
  REQUIRE(pr.valid);
  const plan::RankPlan& mine = pr.ranks[std::size_t(rank)];
  INFO("rank ", rank, "/", P, " ", Partition::name(), " ", Schedule::name(), " ",
       std::string(value_type_name<T>()), " N = ", N);
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
  return run;
}

/// The same for the backward (plan::Pass::backward): the workspace, bytes
/// and tiles per step of the schedule's backward description, at the
/// backward kernels' tile sizes. Values do not matter here (zeros).
template <class Partition, class Schedule, class Mask, class T = float>
void check_backward_plan(Mpi& comm, const Case& c, const Mask& mask, T = {}, index_type extra = 0) {
  const int P = comm.size(), rank = comm.rank();
  const index_type N = index_type(c.n_local) * P + extra;
  const int n = int(local_length<Partition>(N, P, rank));
  V4<T> q("q", c.b, n, c.h, c.d), k("k", c.b, n, c.hkv, c.d), o("o", c.b, n, c.h, c.d),
      dq("dq", c.b, n, c.h, c.d), dk("dk", c.b, n, c.hkv, c.d), dv("dv", c.b, n, c.hkv, c.d);
  V3<compute_t<T>> lse("lse", c.b, c.h, n);
  DistributedAttention<Partition, Mask, Schedule, Mpi, ExecSpace> attn(comm, mask);
  DistributedOptions opts;
  opts.count_pairs = true;
  const RunStats run = attn.backward(q, k, k, o, lse, o, dq, dk, dv, opts);
  plan::Problem pb = plan::problem_for<T, ExecSpace>(N, P, c.b, c.h, c.hkv, c.d);
  pb.pass = plan::Pass::backward;
  const plan::Prediction pr = plan::predict<Partition, Schedule>(pb, mask, plan::Hardware{}, true);
  REQUIRE(pr.valid);
  const plan::RankPlan& mine = pr.ranks[std::size_t(rank)];
  INFO("backward, rank ", rank, "/", P, " ", Partition::name(), " ", Schedule::name(), " ",
       std::string(value_type_name<T>()), " N = ", N);
  CHECK(pb.backward_block_q() == run.block_q);
  CHECK(pb.backward_block_k() == run.block_k);
  CHECK(mine.workspace_bytes == run.workspace_bytes);
  REQUIRE(mine.steps.size() == run.steps.size());
  std::int64_t sent = 0;
  for (std::size_t s = 0; s < run.steps.size(); ++s) {
    INFO("step ", s);
    CHECK(mine.steps[s].bytes_sent == run.steps[s].bytes_sent);
    CHECK(mine.steps[s].bytes_received == run.steps[s].bytes_received);
    CHECK(mine.steps[s].tiles.full == run.steps[s].tiles.full);
    CHECK(mine.steps[s].tiles.partial == run.steps[s].tiles.partial);
    CHECK(mine.steps[s].tiles.allowed_pairs == run.steps[s].tiles.allowed_pairs);
    CHECK(mine.steps[s].idle() == !run.steps[s].computed);
    sent += run.steps[s].bytes_sent;
  }
  CHECK(mine.bytes_sent() == sent);
}

// Local lengths not multiples of the tile sizes.
const Case cases[] = {{1, 74, 1, 1, 64}, {2, 38, 2, 1, 40}, {1, 130, 2, 2, 128}};

}  // namespace

TEST_CASE("planner: workspace, bytes and tiles per step equal the run's (every schedule)") {
  Mpi comm(MPI_COMM_WORLD);
  for (const Case& c : cases) {
    check_plan_matches_run<ContiguousPartition, RingSchedule>(comm, c, CausalMask{});
    check_plan_matches_run<StripedPartition, RingSchedule>(comm, c, CausalMask{});
    check_plan_matches_run<ZigzagPartition, RingSchedule>(comm, c, causal_window(40));
    check_plan_matches_run<ContiguousPartition, BalancedSchedule>(comm, c, CausalMask{});
    check_plan_matches_run<ContiguousPartition, BalancedSchedule>(comm, c, causal_window(40));
    check_plan_matches_run<ContiguousPartition, AllGatherSchedule>(comm, c, CausalMask{});
    check_plan_matches_run<ZigzagPartition, AllGatherSchedule>(comm, c, causal_window(40));
    // A window the ring and the all-gather stop early for (fewer steps).
    check_plan_matches_run<ContiguousPartition, RingSchedule>(comm, c, causal_window(20));
    check_plan_matches_run<ContiguousPartition, AllGatherSchedule>(comm, c, causal_window(20));
    check_plan_matches_run<StripedPartition, AllGatherSchedule>(comm, c, FullMask{});
  }
}

TEST_CASE("planner: lengths that differ between ranks, and ranks without a token") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  // 74 P + 1 .. 74 P + 2P - 1 tokens: ranks one or two tokens apart (zigzag);
  // then N = P - 1 (the last rank holds nothing) and N = 1.
  for (index_type extra : {index_type(1), index_type(2 * P - 1)}) {
    const Case c{1, 74, 2, 1, 64};
    check_plan_matches_run<ContiguousPartition, RingSchedule>(comm, c, CausalMask{}, 0.f, extra);
    check_plan_matches_run<StripedPartition, RingSchedule>(comm, c, CausalMask{}, 0.f, extra);
    check_plan_matches_run<ZigzagPartition, RingSchedule>(comm, c, causal_window(40), 0.f, extra);
    check_plan_matches_run<ContiguousPartition, BalancedSchedule>(comm, c, CausalMask{}, 0.f,
                                                                  extra);
    check_plan_matches_run<ZigzagPartition, AllGatherSchedule>(comm, c, causal_window(40), 0.f,
                                                               extra);
  }
  for (index_type N : {index_type(P > 1 ? P - 1 : 1), index_type(1)}) {
    const Case c{1, 0, 1, 1, 8};
    check_plan_matches_run<ContiguousPartition, RingSchedule>(comm, c, CausalMask{}, 0.f, N);
    check_plan_matches_run<ContiguousPartition, AllGatherSchedule>(comm, c, CausalMask{}, 0.f, N);
    check_plan_matches_run<ContiguousPartition, BalancedSchedule>(comm, c, CausalMask{}, 0.f, N);
  }
}

TEST_CASE("planner: bf16 storage, and ring bytes per step halve against fp32") {
  Mpi comm(MPI_COMM_WORLD);
  for (const Case& c : cases) {
    const RunStats f32 =
        check_plan_matches_run<ZigzagPartition, RingSchedule>(comm, c, CausalMask{});
    const RunStats b16 =
        check_plan_matches_run<ZigzagPartition, RingSchedule>(comm, c, CausalMask{}, bf16{});
    check_plan_matches_run<ContiguousPartition, BalancedSchedule>(comm, c, CausalMask{}, bf16{});
    check_plan_matches_run<ContiguousPartition, AllGatherSchedule>(comm, c, causal_window(40),
                                                                   bf16{});
    // K/V travel in 16 bits: each step sends half the bytes of the fp32 run.
    REQUIRE(f32.steps.size() == b16.steps.size());
    for (std::size_t s = 0; s < f32.steps.size(); ++s) {
      CHECK(2 * b16.steps[s].bytes_sent == f32.steps[s].bytes_sent);
      CHECK(2 * b16.steps[s].bytes_received == f32.steps[s].bytes_received);
    }
  }
}

TEST_CASE("planner: the backward's workspace, bytes and tiles per step equal the run's") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  for (const Case& c : cases) {
    check_backward_plan<ContiguousPartition, RingSchedule>(comm, c, CausalMask{});
    check_backward_plan<ZigzagPartition, RingSchedule>(comm, c, causal_window(40));
    check_backward_plan<ZigzagPartition, BurstSchedule>(comm, c, CausalMask{});
    check_backward_plan<StripedPartition, BurstSchedule>(comm, c, FullMask{});
    check_backward_plan<ContiguousPartition, BalancedSchedule>(comm, c, CausalMask{});
    check_backward_plan<ContiguousPartition, AllGatherSchedule>(comm, c, causal_window(20));
    check_backward_plan<ZigzagPartition, AllGatherSchedule>(comm, c, CausalMask{});
    // 16-bit storage: K/V and the packed queries travel in 16 bits, the
    // partial gradients and the own sums in fp32.
    check_backward_plan<ZigzagPartition, RingSchedule>(comm, c, CausalMask{}, bf16{});
    check_backward_plan<ZigzagPartition, BurstSchedule>(comm, c, CausalMask{}, fp16{});
    check_backward_plan<ContiguousPartition, BalancedSchedule>(comm, c, CausalMask{}, bf16{});
    check_backward_plan<ContiguousPartition, AllGatherSchedule>(comm, c, causal_window(40), bf16{});
  }
  // Ranks of different lengths, a rank without a token, and a window that
  // stops the rings early.
  const Case c{1, 74, 2, 1, 64};
  check_backward_plan<ZigzagPartition, RingSchedule>(comm, c, CausalMask{}, 0.f, 2 * P - 1);
  check_backward_plan<ContiguousPartition, BurstSchedule>(comm, c, causal_window(20), 0.f, 1);
  check_backward_plan<ContiguousPartition, BalancedSchedule>(comm, c, CausalMask{}, 0.f, 3);
  const Case e{1, 0, 1, 1, 8};
  check_backward_plan<ContiguousPartition, RingSchedule>(comm, e, CausalMask{}, 0.f,
                                                         P > 1 ? P - 1 : 1);
}
