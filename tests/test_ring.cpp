// SPDX-License-Identifier: Apache-2.0
// RingSchedule (Ring Attention, KV-ring backward) and BurstSchedule (BurstAttention,
// Q-ring backward) across ranks: forward and backward equal the single-device
// fp64 reference for every partition x mask (fp64 and fp32 alternating over
// the combinations: each in one type), and the bytes and steps they report
// are the papers' (and the planner's). Linked with test_balanced.cpp and
// test_distributed.cpp into one binary per backend; run under mpiexec (ctest: 1..4).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "distributed_check.hpp"
#include "reference.hpp"
#include "user_masks.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

/// The value type of the i-th combination: fp64 and fp32 alternate over the
/// (partition, mask) and (schedule, partition, mask) combinations, so that
/// every combination runs once, and every partition, mask and schedule in
/// both types (one instantiation per combination instead of two: compile
/// time; both value types share the step loops, and test_random.cpp crosses
/// them at run time).
template <int I>
using TypeOf = std::conditional_t<I % 2 == 0, double, float>;

template <class Partition, int I, class Comm>
void all_masks(Comm comm, const Case& c, std::uint64_t seed) {
  const index_type N = index_type(c.n_local) * comm.size();
  check_against_single<TypeOf<I>, Partition>(comm, c, FullMask{}, seed);
  check_against_single<TypeOf<I + 1>, Partition>(comm, c, CausalMask{}, seed + 10);
  check_against_single<TypeOf<I + 2>, Partition>(comm, c, SlidingWindowMask{N / 5, N / 7},
                                                 seed + 20);
  check_against_single<TypeOf<I + 3>, Partition>(comm, c, PrefixLMMask{N / 3}, seed + 30);
  // Packed documents of uneven lengths (one of 1 token, one crossing ranks).
  const Documents<MemSpace> docs(uneven_documents(N));
  check_against_single<TypeOf<I + 4>, Partition>(comm, c, docs.mask(true, N / 4, 0), seed + 40);
}

// Local lengths are even (zigzag) and not multiples of the tile sizes.
const Case cases[] = {{1, 74, 1, 1, 64}, {2, 38, 2, 1, 40}, {1, 130, 2, 2, 128}};

}  // namespace

TEST_CASE("distributed forward equals single-device forward (fp64 and fp32 alternating)") {
  Mpi comm(MPI_COMM_WORLD);
  std::uint64_t seed = 100;
  for (const Case& c : cases) {
    all_masks<ContiguousPartition, 0>(comm, c, seed += 100);
    all_masks<StripedPartition, 1>(comm, c, seed += 100);
    all_masks<ZigzagPartition, 0>(comm, c, seed += 100);
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

// Bad arguments and configurations that differ between ranks: test_consensus.cpp.

namespace {

template <class Schedule, class Partition, int I>
void backward_all_masks(Mpi& comm, const Case& c, std::uint64_t seed) {
  const index_type N = index_type(c.n_local) * comm.size();
  check_backward<TypeOf<I>, Schedule, Partition>(comm, c, FullMask{}, seed);
  check_backward<TypeOf<I + 1>, Schedule, Partition>(comm, c, CausalMask{}, seed + 1);
  check_backward<TypeOf<I + 2>, Schedule, Partition>(comm, c, SlidingWindowMask{N / 5, N / 7},
                                                     seed + 2);
  check_backward<TypeOf<I + 3>, Schedule, Partition>(comm, c, PrefixLMMask{N / 3}, seed + 3);
}

/// Every partition x mask; the types alternate (the Q ring starts with the other).
template <class Schedule, int I>
void backward_all(Mpi& comm) {
  const Case cases2[] = {{1, 38, 2, 1, 40}, {2, 70, 1, 1, 64}};
  std::uint64_t seed = 900;
  for (const Case& c : cases2) {
    backward_all_masks<Schedule, ContiguousPartition, I>(comm, c, seed += 10);
    backward_all_masks<Schedule, StripedPartition, I + 1>(comm, c, seed += 10);
    backward_all_masks<Schedule, ZigzagPartition, I>(comm, c, seed += 10);
  }
}

}  // namespace

TEST_CASE("distributed backward (KV ring) matches the fp64 gradients") {
  Mpi comm(MPI_COMM_WORLD);
  backward_all<RingSchedule, 0>(comm);
}

TEST_CASE("distributed backward (Q ring) matches the fp64 gradients") {
  Mpi comm(MPI_COMM_WORLD);
  backward_all<BurstSchedule, 1>(comm);
}

TEST_CASE("KV ring backward with packed documents and a window (zigzag, fp64)") {
  Mpi comm(MPI_COMM_WORLD);
  const Case cases2[] = {{1, 38, 2, 1, 40}, {2, 70, 1, 1, 64}, {1, 130, 2, 2, 128}};
  std::uint64_t seed = 7000;
  for (const Case& c : cases2) {
    const index_type N = index_type(c.n_local) * comm.size();
    const Documents<MemSpace> docs(uneven_documents(N));
    check_backward<double, RingSchedule, ZigzagPartition>(comm, c, docs.mask(false, N / 3, N / 4),
                                                          seed += 50);
  }
}

namespace {

/// The ring reach by brute force on the mask's allowed() (not its classify):
/// the largest d such that some query of a rank x sees a key of rank x - d mod P.
template <class Partition, class Mask>
int brute_reach(const Mask& mask, index_type N, int P) {
  const index_type n = N / P;
  for (int d = P - 1; d > 0; --d)
    for (int x = 0; x < P; ++x) {
      const auto qp = Partition::positions(N, P, x);
      const auto kp = Partition::positions(N, P, ring_source(x, d, P));
      for (index_type i = 0; i < n; ++i)
        for (index_type j = 0; j < n; ++j)
          if (mask.allowed(qp(i), kp(j))) return d;
    }
  return 0;
}

/// A ring on a mask that reaches `reach` ranks back: forward and backward vs
/// the fp64 reference, reach + 1 steps, and each K/V block (or query block)
/// sent reach times.
template <class T, class Schedule, class Mask>
void check_short_ring(Mpi& comm, const Case& c, const Mask& mask, int reach, std::uint64_t seed) {
  const int P = comm.size();
  INFO(Schedule::name(), " P = ", P, " reach ", reach);
  const RunStats f = check_against_single<T, ContiguousPartition, Schedule>(comm, c, mask, seed);
  REQUIRE(int(f.steps.size()) == reach + 1);
  for (int s = 0; s <= reach; ++s) {
    CHECK(f.steps[std::size_t(s)].source == ring_source(comm.rank(), s, P));
    CHECK((f.steps[std::size_t(s)].bytes_sent > 0) == (s < reach));
  }
  if (reach > 0) CHECK(f.bytes_sent() == reach * f.steps[0].bytes_sent);
  const RunStats b = check_backward<T, Schedule, ContiguousPartition>(comm, c, mask, seed + 1);
  CHECK(int(b.steps.size()) == reach + 1);
}

}  // namespace

TEST_CASE("the rings stop where the mask stops: windows and documents") {
  // The KV ring in fp64, the Q ring in fp32.
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  const Case c{1, 48, 2, 1, 40};
  const index_type N = index_type(c.n_local) * P;
  std::uint64_t seed = 9100;
  // Causal windows of half a block, one block plus one token, two blocks.
  for (const index_type w :
       {index_type(c.n_local / 2), index_type(c.n_local + 1), index_type(2 * c.n_local)}) {
    const auto mask = causal_window(w);
    const int reach = brute_reach<ContiguousPartition>(mask, N, P);
    // Ring Attention's bound: ceil(w / c) + 1 steps at most.
    CHECK(reach + 1 <= std::min<index_type>(P, (w + c.n_local - 1) / c.n_local + 1));
    check_short_ring<double, RingSchedule>(comm, c, mask, reach, seed += 10);
    check_short_ring<float, BurstSchedule>(comm, c, mask, reach, seed += 10);
  }
  // Packed documents no longer than a block (lengths 1, 5, 48, 30, ...): the
  // K/V of a block go one rank on at most.
  std::vector<index_type> offsets{0};
  const index_type pattern[] = {1, 5, 48, 30, 17, 40};
  for (int i = 0; offsets.back() < N; ++i)
    offsets.push_back(std::min(offsets.back() + pattern[i % 6], N));
  const Documents<MemSpace> docs(offsets);
  const auto mask = docs.mask();
  const int reach = brute_reach<ContiguousPartition>(mask, N, P);
  CHECK(reach <= 1);
  check_short_ring<double, RingSchedule>(comm, c, mask, reach, seed += 10);
  check_short_ring<float, BurstSchedule>(comm, c, mask, reach, seed += 10);
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
