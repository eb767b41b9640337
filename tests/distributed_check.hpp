// SPDX-License-Identifier: Apache-2.0
// The checks of the multi-rank tests (one file per schedule or topic include
// it): the distributed forward against the single-device forward of the same
// global sequence, the distributed backward against the fp64 gradients.
#pragma once

#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "forward_check.hpp"
#include "reference.hpp"

namespace blockattn::test {

// The transfer mode of the communicator under test: HostStaged by default;
// GpuAware for the device builds' CUDA-aware MPI variant (CMake option
// BLOCKATTN_TEST_GPU_AWARE_MPI).
#ifndef BLOCKATTN_TEST_TRANSFER
#define BLOCKATTN_TEST_TRANSFER HostStaged
#endif
using Mpi = MpiCommunicator<BLOCKATTN_TEST_TRANSFER>;

template <class T>
using V4 = Kokkos::View<T****, MemSpace>;
template <class T>
using V3 = Kokkos::View<T***, MemSpace>;

/// x in value type S: exact for an x already rounded to S (rounded_to);
/// the 16-bit types convert through fp32.
template <class S>
S value_of(double x) {
  if constexpr (std::is_same<S, double>::value)
    return x;
  else
    return S(float(x));
}

/// A global tensor rounded to S (exactly what the kernels see).
template <class S>
HostTensor rounded_to(HostTensor t) {
  if constexpr (!std::is_same<S, double>::value)
    for (double& x : t.data) x = double(value_of<S>(x));
  return t;
}

/// This rank's n rows of a global tensor: local row i is global row map(i).
/// Built on the host from the layout's definition, independent of to_local().
template <class S, class Map>
V4<S> local_rows(const HostTensor& t, index_type n, const Map& map) {
  V4<S> v("local", t.b, n, t.h, t.d);
  auto h = Kokkos::create_mirror_view(v);
  for (int b = 0; b < t.b; ++b)
    for (index_type i = 0; i < n; ++i)
      for (int x = 0; x < t.h; ++x)
        for (int d = 0; d < t.d; ++d) h(b, i, x, d) = value_of<S>(t(b, int(map(i)), x, d));
  Kokkos::deep_copy(v, h);
  return v;
}

/// The rows of a partition's local order.
template <class S, class Partition>
V4<S> local_rows(const HostTensor& t, int P, int rank) {
  return local_rows<S>(t, local_length<Partition>(t.n, P, rank),
                       Partition::positions(t.n, P, rank));
}

/// max |got - want| over this rank's rows, local row i against global row
/// map(i); `finite` turns false on a non-finite entry; with `sum`, adds the
/// errors to sum[0] and their count to sum[1].
template <class View, class Map>
double max_error(const View& got, const HostTensor& want, const Map& map, bool& finite,
                 double* sum = nullptr) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), got);
  double err = 0.0;
  for (int b = 0; b < want.b; ++b)
    for (int i = 0; i < int(got.extent(1)); ++i)
      for (int x = 0; x < want.h; ++x)
        for (int d = 0; d < want.d; ++d) {
          const double g = double(h(b, i, x, d)), e = std::abs(g - want(b, int(map(i)), x, d));
          finite = finite && std::isfinite(g);
          err = std::max(err, e);
          if (sum) {
            sum[0] += e;
            sum[1] += 1.0;
          }
        }
  return err;
}

/// The largest |entry| of a tensor (at least 1e-300, a safe divisor).
inline double largest(const HostTensor& t) {
  double m = 1e-300;
  for (double x : t.data) m = std::max(m, std::abs(x));
  return m;
}

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
  CHECK(int(stats.steps.size()) ==
        schedule_steps<Schedule>(schedule_context<Partition>(mask, N, P)));
  // Busy time is a part of each step's wall time.
  for (const StepStats& st : stats.steps) {
    CHECK(st.compute_seconds >= 0.0);
    CHECK(st.compute_seconds <= st.seconds);
  }

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

inline HostTensor host_of(const V4<double>& v) {
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
/// The distributed backward (after its forward) against the fp64 gradients of
/// the global sequence; returns the backward's RunStats.
template <class T, class Schedule, class Partition, class Mask>
RunStats check_backward(Mpi& comm, const Case& c, const Mask& mask, std::uint64_t seed) {
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
  const RunStats stats = attn.backward(q, k, v, o, lse, dout, dq, dk, dv);
  Kokkos::fence();
  CHECK(int(stats.steps.size()) ==
        Schedule::backward_type::steps(schedule_context<Partition>(mask, N, P)));
  for (const StepStats& st : stats.steps) {
    CHECK(st.compute_seconds >= 0.0);
    CHECK(st.compute_seconds <= st.seconds);
  }
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
  return stats;
}

/// A case's global inputs, the same on every rank, rounded to S (the
/// reference sees exactly what the kernels see), and their fp64 reference.
struct GlobalProblem {
  HostTensor q, k, v, dout;
  ReferenceResult ref;
  ReferenceGrads grads;
};
template <class S, class Mask>
GlobalProblem global_problem(int b, int N, int h, int hkv, int d, const Mask& mask,
                             std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  GlobalProblem g;
  g.q = rounded_to<S>(random_tensor(b, N, h, d, rng));
  g.k = rounded_to<S>(random_tensor(b, N, hkv, d, rng));
  g.v = rounded_to<S>(random_tensor(b, N, hkv, d, rng));
  g.dout = rounded_to<S>(random_tensor(b, N, h, d, rng));
  const double scale = 1.0 / std::sqrt(double(d));
  g.ref = reference_attention(g.q, g.k, g.v, mask, scale);
  g.grads = reference_backward(g.q, g.k, g.v, g.dout, mask, scale);
  return g;
}

/// A distributed forward and backward of this rank's rows (local row i at
/// global row map(i)) against the fp64 reference of the global sequence,
/// with the head-parallel tests' bounds: forward_check.hpp's for fp64 / fp32,
/// gradients 1e-11 / 1e-4 of the largest entry; 16-bit storage adds one
/// rounding of O and `grad_roundings` of the gradients (a replicated K/V
/// head's partials may arrive rounded before their sum). `what` names the
/// case in the failure report.
template <class S, class Map, class OV, class LV, class GQ, class GK>
void check_against_reference(const ReferenceResult& ref, const ReferenceGrads& grads,
                             const Map& map, int N, const OV& o, const LV& lse, const GQ& dq,
                             const GK& dk, const GK& dv, int grad_roundings,
                             const std::string& what) {
  const int b = int(o.extent(0)), n = int(o.extent(1)), h = int(o.extent(2)), d = int(o.extent(3));
  bool finite = true;
  const double eo = max_error(o, ref.o, map, finite);
  double el = 0.0;
  bool lse_pattern = true;
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  for (int a = 0; a < b; ++a)
    for (int x = 0; x < h; ++x)
      for (int i = 0; i < n; ++i) {
        const double got = double(lh(a, x, i)),
                     want = ref.lse[(std::size_t(a) * h + x) * std::size_t(N) + map(i)];
        if (std::isinf(want) || std::isinf(got)) {
          lse_pattern = lse_pattern && got == want;
          continue;
        }
        el = std::max(el, std::abs(got - want));
      }
  const double eg =
      std::max({max_error(dq, grads.dq, map, finite), max_error(dk, grads.dk, map, finite),
                max_error(dv, grads.dv, map, finite)});
  const double gmax = std::max({largest(grads.dq), largest(grads.dk), largest(grads.dv)});
  const bool fp64 = std::is_same<S, double>::value;
  const double tf = fp64 ? tolerance<double>(ref, d, N) : tolerance<float>(ref, d, N);
  double to = tf, tg = (fp64 ? 1e-11 : 1e-4) * gmax;
  if constexpr (is_half_storage_v<S>) {
    to += S::unit_roundoff * (largest(ref.o) + tf);
    tg += grad_roundings * S::unit_roundoff * (gmax + tg);
  }
  INFO(what, " ", std::string(value_type_name<S>()), " H=", h, " D=", d, " n=", n, ": o ", eo, "/",
       to, " lse ", el, "/", tf, " grads ", eg, "/", tg);
  CHECK(finite);
  CHECK(lse_pattern);
  CHECK(eo <= to);
  CHECK(el <= tf);
  CHECK(eg <= tg);
}

}  // namespace blockattn::test
