// SPDX-License-Identifier: Apache-2.0
// Score policies and attention sinks under every distributed schedule: the
// forward (O, LSE) and backward (dQ, dK, dV, dL/dsinks) of this rank's rows
// against the fp64 reference of the global sequence with the modification
// applied. Every pair of a policy (SoftCap, Alibi, a user policy) and a mask
// (causal, sliding window, documents) runs under one of the schedules (KV
// ring, Q ring, balanced, all-gather, Ulysses, the 2D hybrid where P allows
// it), each with and without sinks; sinks also with a plain window; bf16
// under the KV ring and Ulysses (the host matrix engine's backward).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>
#include <blockattn/schedule/allgather.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "distributed_check.hpp"
#include "reference.hpp"
#include "score_policies.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

constexpr int H = 4, HKV = 2, D = 32;

/// The global problem (the same on every rank) and its fp64 answers.
struct Problem {
  int N;
  HostTensor q, k, v, dout;
  std::vector<double> sinks;
};

/// Inputs rounded to T (fp32, or bf16 for the 16-bit cases): the reference
/// sees exactly what the kernels see.
template <class T = float>
Problem problem(int N, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p{N, {}, {}, {}, {}, {0.5, -1.0, 2.0, -0.25}};
  p.q = rounded_to<T>(random_tensor(1, N, H, D, rng, 2.0));
  p.k = rounded_to<T>(random_tensor(1, N, HKV, D, rng, 2.0));
  p.v = rounded_to<T>(random_tensor(1, N, HKV, D, rng));
  p.dout = rounded_to<T>(random_tensor(1, N, H, D, rng));
  return p;
}

/// Runs attn.forward and attn.backward on this rank's n rows (local row i is
/// global row map(i)) in value type T and checks them against the fp64
/// reference. Bounds: fp32 compute against fp64, relative to the largest
/// entry, as test_score.cpp (1e-4 for O and the gradients, 1e-4 absolute for
/// LSE; dL/dsinks is summed over every row in double and returned in fp32);
/// bf16: outputs rounded to bf16 and, on a host matrix engine, P and dS
/// rounded before their products: test_score.cpp's 3e-2 for O, the
/// gradients and dL/dsinks (the reference's D = rowsum(dO o O) from the exact
/// O: the stored O's rounding is within it), 1e-4 for LSE (fp32).
template <class T = float, class Attn, class Mask, class Map>
void check(Attn& attn, const Mask& mask, const Problem& p, index_type n, const Map& map,
           bool with_sinks, const char* what) {
  const int rank = attn.communicator().rank(), P = attn.communicator().size();
  const double scale = 1.0 / std::sqrt(double(D));
  const std::vector<double>* sv = with_sinks ? &p.sinks : nullptr;
  const ReferenceResult ref = reference_attention(p.q, p.k, p.v, mask, scale, 0, 0, sv);
  const ReferenceGrads g =
      reference_backward(p.q, p.k, p.v, p.dout, mask, scale, 0, 0, nullptr, sv);

  const V4<T> q = local_rows<T>(p.q, n, map), k = local_rows<T>(p.k, n, map),
              v = local_rows<T>(p.v, n, map), dout = local_rows<T>(p.dout, n, map);
  V4<T> o("o", 1, n, H, D), dq("dq", 1, n, H, D), dk("dk", 1, n, HKV, D), dv("dv", 1, n, HKV, D);
  V3<float> lse("lse", 1, H, n);
  Kokkos::View<float*, MemSpace> sinks("sinks", H), sink_grad("sink_grad", H);
  auto sh = Kokkos::create_mirror_view(sinks);
  for (int h = 0; h < H; ++h) sh(h) = float(p.sinks[std::size_t(h)]);
  Kokkos::deep_copy(sinks, sh);
  DistributedOptions opts;
  if (with_sinks) {
    opts.sinks = sinks;
    opts.sink_grad = sink_grad;
  }
  attn.forward(q, k, v, o, lse, opts);
  attn.backward(q, k, v, o, lse, dout, dq, dk, dv, opts);
  Kokkos::fence();

  bool finite = true;
  const double eo = max_error(o, ref.o, map, finite) / largest(ref.o);
  const double eq = max_error(dq, g.dq, map, finite) / largest(g.dq);
  // dK, dV: this rank's key rows are its own rows (q, k, v hold the same tokens).
  const double ek = max_error(dk, g.dk, map, finite) / largest(g.dk);
  const double ev = max_error(dv, g.dv, map, finite) / largest(g.dv);
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  double el = 0.0;
  bool lse_pattern = true;
  for (int h = 0; h < H; ++h)
    for (index_type i = 0; i < n; ++i) {
      const double want = ref.lse[std::size_t(h) * std::size_t(p.N) + std::size_t(map(i))];
      const double got = double(lh(0, h, i));
      if (std::isinf(want))
        lse_pattern = lse_pattern && got == want;
      else
        el = std::max(el, std::abs(got - want));
    }
  double es = 0.0;
  if (with_sinks) {
    auto gh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), sink_grad);
    double den = 1e-300;
    for (int h = 0; h < H; ++h) {
      es = std::max(es, std::abs(double(gh(h)) - g.dsink[std::size_t(h)]));
      den = std::max(den, std::abs(g.dsink[std::size_t(h)]));
    }
    es /= den;
  }
  const std::string name(what);  // (INFO would print a char pointer's address)
  INFO("rank ", rank, "/", P, " ", name, " sinks ", with_sinks, " N ", p.N, ": o ", eo, " lse ", el,
       " dq ", eq, " dk ", ek, " dv ", ev, " dsink ", es);
  const double tol = std::is_same<T, float>::value ? 1e-4 : 3e-2;
  CHECK(finite);
  CHECK(lse_pattern);
  CHECK(eo <= tol);
  CHECK(el <= 1e-4);
  CHECK(eq <= tol);
  CHECK(ek <= tol);
  CHECK(ev <= tol);
  CHECK(es <= tol);
}

template <class Partition, class Schedule, class T = float, class Mask>
void sequence_parallel(Mpi& comm, const Mask& mask, const Problem& p, const char* what) {
  const int P = comm.size(), rank = comm.rank();
  DistributedAttention<Partition, Mask, Schedule, Mpi, ExecSpace> attn(comm, mask);
  for (const bool sinks : {false, true})
    check<T>(attn, mask, p, local_length<Partition>(p.N, P, rank),
             Partition::positions(p.N, P, rank), sinks, what);
}

template <class T = float, class Mask>
void ulysses(Mpi& comm, const Mask& mask, const Problem& p, const char* what) {
  const int P = comm.size(), rank = comm.rank();
  if (!UlyssesHeads::why_not(H, HKV, P).empty()) return;  // the heads do not split over P
  UlyssesAttention<ContiguousPartition, Mask, Mpi, ExecSpace> attn(comm, mask);
  for (const bool sinks : {false, true})
    check<T>(attn, mask, p, local_length<ContiguousPartition>(p.N, P, rank),
             ContiguousPartition::positions(p.N, P, rank), sinks, what);
}

template <class Mask>
void hybrid(Mpi& comm, const Mask& mask, const Problem& p, const char* what) {
  const int P = comm.size(), rank = comm.rank();
  if (P % 2 != 0) return;  // groups of 2 ranks
  const HybridGrid g = HybridGrid::make(P, 2);
  if (!hybrid_length_why_not<ZigzagPartition>(p.N, g).empty()) return;
  HybridAttention<ZigzagPartition, Mask, RingSchedule, Mpi, ExecSpace> attn(comm, 2, mask);
  for (const bool sinks : {false, true})
    check(attn, mask, p, hybrid_length<ZigzagPartition>(p.N, g, rank),
          hybrid_position_map<ZigzagPartition>(p.N, g, rank), sinks, what);
}

/// Every (policy, mask) pair once, spread over the schedules: the KV ring,
/// the Q ring and the balanced schedule take two pairs each, the all-gather,
/// Ulysses and the hybrid one each; the head-parallel ones take the policies
/// that depend on the head (ALiBi, the per-head temperature), where a wrong
/// global head shows. (Every pair under every schedule compiles 54 drivers,
/// 103 s of compile instead of 54 s; the kernels a pair runs on are the same under
/// every schedule, and sinks run under all of them.)
void every_pair(Mpi& comm, const Problem& p) {
  const Documents<MemSpace> docs(uneven_documents(p.N));
  const SoftCap cap{1.5};
  const Alibi alibi = Alibi::geometric(H);
  const HeadTemperature temp{0.25};
  sequence_parallel<StripedPartition, RingSchedule>(comm, with_score(CausalMask{}, cap), p,
                                                    "KV ring, striped, softcap, causal");
  sequence_parallel<StripedPartition, RingSchedule>(comm, with_score(causal_window(13), alibi), p,
                                                    "KV ring, striped, ALiBi, window");
  sequence_parallel<ZigzagPartition, BurstSchedule>(comm, with_score(docs.mask(), temp), p,
                                                    "Q ring, zigzag, user, documents");
  sequence_parallel<ZigzagPartition, BurstSchedule>(comm, with_score(causal_window(13), cap), p,
                                                    "Q ring, zigzag, softcap, window");
  sequence_parallel<ContiguousPartition, BalancedSchedule>(comm, with_score(docs.mask(), alibi), p,
                                                           "balanced, ALiBi, documents");
  sequence_parallel<ContiguousPartition, BalancedSchedule>(comm, with_score(CausalMask{}, temp), p,
                                                           "balanced, user, causal");
  sequence_parallel<ContiguousPartition, AllGatherSchedule>(comm, with_score(docs.mask(), cap), p,
                                                            "all-gather, softcap, documents");
  ulysses(comm, with_score(CausalMask{}, alibi), p, "Ulysses, ALiBi, causal");
  hybrid(comm, with_score(causal_window(13), temp), p, "hybrid 2 x P/2, user, window");
}

#ifdef BLOCKATTN_SCORE_EVERY_SCHEDULE
/// Every (policy, mask) pair under every schedule: 54 drivers (103 s of
/// compile time against the CI test's 54 s), so not in CI's build: target
/// blockattn_test_score_every_schedule (tests/README.md).
template <class Mask>
void every_schedule(Mpi& comm, const Mask& mask, const Problem& p, const std::string& what) {
  const std::string w[6] = {"KV ring, striped, ", "Q ring, zigzag, ", "balanced, ",
                            "all-gather, ",       "Ulysses, ",        "hybrid 2 x P/2, "};
  sequence_parallel<StripedPartition, RingSchedule>(comm, mask, p, (w[0] + what).c_str());
  sequence_parallel<ZigzagPartition, BurstSchedule>(comm, mask, p, (w[1] + what).c_str());
  sequence_parallel<ContiguousPartition, BalancedSchedule>(comm, mask, p, (w[2] + what).c_str());
  sequence_parallel<ContiguousPartition, AllGatherSchedule>(comm, mask, p, (w[3] + what).c_str());
  ulysses(comm, mask, p, (w[4] + what).c_str());
  hybrid(comm, mask, p, (w[5] + what).c_str());
}

template <class Score>
void every_mask(Mpi& comm, const Score& score, const Problem& p, const std::string& what) {
  const Documents<MemSpace> docs(uneven_documents(p.N));
  every_schedule(comm, with_score(CausalMask{}, score), p, what + ", causal");
  every_schedule(comm, with_score(causal_window(13), score), p, what + ", window");
  every_schedule(comm, with_score(docs.mask(), score), p, what + ", documents");
}
#endif

}  // namespace

#ifdef BLOCKATTN_SCORE_EVERY_SCHEDULE
TEST_CASE("every score policy and mask under every schedule matches the fp64 reference") {
  Mpi comm(MPI_COMM_WORLD);
  const Problem p = problem(20 * comm.size() * (comm.size() % 2 == 0 ? 1 : 2), 2031);
  every_mask(comm, SoftCap{1.5}, p, "softcap");
  every_mask(comm, Alibi::geometric(H), p, "ALiBi");
  every_mask(comm, HeadTemperature{0.25}, p, "user");
}
#endif

TEST_CASE("score policies and sinks under every schedule match the fp64 reference") {
  Mpi comm(MPI_COMM_WORLD);
  // 20 tokens per rank, a multiple of 2P for the zigzag layouts.
  const Problem p = problem(20 * comm.size() * (comm.size() % 2 == 0 ? 1 : 2), 2027);
  every_pair(comm, p);
  // Sinks with a plain sliding window (gpt-oss's combination), no policy.
  sequence_parallel<StripedPartition, RingSchedule>(comm, causal_window(13), p,
                                                    "KV ring, striped, window only");
  sequence_parallel<ContiguousPartition, BalancedSchedule>(comm, causal_window(13), p,
                                                           "balanced, window only");
}

TEST_CASE("bf16 score policies under the KV ring and Ulysses match the fp64 reference") {
  // bf16 storage: on a CPU with a host matrix engine (AMX, AMD's
  // AVX512-BF16) the step loops' backward block pairs run on it with the
  // policy's pass on the global positions of each pair (the KV ring's striped
  // blocks) and the global heads (Ulysses' head offset, ALiBi's slopes);
  // elsewhere on the fp32 kernels.
  Mpi comm(MPI_COMM_WORLD);
  const Problem p = problem<bf16>(40 * comm.size(), 2029);
  sequence_parallel<StripedPartition, RingSchedule, bf16>(
      comm, with_score(CausalMask{}, SoftCap{1.5}), p, "bf16 KV ring, striped, softcap, causal");
  ulysses<bf16>(comm, with_score(CausalMask{}, Alibi::geometric(H)), p, "bf16 Ulysses, ALiBi");
}

TEST_CASE("sinks and score policies that differ between ranks are errors on every rank") {
  Mpi comm(MPI_COMM_WORLD);
  if (comm.size() < 2) return;
  const int P = comm.size(), rank = comm.rank(), n = 8;
  V4<float> q("q", 1, n, H, D), k("k", 1, n, HKV, D), v("v", 1, n, HKV, D), o("o", 1, n, H, D);
  V3<float> lse("lse", 1, H, n);
  Kokkos::View<float*, MemSpace> sinks("sinks", H);
  Kokkos::deep_copy(sinks, rank == P - 1 ? 1.0f : 0.5f);
  DistributedOptions opts;
  opts.sinks = sinks;
  DistributedAttention<ContiguousPartition, ScoredMask<CausalMask, SoftCap>, RingSchedule, Mpi,
                       ExecSpace>
      attn(comm, with_score(CausalMask{}, SoftCap{rank == 0 ? 20.0 : 30.0}));
  std::string error;
  try {
    attn.forward(q, k, v, o, lse, opts);
  } catch (const invalid_argument& e) {
    error = e.what();
  }
  INFO(error);
  CHECK(error.find("mask value differs between ranks") != std::string::npos);
  CHECK(error.find("options.sinks") != std::string::npos);
  // The policy's parameters readable: the mask, then the policy with its values.
  CHECK(error.find("CausalMask{} with SoftCap{20} on rank 0") != std::string::npos);
  CHECK(error.find("CausalMask{} with SoftCap{30} on rank") != std::string::npos);
}
