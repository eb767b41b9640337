// SPDX-License-Identifier: Apache-2.0
// The all-gather schedule (AllGatherSchedule), multi-rank: forward against
// the single-device forward and backward against the fp64 gradients, every
// partition, causal / window / prefix-LM / document masks (type combinations
// sampled, not crossed, to bound compile time); only the blocks the mask
// reaches travel; the planner's messages and workspace equal the run's.
// Run under mpiexec with any number of ranks (ctest: 1 to 5).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>
#include <blockattn/schedule/allgather.hpp>

#include "backend.hpp"
#include "distributed_check.hpp"
#include "reference.hpp"
#include "user_masks.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {
using AG = AllGatherSchedule;
// Local lengths not multiples of the tile sizes; GQA; the static head dims.
const Case ag_cases[] = {{1, 38, 2, 1, 40}, {1, 70, 2, 2, 64}, {2, 130, 1, 1, 128}};
}  // namespace

TEST_CASE("all-gather forward equals single-device forward (every partition and mask)") {
  Mpi comm(MPI_COMM_WORLD);
  std::uint64_t seed = 5000;
  for (const Case& c : ag_cases) {
    const index_type N = index_type(c.n_local) * comm.size();
    const Documents<MemSpace> docs(uneven_documents(N));
    check_against_single<double, ContiguousPartition, AG>(comm, c, CausalMask{}, seed += 50);
    check_against_single<double, StripedPartition, AG>(comm, c, CausalMask{}, seed += 50);
    check_against_single<double, ZigzagPartition, AG>(comm, c, causal_window(N / 3), seed += 50);
    check_against_single<double, ContiguousPartition, AG>(comm, c, docs.mask(true, N / 4, 0),
                                                          seed += 50);
    check_against_single<float, ZigzagPartition, AG>(comm, c, FullMask{}, seed += 50);
    check_against_single<float, StripedPartition, AG>(comm, c, PrefixLMMask{N / 3}, seed += 50);
  }
}

TEST_CASE("all-gather backward matches the fp64 gradients (every partition and mask)") {
  Mpi comm(MPI_COMM_WORLD);
  std::uint64_t seed = 7000;
  const Case cases2[] = {{1, 38, 2, 1, 40}, {2, 70, 1, 1, 64}};
  for (const Case& c : cases2) {
    const index_type N = index_type(c.n_local) * comm.size();
    const Documents<MemSpace> docs(uneven_documents(N));
    check_backward<double, AG, ContiguousPartition>(comm, c, CausalMask{}, seed += 10);
    check_backward<double, AG, StripedPartition>(comm, c, causal_window(N / 3), seed += 10);
    check_backward<double, AG, ZigzagPartition>(comm, c, FullMask{}, seed += 10);
    check_backward<double, AG, ContiguousPartition>(comm, c, docs.mask(true, N / 4, 0), seed += 10);
    check_backward<float, AG, ZigzagPartition>(comm, c, CausalMask{}, seed += 10);
  }
}

TEST_CASE("all-gather moves only the blocks the mask reaches") {
  // Contiguous causal: rank r needs the blocks of ranks 0 .. r - 1 and sends
  // its own to the P - 1 - r later ranks, all posted at step 0; steps whose
  // block is empty are idle.
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size(), rank = comm.rank();
  const Case c{1, 40, 2, 1, 64};
  const RunStats s = check_against_single<float, ContiguousPartition, AG>(comm, c, CausalMask{}, 1);
  REQUIRE(int(s.steps.size()) == P);
  std::int64_t sent = 0, received = 0;
  for (const StepStats& st : s.steps) {
    sent += st.bytes_sent;
    received += st.bytes_received;
  }
  const plan::Problem pb =
      plan::problem_for<float, ExecSpace>(index_type(c.n_local) * P, P, c.b, c.h, c.hkv, c.d);
  const std::int64_t block = plan::detail::packed_kv_bytes(pb);  // one packed K/V block
  CHECK(block > 0);
  CHECK(s.steps[0].bytes_sent == sent);  // everything posted at step 0
  CHECK(received == std::int64_t(rank) * block);
  CHECK(sent == std::int64_t(P - 1 - rank) * block);
  for (int t = 0; t < P; ++t) {
    INFO("step ", t);
    CHECK(s.steps[std::size_t(t)].computed == (t <= rank));
  }
}
