// SPDX-License-Identifier: Apache-2.0
// The dispatcher is the one seam (kernel/dispatch.hpp): a block-product
// implementation written in this file alone, registered through
// BlockProductImplementation (kernel/block_implementation.hpp) for a mask type
// of its own, computes every block pair of every entry point and schedule at
// P = 1 ... 4 (ctest seam_np*): attention_forward / attention_backward, the KV
// ring, the Q ring, the balanced and all-gather schedules, Ulysses and the
// hybrid, forward and backward, fp32 and bf16, against the fp64 reference,
// with its pairs counted as BlockPath::user and no pair left to the kernels.
//
// The implementation is a reference: one thread per row, every logit and sum
// in fp64, straight from the definition (P = exp(scale q.k - LSE), dS = P o
// (dP - D)). BLOCKATTN_SEAM_PERTURB=1 adds 1e-3 to every O it writes and to
// every dQ entry (the suite must then fail: checked once by hand, see the
// issue note).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>

#include "backend.hpp"
#include "distributed_check.hpp"
#include "forward_check.hpp"
#include "reference.hpp"

namespace seam {

/// The mask the implementation is registered for: causal, under a type of its own.
struct SeamMask : blockattn::CausalMask {};

/// Calls of the implementation (forward, backward) in this process.
inline std::atomic<long> forward_calls{0}, backward_calls{0};

inline double perturbation() {
  static const double p = std::getenv("BLOCKATTN_SEAM_PERTURB") ? 1e-3 : 0.0;
  return p;
}

/// P and dS of query row i (head h) and key j (kv head hk) of a backward
/// pair, in fp64 (lse: the row's, finite).
template <class Call>
KOKKOS_INLINE_FUNCTION void p_and_ds(const Call& c, int b, int i, int h, int j, int hk, double lse,
                                     double& p, double& ds) {
  double s = 0.0, dp = 0.0;
  for (int d = 0; d < c.extents.dim; ++d) {
    s += double(c.q(b, i, h, d)) * double(c.k(b, j, hk, d));
    dp += double(c.dout(b, i, h, d)) * double(c.v(b, j, hk, d));
  }
  p = std::exp(double(c.scale) * s - lse);
  ds = p * (dp - double(c.delta(b, h, i)));
}

/// Rows of a forward pair: online softmax in fp64 over the keys the mask allows.
template <class Call>
struct ForwardRows {
  Call c;
  double bump;
  KOKKOS_INLINE_FUNCTION void operator()(int b, int i, int h) const {
    using T = typename Call::compute_type;
    const int D = c.extents.dim, G = c.extents.heads / c.extents.kv_heads, hk = h / G;
    double m = -blockattn::impl::infinity<double>(), l = 0.0, acc[blockattn::max_head_dim];
    for (int d = 0; d < D; ++d) acc[d] = 0.0;
    for (int j = 0; j < c.extents.keys; ++j) {
      if (!c.mask.allowed(c.qpos(i), c.kpos(j))) continue;
      double s = 0.0;
      for (int d = 0; d < D; ++d) s += double(c.q(b, i, h, d)) * double(c.k(b, j, hk, d));
      s *= double(c.scale);
      const double mn = s > m ? s : m, a = std::exp(m - mn), p = std::exp(s - mn);
      l = l * a + p;
      for (int d = 0; d < D; ++d) acc[d] = acc[d] * a + p * double(c.v(b, j, hk, d));
      m = mn;
    }
    for (int d = 0; d < D; ++d) c.o(b, i, h, d) = T(l > 0.0 ? acc[d] / l + bump : 0.0);
    c.lse(b, h, i) = l > 0.0 ? T(m + std::log(l)) : -blockattn::impl::infinity<T>();
  }
};

/// dQ of a backward pair's rows (one thread per query row).
template <class Call>
struct BackwardRows {
  Call c;
  double bump;
  KOKKOS_INLINE_FUNCTION void operator()(int b, int i, int h) const {
    using T = typename Call::compute_type;
    const int D = c.extents.dim, G = c.extents.heads / c.extents.kv_heads, hk = h / G;
    const double lse = double(c.lse(b, h, i)), scale = double(c.scale);
    if (lse == -blockattn::impl::infinity<double>()) return;
    for (int j = 0; j < c.extents.keys; ++j) {
      if (!c.mask.allowed(c.qpos(i), c.kpos(j))) continue;
      double p, ds;
      p_and_ds(c, b, i, h, j, hk, lse, p, ds);
      for (int d = 0; d < D; ++d) c.dq(b, i, h, d) += T(scale * ds * double(c.k(b, j, hk, d)));
    }
    for (int d = 0; d < D; ++d) c.dq(b, i, h, d) += T(bump);
  }
};

/// dK, dV of a backward pair's keys (one thread per key row and kv head).
template <class Call>
struct BackwardKeys {
  Call c;
  KOKKOS_INLINE_FUNCTION void operator()(int b, int j, int hk) const {
    using T = typename Call::compute_type;
    const int D = c.extents.dim, G = c.extents.heads / c.extents.kv_heads;
    const double scale = double(c.scale);
    for (int h = hk * G; h < (hk + 1) * G; ++h)
      for (int i = 0; i < c.extents.queries; ++i) {
        const double lse = double(c.lse(b, h, i));
        if (lse == -blockattn::impl::infinity<double>()) continue;
        if (!c.mask.allowed(c.qpos(i), c.kpos(j))) continue;
        double p, ds;
        p_and_ds(c, b, i, h, j, hk, lse, p, ds);
        for (int d = 0; d < D; ++d) {
          c.dk(b, j, hk, d) += T(scale * ds * double(c.q(b, i, h, d)));
          c.dv(b, j, hk, d) += T(p * double(c.dout(b, i, h, d)));
        }
      }
  }
};

struct Reference {
  template <class Exec, class Call>
  static bool forward(const Exec& exec, const Call& c) {
    const auto& e = c.extents;
    Kokkos::parallel_for("seam::forward",
                         Kokkos::MDRangePolicy<Exec, Kokkos::Rank<3>>(
                             exec, {0, 0, 0}, {e.batch, e.queries, e.heads}),
                         ForwardRows<Call>{c, perturbation()});
    ++forward_calls;
    return true;
  }
  template <class Exec, class Call>
  static bool backward(const Exec& exec, const Call& c) {
    const auto& e = c.extents;
    Kokkos::parallel_for("seam::backward_rows",
                         Kokkos::MDRangePolicy<Exec, Kokkos::Rank<3>>(
                             exec, {0, 0, 0}, {e.batch, e.queries, e.heads}),
                         BackwardRows<Call>{c, perturbation()});
    Kokkos::parallel_for("seam::backward_keys",
                         Kokkos::MDRangePolicy<Exec, Kokkos::Rank<3>>(
                             exec, {0, 0, 0}, {e.batch, e.keys, e.kv_heads}),
                         BackwardKeys<Call>{c});
    ++backward_calls;
    return true;
  }
};

}  // namespace seam

/// The registration: the whole of what a new implementation adds to BlockAttn.
template <class V>
struct blockattn::BlockProductImplementation<blockattn::test::ExecSpace, V, seam::SeamMask>
    : seam::Reference {
  static constexpr bool available = true;
};

using namespace blockattn;
using namespace blockattn::test;
using seam::SeamMask;

namespace {

/// A forward and backward of one driver (its own local rows and map) against
/// the fp64 reference; every computed step on the registered implementation.
template <class S, class Run>
void check_driver(Mpi& comm, int N, int h, int hkv, const Run& run, const std::string& what) {
  const GlobalProblem g = global_problem<S>(1, N, h, hkv, 32, SeamMask{}, 77 + std::uint64_t(N));
  const long f0 = seam::forward_calls, b0 = seam::backward_calls;
  run(g.q, g.k, g.v, g.dout,
      [&](const auto& map, const auto& o, const auto& lse, const auto& dq, const auto& dk,
          const auto& dv, const RunStats& fs, const RunStats& bs) {
        check_against_reference<S>(
            g.ref, g.grads, map, N, o, lse, dq, dk, dv, 2,
            what + " rank " + std::to_string(comm.rank()) + "/" + std::to_string(comm.size()));
        for (const RunStats* st : {&fs, &bs}) {
          int computed = 0;
          for (const auto& s : st->steps) computed += s.computed ? 1 : 0;
          const BlockPathCounts c = st->paths();
          INFO(what, ": user ", c.user, " portable ", c.portable, " of ", computed, " computed");
          CHECK(c.user == computed);
          CHECK(c.portable == 0);
          CHECK(c.fused == 0);
        }
      });
  // Some rank computed pairs on it, forward and backward.
  CHECK(comm.allreduce(long(seam::forward_calls - f0), ReduceOp::sum) > 0);
  CHECK(comm.allreduce(long(seam::backward_calls - b0), ReduceOp::sum) > 0);
}

/// DistributedAttention with a partition and schedule.
template <class S, class Partition, class Schedule>
void check_schedule(Mpi& comm, int n_local, int h, int hkv) {
  const int P = comm.size(), rank = comm.rank(), N = n_local * P;
  check_driver<S>(
      comm, N, h, hkv,
      [&](const HostTensor& q, const HostTensor& k, const HostTensor& v, const HostTensor& dout,
          const auto& verify) {
        using C = compute_t<S>;
        const int n = int(local_length<Partition>(N, P, rank));
        const V4<S> ql = local_rows<S, Partition>(q, P, rank),
                    kl = local_rows<S, Partition>(k, P, rank),
                    vl = local_rows<S, Partition>(v, P, rank),
                    dol = local_rows<S, Partition>(dout, P, rank);
        V4<S> o("o", 1, n, h, q.d), dq("dq", 1, n, h, q.d), dk("dk", 1, n, hkv, q.d),
            dv("dv", 1, n, hkv, q.d);
        V3<C> lse("lse", 1, h, n);
        DistributedAttention<Partition, SeamMask, Schedule, Mpi, ExecSpace> attn(comm);
        const RunStats fs = attn.forward(ql, kl, vl, o, lse);
        const RunStats bs = attn.backward(ql, kl, vl, o, lse, dol, dq, dk, dv);
        Kokkos::fence();
        verify(Partition::positions(N, P, rank), o, lse, dq, dk, dv, fs, bs);
      },
      std::string(Schedule::name()) + " + " + Partition::name());
}

template <class S>
void check_ulysses(Mpi& comm, int n_local, int h, int hkv) {
  const int P = comm.size(), rank = comm.rank(), N = n_local * P;
  check_driver<S>(
      comm, N, h, hkv,
      [&](const HostTensor& q, const HostTensor& k, const HostTensor& v, const HostTensor& dout,
          const auto& verify) {
        using C = compute_t<S>;
        using Part = ZigzagPartition;
        const int n = int(local_length<Part>(N, P, rank));
        const V4<S> ql = local_rows<S, Part>(q, P, rank), kl = local_rows<S, Part>(k, P, rank),
                    vl = local_rows<S, Part>(v, P, rank), dol = local_rows<S, Part>(dout, P, rank);
        V4<S> o("o", 1, n, h, q.d), dq("dq", 1, n, h, q.d), dk("dk", 1, n, hkv, q.d),
            dv("dv", 1, n, hkv, q.d);
        V3<C> lse("lse", 1, h, n);
        UlyssesAttention<Part, SeamMask, Mpi, ExecSpace> attn(comm);
        const RunStats fs = attn.forward(ql, kl, vl, o, lse);
        const RunStats bs = attn.backward(ql, kl, vl, o, lse, dol, dq, dk, dv);
        Kokkos::fence();
        verify(Part::positions(N, P, rank), o, lse, dq, dk, dv, fs, bs);
      },
      "ulysses");
}

/// The hybrid on the grid with `ulysses` ranks per group (zigzag ring across).
template <class S>
void check_hybrid(Mpi& comm, int n_local, int h, int hkv, int ulysses) {
  const int P = comm.size(), rank = comm.rank(), N = n_local * P;
  check_driver<S>(
      comm, N, h, hkv,
      [&](const HostTensor& q, const HostTensor& k, const HostTensor& v, const HostTensor& dout,
          const auto& verify) {
        using C = compute_t<S>;
        using Part = ZigzagPartition;
        const HybridGrid g = HybridGrid::make(P, ulysses);
        const auto map = hybrid_position_map<Part>(N, g, rank);
        const int n = int(hybrid_length<Part>(N, g, rank));
        const auto rows = [&](const HostTensor& t) { return local_rows<S>(t, n, map); };
        const V4<S> ql = rows(q), kl = rows(k), vl = rows(v), dol = rows(dout);
        V4<S> o("o", 1, n, h, q.d), dq("dq", 1, n, h, q.d), dk("dk", 1, n, hkv, q.d),
            dv("dv", 1, n, hkv, q.d);
        V3<C> lse("lse", 1, h, n);
        HybridAttention<Part, SeamMask, RingSchedule, Mpi, ExecSpace> attn(comm, ulysses);
        const RunStats fs = attn.forward(ql, kl, vl, o, lse);
        const RunStats bs = attn.backward(ql, kl, vl, o, lse, dol, dq, dk, dv);
        Kokkos::fence();
        verify(map, o, lse, dq, dk, dv, fs, bs);
      },
      "hybrid " + std::to_string(ulysses) + "x" + std::to_string(P / ulysses));
}

}  // namespace

TEST_CASE("seam: one device, attention_forward and attention_backward") {
  const int N = 45, h = 4, hkv = 2, d = 32;
  std::mt19937_64 rng(5);
  HostTensor q = random_tensor(1, N, h, d, rng), k = random_tensor(1, N, hkv, d, rng),
             v = random_tensor(1, N, hkv, d, rng), dout = random_tensor(1, N, h, d, rng);
  V4<float> qd("q", 1, N, h, d), kd("k", 1, N, hkv, d), vd("v", 1, N, hkv, d),
      dod("do", 1, N, h, d), o("o", 1, N, h, d), dq("dq", 1, N, h, d), dk("dk", 1, N, hkv, d),
      dv("dv", 1, N, hkv, d);
  V3<float> lse("lse", 1, h, N);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  upload(dout, dod);
  ForwardOptions opts;
  BlockPathCounts paths;
  opts.paths = &paths;
  opts.q_offset = 7;  // the implementation sees global positions
  opts.k_offset = 7;
  attention_forward(ExecSpace{}, qd, kd, vd, o, lse, SeamMask{}, opts);
  attention_backward(ExecSpace{}, qd, kd, vd, o, lse, dod, dq, dk, dv, SeamMask{}, opts);
  Kokkos::fence();
  CHECK(paths.user == 2);
  CHECK(paths.portable == 0);
  const double scale = 1.0 / std::sqrt(double(d));
  const ReferenceResult ref = reference_attention(q, k, v, SeamMask{}, scale, 7, 7);
  const ReferenceGrads grads = reference_backward(q, k, v, dout, SeamMask{}, scale, 7, 7);
  check_against_reference<float>(
      ref, grads, [](index_type i) { return i; }, N, o, lse, dq, dk, dv, 1, "one device");
  // portable_only skips it: the kernels' result, within the same bounds.
  BlockPathCounts kernels;
  opts.paths = &kernels;
  opts.portable_only = true;
  attention_forward(ExecSpace{}, qd, kd, vd, o, lse, SeamMask{}, opts);
  attention_backward(ExecSpace{}, qd, kd, vd, o, lse, dod, dq, dk, dv, SeamMask{}, opts);
  Kokkos::fence();
  CHECK(kernels.user == 0);
  CHECK(kernels.portable == 2);
  check_against_reference<float>(
      ref, grads, [](index_type i) { return i; }, N, o, lse, dq, dk, dv, 1,
      "one device, portable_only");
}

TEST_CASE("seam: every schedule on the registered implementation, fp32 and bf16") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size();
  check_schedule<float, ZigzagPartition, RingSchedule>(comm, 13, 4, 2);
  check_schedule<float, StripedPartition, BurstSchedule>(comm, 13, 4, 2);
  check_schedule<float, ContiguousPartition, BalancedSchedule>(comm, 13, 4, 2);
  check_schedule<float, ZigzagPartition, AllGatherSchedule>(comm, 13, 4, 2);
  check_schedule<bf16, ZigzagPartition, RingSchedule>(comm, 13, 4, 2);
  check_schedule<bf16, ContiguousPartition, BalancedSchedule>(comm, 13, 4, 2);
  // Heads Ulysses splits over every P = 1 ... 4: 12 query heads over 12 K/V
  // heads (sharded) or one (replicated on every rank).
  check_ulysses<float>(comm, 10, 12, 12);
  check_ulysses<bf16>(comm, 10, 12, 1);
  for (int a = 1; a <= P; ++a)
    if (P % a == 0) check_hybrid<float>(comm, 10, 12, 1, a);
}
