// SPDX-License-Identifier: Apache-2.0
// The invariant mode (ForwardOptions::invariant, kernel/invariant/): a row's
// O and LSE are the same bits however the work is split — query chunks, key
// extents, rank counts, partitions, schedules, entry points — and within the
// default's error bound of fp64.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend.hpp"
#include "distributed_check.hpp"
#include "forward_check.hpp"
#include "reference.hpp"
#include "user_masks.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

template <class T>
using Host4 = Kokkos::View<T****, Kokkos::LayoutRight, Kokkos::HostSpace>;

/// Rows [r0, r1) (dimension 1) of a host tensor, as a device View of T.
template <class T>
V4<T> rows_of(const HostTensor& t, int r0, int r1) {
  HostTensor s(t.b, r1 - r0, t.h, t.d);
  for (int a = 0; a < t.b; ++a)
    for (int n = r0; n < r1; ++n)
      for (int x = 0; x < t.h; ++x)
        for (int d = 0; d < t.d; ++d) s(a, n - r0, x, d) = t(a, n, x, d);
  V4<T> v("rows", t.b, r1 - r0, t.h, t.d);
  upload(s, v);
  return v;
}

/// The bytes of a host copy of a View (O or LSE).
template <class View>
std::vector<unsigned char> bytes_of(const View& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<unsigned char> b(h.span() * sizeof(typename View::non_const_value_type));
  std::memcpy(b.data(), h.data(), b.size());
  return b;
}

/// Row i of O (b, i, h, :) and LSE (b, h, i) of a forward, as bytes, for
/// comparing rows computed by different calls.
struct Rows {
  int b = 0, n = 0, h = 0, d = 0, osize = 0;
  std::vector<unsigned char> o, lse;  // (b, n, h, d) and (b, h, n) of the value types
  template <class OV, class LV>
  Rows(const OV& ov, const LV& lv)
      : b(int(ov.extent(0))),
        n(int(ov.extent(1))),
        h(int(ov.extent(2))),
        d(int(ov.extent(3))),
        osize(int(sizeof(typename OV::non_const_value_type))),
        o(bytes_of(ov)),
        lse(bytes_of(lv)) {}
  Rows() = default;
  /// Whether row i of this equals row j of other (all batches and heads).
  bool same_row(int i, const Rows& other, int j) const {
    for (int a = 0; a < b; ++a)
      for (int x = 0; x < h; ++x) {
        const std::size_t oi = ((std::size_t(a) * n + i) * h + x) * d * osize;
        const std::size_t oj = ((std::size_t(a) * other.n + j) * h + x) * d * osize;
        if (std::memcmp(&o[oi], &other.o[oj], std::size_t(d) * osize) != 0) return false;
        const std::size_t li = ((std::size_t(a) * h + x) * n + i) * 4;
        const std::size_t lj = ((std::size_t(a) * h + x) * other.n + j) * 4;
        if (std::memcmp(&lse[li], &other.lse[lj], 4) != 0) return false;
      }
    return true;
  }
};

template <class T, class Mask>
Rows invariant_call(const HostTensor& q, const HostTensor& k, const HostTensor& v, int q0, int q1,
                    int k0, int k1, const Mask& mask, ForwardOptions opts) {
  auto qd = rows_of<T>(q, q0, q1);
  auto kd = rows_of<T>(k, k0, k1);
  auto vd = rows_of<T>(v, k0, k1);
  V4<T> o("o", q.b, q1 - q0, q.h, q.d);
  V3<compute_t<T>> lse("lse", q.b, q.h, q1 - q0);
  opts.invariant = true;
  opts.q_offset = q0;
  opts.k_offset = k0;
  attention_forward(ExecSpace{}, qd, kd, vd, o, lse, mask, opts);
  Kokkos::fence();
  return Rows(o, lse);
}

/// The fp64 reference's error budget for T (see forward_check.hpp), plus the
/// rounding of a 16-bit O.
template <class T>
double invariant_tolerance(const ReferenceResult& ref, int dim, int keys) {
  double t = tolerance<float>(ref, dim, keys);
  if constexpr (!std::is_same<T, float>::value) t += T::unit_roundoff + subnormal_error<T>();
  return t;
}

template <class T, class Mask>
void check_against_reference(const Mask& mask, const Shape& s, int tile,
                             const std::vector<double>* sinks = nullptr) {
  CAPTURE(describe(s));
  CAPTURE(tile);
  std::mt19937_64 rng(7 + s.nq + s.d);
  HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng);
  HostTensor k = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  HostTensor v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  auto qd = rows_of<T>(q, 0, s.nq);  // rounds q, k, v to T in place
  auto kd = rows_of<T>(k, 0, s.nk);
  auto vd = rows_of<T>(v, 0, s.nk);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  V4<T> o("o", s.b, s.nq, s.h, s.d);
  V3<compute_t<T>> lse("lse", s.b, s.h, s.nq);
  ForwardOptions opts;
  opts.invariant = true;
  opts.invariant_tile = tile;
  Kokkos::View<float*, MemSpace> sk("sinks", sinks ? sinks->size() : 0);
  if (sinks) {
    auto h = Kokkos::create_mirror_view(sk);
    for (std::size_t x = 0; x < sinks->size(); ++x) h(x) = float((*sinks)[x]);
    Kokkos::deep_copy(sk, h);
    opts.sinks = sk;
  }
  attention_forward(ExecSpace{}, qd, kd, vd, o, lse, mask, opts);
  Kokkos::fence();
  const double scale = 1.0 / std::sqrt(double(s.d));
  const ReferenceResult ref = reference_attention(q, k, v, mask, scale, 0, 0, sinks);
  const ErrorReport r = compare(ref, o, lse);
  const double tol = invariant_tolerance<T>(ref, s.d, s.nk);
  CHECK(r.finite);
  CHECK(r.masked_rows_exact);
  CHECK(r.o_err <= tol);
  CHECK(r.lse_err <= tol);
}

}  // namespace

TEST_CASE("invariant: one device against fp64 (masks, score policy, sinks, fp32 / bf16 / fp16)") {
  const Shape shapes[] = {{1, 70, 70, 2, 1, 64}, {2, 37, 130, 2, 2, 40}, {1, 96, 96, 4, 2, 128}};
  for (const Shape& s : shapes)
    for (int tile : {1, 16, 64}) {
      check_against_reference<float>(FullMask{}, s, tile);
      check_against_reference<float>(CausalMask{}, s, tile);
      check_against_reference<bf16>(SlidingWindowMask{20, 0}, s, tile);
      check_against_reference<fp16>(with_score(CausalMask{}, SoftCap{8.0}), s, tile);
    }
  const std::vector<double> sinks = {0.5, -1.0, 2.0, -30.0};
  check_against_reference<float>(CausalMask{}, {1, 50, 50, 4, 2, 32}, 16, &sinks);
  Documents<MemSpace> docs(std::vector<index_type>{0, 13, 14, 60, 100});
  check_against_reference<bf16>(docs.mask(), {1, 100, 100, 2, 1, 64}, 16);
}

TEST_CASE("invariant: a row's bits do not depend on the query chunks or the keys beyond it") {
  // Prefill in chunks (queries [c0, c1) against the keys [0, c1), as a cache
  // holds them) against the whole call: every row the same bits.
  const int n = 150, b = 1, h = 4, hkv = 2, d = 64;
  std::mt19937_64 rng(11);
  HostTensor q = random_tensor(b, n, h, d, rng);
  HostTensor k = random_tensor(b, n, hkv, d, rng);
  HostTensor v = random_tensor(b, n, hkv, d, rng);
  for (int tile : {1, 32, 64}) {
    CAPTURE(tile);
    ForwardOptions opts;
    opts.invariant_tile = tile;
    const auto mask = with_score(CausalMask{}, SoftCap{10.0});
    const Rows whole = invariant_call<float>(q, k, v, 0, n, 0, n, mask, opts);
    for (int chunk : {1, 7, 64}) {
      CAPTURE(chunk);
      int differ = 0;
      for (int c0 = 0; c0 < n; c0 += chunk) {
        const int c1 = std::min(n, c0 + chunk);
        const Rows part = invariant_call<float>(q, k, v, c0, c1, 0, c1, mask, opts);
        for (int i = c0; i < c1; ++i) differ += whole.same_row(i, part, i - c0) ? 0 : 1;
      }
      CHECK(differ == 0);
    }
    // bf16 under a window: the keys given start at a tile boundary before the
    // window (the keys before it hidden anyway).
    const SlidingWindowMask w{40, 0};
    const Rows wb = invariant_call<bf16>(q, k, v, 0, n, 0, n, w, opts);
    int differ = 0;
    for (int c0 = 96; c0 < n; c0 += 7) {
      // The keys from the tile boundary at or before the window's start.
      const int c1 = std::min(n, c0 + 7), k0 = (c0 - 40) / tile * tile;
      const Rows part = invariant_call<bf16>(q, k, v, c0, c1, k0, c1, w, opts);
      for (int i = c0; i < c1; ++i) differ += wb.same_row(i, part, i - c0) ? 0 : 1;
    }
    CHECK(differ == 0);
  }
}

TEST_CASE("invariant: another tile size is another order (the comparisons can fail)") {
  // The canonical tile fixes the order of the fp32 sums: another tile gives
  // other bits in some rows, so the bitwise comparisons above are not
  // comparing things that could never differ.
  const int n = 150, b = 1, h = 2, hkv = 2, d = 64;
  std::mt19937_64 rng(12);
  HostTensor q = random_tensor(b, n, h, d, rng);
  HostTensor k = random_tensor(b, n, hkv, d, rng);
  HostTensor v = random_tensor(b, n, hkv, d, rng);
  auto call = [&](bool inv, int tile, int q0, int q1, int k1) {
    auto qd = rows_of<float>(q, q0, q1);
    auto kd = rows_of<float>(k, 0, k1);
    auto vd = rows_of<float>(v, 0, k1);
    V4<float> o("o", b, q1 - q0, h, d);
    V3<float> lse("lse", b, h, q1 - q0);
    ForwardOptions opts;
    opts.invariant = inv;
    opts.invariant_tile = tile;
    opts.q_offset = q0;
    attention_forward(ExecSpace{}, qd, kd, vd, o, lse, CausalMask{}, opts);
    Kokkos::fence();
    return Rows(o, lse);
  };
  // Another tile size is another canonical order: other bits.
  const Rows t64 = call(true, 64, 0, n, n), t16 = call(true, 16, 0, n, n);
  int differ = 0;
  for (int i = 0; i < n; ++i) differ += t64.same_row(i, t16, i) ? 0 : 1;
  CHECK(differ > 0);
}

namespace {

/// The invariant forward of the whole sequence on one device (every rank
/// computes it): the bits every split must give.
template <class S, class Mask>
Rows one_device(const HostTensor& q, const HostTensor& k, const HostTensor& v, const Mask& mask,
                int tile, const Kokkos::View<float*, MemSpace>& sinks) {
  ForwardOptions opts;
  opts.invariant_tile = tile;
  opts.sinks = sinks;
  return invariant_call<S>(q, k, v, 0, q.n, 0, k.n, mask, opts);
}

/// Rows of a distributed result (local row i) that differ from the
/// one-device rows at global position pos(i).
template <class OV, class LV, class Pos>
int rows_differing(const Rows& whole, const OV& o, const LV& lse, index_type n, const Pos& pos) {
  const auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
  const auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  using S = typename OV::non_const_value_type;
  Host4<S> oc("oc", o.extent(0), o.extent(1), o.extent(2), o.extent(3));
  Kokkos::View<float***, Kokkos::LayoutRight, Kokkos::HostSpace> lc("lc", lse.extent(0),
                                                                    lse.extent(1), lse.extent(2));
  Kokkos::deep_copy(oc, oh);
  Kokkos::deep_copy(lc, lh);
  const Rows mine(oc, lc);
  int differ = 0;
  for (index_type i = 0; i < n; ++i) differ += whole.same_row(int(pos(i)), mine, int(i)) ? 0 : 1;
  return differ;
}

struct Problem {
  HostTensor q, k, v;
};

template <class S>
Problem problem(int N, int h, int hkv, int d, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p{random_tensor(1, N, h, d, rng), random_tensor(1, N, hkv, d, rng),
            random_tensor(1, N, hkv, d, rng)};
  p.q = rounded_to<S>(p.q);
  p.k = rounded_to<S>(p.k);
  p.v = rounded_to<S>(p.v);
  return p;
}

/// DistributedAttention<Partition, Mask, Schedule> with options.invariant
/// against the one-device invariant forward: every row the same bits.
template <class S, class Partition, class Schedule, class Mask>
void check_schedule(Mpi& comm, const Problem& p, const Mask& mask, int tile,
                    const Kokkos::View<float*, MemSpace>& sinks, const Rows& whole) {
  const int P = comm.size(), rank = comm.rank(), N = p.q.n;
  CAPTURE(Partition::name());
  CAPTURE(Schedule::name());
  CAPTURE(tile);
  const index_type n = local_length<Partition>(N, P, rank);
  const auto map = Partition::positions(N, P, rank);
  const V4<S> q = local_rows<S>(p.q, n, map), k = local_rows<S>(p.k, n, map),
              v = local_rows<S>(p.v, n, map);
  V4<S> o("o", 1, n, p.q.h, p.q.d);
  V3<compute_t<S>> lse("lse", 1, p.q.h, n);
  DistributedAttention<Partition, Mask, Schedule, Mpi, ExecSpace> attn(comm, mask);
  DistributedOptions opts;
  opts.invariant = true;
  opts.invariant_tile = tile;
  opts.sinks = sinks;
  const RunStats st = attn.forward(q, k, v, o, lse, opts);
  Kokkos::fence();
  CHECK(int(st.steps.size()) == 2 * P);
  CHECK(rows_differing(whole, o, lse, n, map) == 0);
}

template <class S, class Mask>
void check_every_schedule(Mpi& comm, const Problem& p, const Mask& mask, bool causal,
                          const Kokkos::View<float*, MemSpace>& sinks) {
  const Rows w16 = one_device<S>(p.q, p.k, p.v, mask, 16, sinks);
  const Rows w8 = one_device<S>(p.q, p.k, p.v, mask, 8, sinks);
  const Rows w1 = one_device<S>(p.q, p.k, p.v, mask, 1, sinks);
  check_schedule<S, ContiguousPartition, RingSchedule>(comm, p, mask, 16, sinks, w16);
  check_schedule<S, ContiguousPartition, BurstSchedule>(comm, p, mask, 16, sinks, w16);
  check_schedule<S, ContiguousPartition, AllGatherSchedule>(comm, p, mask, 16, sinks, w16);
  check_schedule<S, ZigzagPartition, RingSchedule>(comm, p, mask, 8, sinks, w8);
  check_schedule<S, StripedPartition, RingSchedule>(comm, p, mask, 1, sinks, w1);
  check_schedule<S, ContiguousPartition, RingSchedule>(comm, p, mask, 1, sinks, w1);
  if constexpr (!std::is_same<Mask, FullMask>::value)
    if (causal)
      check_schedule<S, ContiguousPartition, BalancedSchedule>(comm, p, mask, 16, sinks, w16);
}

}  // namespace

TEST_CASE("invariant distributed: every schedule and partition, the one-device bits") {
  Mpi comm(MPI_COMM_WORLD);
  // N = 48 P: contiguous pieces start at multiples of 16, zigzag chunks (2P
  // of them) at multiples of 8; striped takes tile 1.
  const int N = 48 * comm.size();
  const Problem p = problem<float>(N, 4, 2, 32, 21);
  const Kokkos::View<float*, MemSpace> none;
  check_every_schedule<float>(comm, p, CausalMask{}, true, none);
  check_every_schedule<float>(comm, p, with_score(SlidingWindowMask{50, 0}, SoftCap{6.0}), false,
                              none);
  Kokkos::View<float*, MemSpace> sinks("sinks", 4);
  Kokkos::deep_copy(sinks, 0.75f);
  check_every_schedule<float>(comm, p, FullMask{}, false, sinks);
  const Problem pb = problem<bf16>(N, 4, 4, 64, 22);
  check_every_schedule<bf16>(comm, pb, CausalMask{}, true, none);
  check_every_schedule<bf16>(comm, pb, DocumentCausalMask{70}, false, none);
}

TEST_CASE("invariant distributed: Ulysses and the hybrid, the one-device bits") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size(), rank = comm.rank(), N = 48 * P, H = 2 * P;  // H: a multiple of P
  const Problem p = problem<float>(N, H, H, 32, 23);
  const auto mask = with_score(CausalMask{}, SoftCap{5.0});
  const Kokkos::View<float*, MemSpace> none;
  const Rows w16 = one_device<float>(p.q, p.k, p.v, mask, 16, none);
  DistributedOptions opts;
  opts.invariant = true;
  opts.invariant_tile = 16;
  {
    const index_type n = local_length<ContiguousPartition>(N, P, rank);
    const auto map = ContiguousPartition::positions(N, P, rank);
    const V4<float> q = local_rows<float>(p.q, n, map), k = local_rows<float>(p.k, n, map),
                    v = local_rows<float>(p.v, n, map);
    V4<float> o("o", 1, n, H, 32);
    V3<float> lse("lse", 1, H, n);
    UlyssesAttention<ContiguousPartition, std::decay_t<decltype(mask)>, Mpi, ExecSpace> u(comm,
                                                                                          mask);
    u.forward(q, k, v, o, lse, opts);
    Kokkos::fence();
    CHECK(rows_differing(w16, o, lse, n, map) == 0);
  }
  for (int ulysses = 1; ulysses <= P; ++ulysses) {
    if (P % ulysses != 0) continue;
    CAPTURE(ulysses);
    const HybridGrid g = HybridGrid::make(P, ulysses);
    const index_type Ng = local_length<ContiguousPartition>(N, g.ring, g.group(rank));
    const index_type base = Ng / ulysses, more = Ng % ulysses, a = g.member(rank);
    const index_type first = a * base + std::min(a, more), n = base + (a < more ? 1 : 0);
    const auto group = ContiguousPartition::positions(N, g.ring, g.group(rank));
    const auto map = [&](index_type i) { return group(first + i); };
    const V4<float> q = local_rows<float>(p.q, n, map), k = local_rows<float>(p.k, n, map),
                    v = local_rows<float>(p.v, n, map);
    V4<float> o("o", 1, n, H, 32);
    V3<float> lse("lse", 1, H, n);
    HybridAttention<ContiguousPartition, std::decay_t<decltype(mask)>, RingSchedule, Mpi, ExecSpace>
        hy(comm, ulysses, mask);
    hy.forward(q, k, v, o, lse, opts);
    Kokkos::fence();
    CHECK(rows_differing(w16, o, lse, n, map) == 0);
  }
}

TEST_CASE("invariant distributed: a partition that cuts a tile is rejected on every rank") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size(), rank = comm.rank();
  if (P < 2) return;
  const Problem p = problem<float>(100, 2, 2, 16, 24);  // pieces of 100 / P: not multiples of 64
  const index_type n = local_length<ContiguousPartition>(100, P, rank);
  const auto map = ContiguousPartition::positions(100, P, rank);
  const V4<float> q = local_rows<float>(p.q, n, map);
  V4<float> o("o", 1, n, 2, 16);
  V3<float> lse("lse", 1, 2, n);
  DistributedAttention<ContiguousPartition, CausalMask, RingSchedule, Mpi, ExecSpace> attn(comm);
  DistributedOptions opts;
  opts.invariant = true;
  CHECK_THROWS_WITH_AS(attn.forward(q, q, q, o, lse, opts),
                       doctest::Contains("keys of canonical tile"), invalid_argument);
  opts.invariant_tile = 1;  // any split
  CHECK_NOTHROW(attn.forward(q, q, q, o, lse, opts));
}

namespace {

/// Prefill of one sequence in chunks of `chunk` tokens, then its last
/// `decode` tokens one at a time (append_kv + decode_attention), on `cache`:
/// rows that differ from the one-device invariant forward.
template <class S, class Cache, class Mask>
int serve_rows_differing(Mpi& comm, Cache& cache, const Problem& p, const Mask& mask, int chunk,
                         int decode, const ServeOptions& opts, const Rows& whole) {
  const int N = p.q.n, H = p.q.h, D = p.q.d;
  int differ = 0;
  for (int t0 = 0; t0 < N;) {
    const bool dec = t0 >= N - decode;
    const int n = dec ? 1 : std::min(chunk, N - decode - t0);
    const V4<S> q = rows_of<S>(p.q, t0, t0 + n), k = rows_of<S>(p.k, t0, t0 + n),
                v = rows_of<S>(p.v, t0, t0 + n);
    V4<S> o("o", 1, n, H, D);
    V3<compute_t<S>> lse("lse", 1, H, n);
    if (dec) {
      append_kv(comm, ExecSpace{}, cache, 0, k, v);
      decode_attention(comm, ExecSpace{}, cache, q, o, lse, mask, opts);
    } else {
      prefill_attention(comm, ExecSpace{}, cache, 0, q, k, v, o, lse, mask, opts);
    }
    Kokkos::fence();
    const Rows got(o, lse);
    for (int i = 0; i < n; ++i) differ += whole.same_row(t0 + i, got, i) ? 0 : 1;
    t0 += n;
  }
  return differ;
}

}  // namespace

TEST_CASE(
    "invariant serving: prefill in any chunks and decode, sharded and paged, the one-device bits") {
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size(), N = 150, H = 4, Hkv = 2, D = 32, tile = 16;
  const Problem p = problem<float>(N, H, Hkv, D, 31);
  const auto mask = with_score(CausalMask{}, SoftCap{7.0});
  Kokkos::View<float*, MemSpace> sinks("sinks", H);
  Kokkos::deep_copy(sinks, -0.5f);
  const Rows whole = one_device<float>(p.q, p.k, p.v, mask, tile, sinks);
  ServeOptions opts;
  opts.invariant = true;
  opts.invariant_tile = tile;
  opts.sinks = sinks;
  const RoundRobinPlacement rr{tile};
  const ContiguousPlacement ct{(N / P + tile) / tile * tile};
  for (int chunk : {1, 7, 64}) {
    CAPTURE(chunk);
    KVCache<float, ExecSpace, RoundRobinPlacement> a(comm, 1, rr.local_capacity(N, P), Hkv, D, rr);
    CHECK(serve_rows_differing<float>(comm, a, p, mask, chunk, 5, opts, whole) == 0);
    KVCache<float, ExecSpace, ContiguousPlacement> b(comm, 1, ct.local_capacity(N, P), Hkv, D, ct);
    CHECK(serve_rows_differing<float>(comm, b, p, mask, chunk, 5, opts, whole) == 0);
    PagedKVCache<float, ExecSpace, RoundRobinPlacement> c(comm, 1, 64, 16, Hkv, D, rr, N);
    CHECK(serve_rows_differing<float>(comm, c, p, mask, chunk, 5, opts, whole) == 0);
  }
  // bf16, a window, pages of 8 tokens.
  const Problem pb = problem<bf16>(N, H, Hkv, D, 32);
  const SlidingWindowMask w{33, 0};
  const Rows wb = one_device<bf16>(pb.q, pb.k, pb.v, w, tile, Kokkos::View<float*, MemSpace>());
  ServeOptions ob;
  ob.invariant = true;
  ob.invariant_tile = tile;
  PagedKVCache<bf16, ExecSpace, ContiguousPlacement> c(comm, 1, 64, 8, Hkv, D, ct, N);
  CHECK(serve_rows_differing<bf16>(comm, c, pb, w, 7, 9, ob, wb) == 0);
}

TEST_CASE("invariant serving: a placement that cuts a tile is rejected on every rank") {
  Mpi comm(MPI_COMM_WORLD);
  if (comm.size() < 2) return;
  const RoundRobinPlacement rr{8};
  KVCache<float, ExecSpace, RoundRobinPlacement> cache(comm, 1, 64, 1, 8, rr);
  V4<float> q("q", 1, 20, 1, 8), o("o", 1, 20, 1, 8);
  V3<float> lse("lse", 1, 1, 20);
  ServeOptions opts;
  opts.invariant = true;
  opts.invariant_tile = 16;  // the placement's pieces are 8 tokens
  CHECK_THROWS_WITH_AS(
      prefill_attention(comm, ExecSpace{}, cache, 0, q, q, q, o, lse, CausalMask{}, opts),
      doctest::Contains("inside one canonical tile"), invalid_argument);
  CHECK(cache.length(0) == 0);  // nothing appended anywhere
  opts.invariant_tile = 8;
  CHECK_NOTHROW(
      prefill_attention(comm, ExecSpace{}, cache, 0, q, q, q, o, lse, CausalMask{}, opts));
}

namespace {

/// The bytes of a (1, n, heads, d) View on the host, LayoutRight.
template <class View>
std::vector<unsigned char> grad_bytes(const View& g) {
  using S = typename View::non_const_value_type;
  Host4<S> h("h", g.extent(0), g.extent(1), g.extent(2), g.extent(3));
  Kokkos::deep_copy(h, Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g));
  std::vector<unsigned char> b(h.span() * sizeof(S));
  std::memcpy(b.data(), h.data(), b.size());
  return b;
}

/// Rows (dimension 1) of a local gradient that differ from the whole
/// sequence's at global position pos(i).
template <class Pos>
int grad_rows_differing(const std::vector<unsigned char>& whole,
                        const std::vector<unsigned char>& mine, index_type n, std::size_t row_bytes,
                        const Pos& pos) {
  int differ = 0;
  for (index_type i = 0; i < n; ++i)
    differ += std::memcmp(&whole[std::size_t(pos(i)) * row_bytes],
                          &mine[std::size_t(i) * row_bytes], row_bytes) != 0;
  return differ;
}

struct WholeGrads {
  std::vector<unsigned char> dq, dk, dv;
  std::vector<float> dsink;
};

template <class S, class Mask>
WholeGrads whole_backward(const Problem& p, const HostTensor& dout, const Mask& mask, int tile,
                          const Kokkos::View<float*, MemSpace>& sinks) {
  const int N = p.q.n, H = p.q.h, Hkv = p.k.h, D = p.q.d;
  const V4<S> q = rows_of<S>(p.q, 0, N), k = rows_of<S>(p.k, 0, N), v = rows_of<S>(p.v, 0, N),
              d_o = rows_of<S>(dout, 0, N);
  V4<S> o("o", 1, N, H, D), dq("dq", 1, N, H, D), dk("dk", 1, N, Hkv, D), dv("dv", 1, N, Hkv, D);
  V3<compute_t<S>> lse("lse", 1, H, N);
  Kokkos::View<float*, MemSpace> ds("dsinks", sinks.extent(0));
  ForwardOptions opts;
  opts.invariant = true;
  opts.invariant_tile = tile;
  opts.sinks = sinks;
  if (sinks.extent(0) > 0) opts.sink_grad = ds;
  attention_forward(ExecSpace{}, q, k, v, o, lse, mask, opts);
  attention_backward(ExecSpace{}, q, k, v, o, lse, d_o, dq, dk, dv, mask, opts);
  Kokkos::fence();
  WholeGrads w{grad_bytes(dq), grad_bytes(dk), grad_bytes(dv), {}};
  auto dh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ds);
  for (std::size_t h = 0; h < dh.extent(0); ++h) w.dsink.push_back(dh(h));
  return w;
}

/// One distributed invariant backward (`attn`, any driver over every rank;
/// this rank's n rows at global positions map(i)) against the one-device
/// invariant backward: every gradient row the same bits.
template <class S, class Driver, class Map>
void check_backward_rows(Driver& attn, int P, index_type n, const Map& map, const Problem& p,
                         const HostTensor& dout, int tile,
                         const Kokkos::View<float*, MemSpace>& sinks, const WholeGrads& whole) {
  const int H = p.q.h, Hkv = p.k.h, D = p.q.d;
  CAPTURE(tile);
  const V4<S> q = local_rows<S>(p.q, n, map), k = local_rows<S>(p.k, n, map),
              v = local_rows<S>(p.v, n, map), d_o = local_rows<S>(dout, n, map);
  V4<S> o("o", 1, n, H, D), dq("dq", 1, n, H, D), dk("dk", 1, n, Hkv, D), dv("dv", 1, n, Hkv, D);
  V3<compute_t<S>> lse("lse", 1, H, n);
  Kokkos::View<float*, MemSpace> ds("dsinks", sinks.extent(0));
  DistributedOptions opts;
  opts.invariant = true;
  opts.invariant_tile = tile;
  opts.sinks = sinks;
  if (sinks.extent(0) > 0) opts.sink_grad = ds;
  attn.forward(q, k, v, o, lse, opts);
  const RunStats st = attn.backward(q, k, v, o, lse, d_o, dq, dk, dv, opts);
  Kokkos::fence();
  CHECK(int(st.steps.size()) == 2 * P);
  CHECK(grad_rows_differing(whole.dq, grad_bytes(dq), n, std::size_t(H) * D * sizeof(S), map) == 0);
  CHECK(grad_rows_differing(whole.dk, grad_bytes(dk), n, std::size_t(Hkv) * D * sizeof(S), map) ==
        0);
  CHECK(grad_rows_differing(whole.dv, grad_bytes(dv), n, std::size_t(Hkv) * D * sizeof(S), map) ==
        0);
  auto dh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ds);
  for (std::size_t h = 0; h < dh.extent(0); ++h)
    CHECK(std::memcmp(&dh(h), &whole.dsink[h], sizeof(float)) == 0);
}

/// The same under one partition and schedule of DistributedAttention.
template <class S, class Partition, class Schedule, class Mask>
void check_backward_schedule(Mpi& comm, const Problem& p, const HostTensor& dout, const Mask& mask,
                             int tile, const Kokkos::View<float*, MemSpace>& sinks,
                             const WholeGrads& whole) {
  const int P = comm.size(), rank = comm.rank(), N = p.q.n;
  CAPTURE(Partition::name());
  CAPTURE(Schedule::name());
  DistributedAttention<Partition, Mask, Schedule, Mpi, ExecSpace> attn(comm, mask);
  check_backward_rows<S>(attn, P, local_length<Partition>(N, P, rank),
                         Partition::positions(N, P, rank), p, dout, tile, sinks, whole);
}

template <class S, class Mask>
void check_backward_schedules(Mpi& comm, const Problem& p, const HostTensor& dout, const Mask& mask,
                              const Kokkos::View<float*, MemSpace>& sinks) {
  const WholeGrads w16 = whole_backward<S>(p, dout, mask, 16, sinks);
  const WholeGrads w8 = whole_backward<S>(p, dout, mask, 8, sinks);
  const WholeGrads w1 = whole_backward<S>(p, dout, mask, 1, sinks);
  check_backward_schedule<S, ContiguousPartition, RingSchedule>(comm, p, dout, mask, 16, sinks,
                                                                w16);
  check_backward_schedule<S, ContiguousPartition, BurstSchedule>(comm, p, dout, mask, 16, sinks,
                                                                 w16);
  check_backward_schedule<S, ZigzagPartition, RingSchedule>(comm, p, dout, mask, 8, sinks, w8);
  check_backward_schedule<S, StripedPartition, AllGatherSchedule>(comm, p, dout, mask, 1, sinks,
                                                                  w1);
}

/// The one-device invariant backward against fp64: each gradient element
/// within 1e-4 of the largest entry (the fp32 gradient bound of the
/// default, forward_check.hpp), plus one rounding for 16-bit storage.
template <class S, class Mask>
void check_backward_reference(const Mask& mask, int N, int H, int Hkv, int D, int tile,
                              std::uint64_t seed, const std::vector<double>* sinks = nullptr) {
  CAPTURE(tile);
  CAPTURE(N);
  const Problem p = problem<S>(N, H, Hkv, D, seed);
  std::mt19937_64 rng(seed + 100);
  const HostTensor dout = rounded_to<S>(random_tensor(1, N, H, D, rng));
  const V4<S> q = rows_of<S>(p.q, 0, N), k = rows_of<S>(p.k, 0, N), v = rows_of<S>(p.v, 0, N),
              d_o = rows_of<S>(dout, 0, N);
  V4<S> o("o", 1, N, H, D), dq("dq", 1, N, H, D), dk("dk", 1, N, Hkv, D), dv("dv", 1, N, Hkv, D);
  V3<compute_t<S>> lse("lse", 1, H, N);
  Kokkos::View<float*, MemSpace> sk("sinks", sinks ? sinks->size() : 0), ds("ds", sk.extent(0));
  ForwardOptions opts;
  opts.invariant = true;
  opts.invariant_tile = tile;
  if (sinks) {
    auto h = Kokkos::create_mirror_view(sk);
    for (std::size_t x = 0; x < sinks->size(); ++x) h(x) = float((*sinks)[x]);
    Kokkos::deep_copy(sk, h);
    opts.sinks = sk;
    opts.sink_grad = ds;
  }
  attention_forward(ExecSpace{}, q, k, v, o, lse, mask, opts);
  attention_backward(ExecSpace{}, q, k, v, o, lse, d_o, dq, dk, dv, mask, opts);
  Kokkos::fence();
  const HostTensor o_used = download(o);
  const ReferenceGrads ref = reference_backward(p.q, p.k, p.v, dout, mask,
                                                1.0 / std::sqrt(double(D)), 0, 0, &o_used, sinks);
  const auto check = [&](const HostTensor& want, const auto& got_view, const char* what) {
    CAPTURE(what);
    const HostTensor got = download(got_view);
    double largest = 0, worst = 0;
    for (double x : want.data) largest = std::max(largest, std::abs(x));
    bool ok = true;
    for (std::size_t x = 0; x < want.data.size(); ++x) {
      double bound = 1e-4 * largest;
      if constexpr (!std::is_same<S, float>::value) bound = rounded_bound<S>(bound, want.data[x]);
      const double err = std::abs(got.data[x] - want.data[x]);
      worst = std::max(worst, err / bound);
      ok = ok && err <= bound;
    }
    CAPTURE(worst);
    CHECK(ok);
  };
  check(ref.dq, dq, "dq");
  check(ref.dk, dk, "dk");
  check(ref.dv, dv, "dv");
  if (sinks) {
    auto dh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ds);
    for (std::size_t h = 0; h < sinks->size(); ++h) {
      CAPTURE(h);
      CHECK(std::abs(dh(h) - ref.dsink[h]) <= 1e-4 * (1.0 + std::abs(ref.dsink[h])));
    }
  }
}

}  // namespace

TEST_CASE("invariant backward: one device against fp64 (masks, score policy, sinks, 16-bit)") {
  for (int tile : {1, 16, 64}) {
    check_backward_reference<float>(CausalMask{}, 90, 4, 2, 32, tile, 41);
    check_backward_reference<float>(with_score(SlidingWindowMask{30, 5}, SoftCap{6.0}), 70, 2, 2,
                                    64, tile, 42);
    check_backward_reference<bf16>(FullMask{}, 65, 2, 1, 40, tile, 43);
  }
  const std::vector<double> sinks = {0.3, -2.0};
  check_backward_reference<float>(CausalMask{}, 50, 2, 1, 32, 16, 44, &sinks);
  check_backward_reference<fp16>(CausalMask{}, 50, 2, 2, 32, 8, 45, &sinks);
}

TEST_CASE(
    "invariant distributed: the backward of every schedule and partition, the one-device bits") {
  Mpi comm(MPI_COMM_WORLD);
  const int N = 48 * comm.size();
  const Problem p = problem<float>(N, 4, 2, 32, 51);
  std::mt19937_64 rng(52);
  const HostTensor dout = rounded_to<float>(random_tensor(1, N, 4, 32, rng));
  const Kokkos::View<float*, MemSpace> none;
  check_backward_schedules<float>(comm, p, dout, with_score(CausalMask{}, SoftCap{6.0}), none);
  Kokkos::View<float*, MemSpace> sinks("sinks", 4);
  Kokkos::deep_copy(sinks, 0.25f);
  check_backward_schedules<float>(comm, p, dout, SlidingWindowMask{40, 3}, sinks);
  const Problem pb = problem<bf16>(N, 4, 4, 32, 53);
  const HostTensor db = rounded_to<bf16>(random_tensor(1, N, 4, 32, rng));
  check_backward_schedules<bf16>(comm, pb, db, CausalMask{}, none);
}

TEST_CASE("invariant distributed: the Ulysses and hybrid backward, the one-device bits") {
  // H = 2P query heads on one K/V head: Ulysses and every hybrid grid
  // replicate it (their default backward sums its partials over the ranks).
  Mpi comm(MPI_COMM_WORLD);
  const int P = comm.size(), rank = comm.rank(), N = 48 * P, H = 2 * P;
  const Problem p = problem<float>(N, H, 1, 32, 61);
  std::mt19937_64 rng(62);
  const HostTensor dout = rounded_to<float>(random_tensor(1, N, H, 32, rng));
  const auto mask = with_score(CausalMask{}, SoftCap{5.0});
  using M = std::decay_t<decltype(mask)>;
  Kokkos::View<float*, MemSpace> sinks("sinks", H);
  Kokkos::deep_copy(sinks, -0.5f);
  const WholeGrads w = whole_backward<float>(p, dout, mask, 16, sinks);
  {
    UlyssesAttention<ContiguousPartition, M, Mpi, ExecSpace> u(comm, mask);
    check_backward_rows<float>(u, P, local_length<ContiguousPartition>(N, P, rank),
                               ContiguousPartition::positions(N, P, rank), p, dout, 16, sinks, w);
  }
  for (int ulysses = 1; ulysses <= P; ++ulysses) {
    if (P % ulysses != 0) continue;
    CAPTURE(ulysses);
    const HybridGrid g = HybridGrid::make(P, ulysses);
    HybridAttention<ContiguousPartition, M, RingSchedule, Mpi, ExecSpace> hy(comm, ulysses, mask);
    check_backward_rows<float>(hy, P, hybrid_length<ContiguousPartition>(N, g, rank),
                               hybrid_position_map<ContiguousPartition>(N, g, rank), p, dout, 16,
                               sinks, w);
  }
}

namespace {

/// attention_decode and attention_decode_paged in the invariant mode against
/// attention_forward's over the whole sequence: two sequences of one problem
/// whose caches hold 70 and 129 keys, two rows each at the cache's end (a
/// partial last tile), the keys contiguous and in shuffled pages of 8.
template <class T>
void check_invariant_decode(std::uint64_t seed) {
  const int N = 129, H = 4, Hkv = 2, D = 32, R = 2, B = 2, PS = 8;
  const int len[B] = {70, N};
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(1, N, H, D, rng), k = random_tensor(1, N, Hkv, D, rng),
             v = random_tensor(1, N, Hkv, D, rng);
  const auto mask = with_score(CausalMask{}, SoftCap{5.0});
  Kokkos::View<float*, MemSpace> sinks("sinks", H);
  Kokkos::deep_copy(sinks, 0.5f);
  ForwardOptions fo;
  fo.invariant_tile = 16;
  fo.sinks = sinks;
  // The decode inputs: rows len - 2, len - 1 of each sequence; its keys
  // contiguous (capacity N) and paged (sequence 0's 9 pages at pool pages
  // 25 .. 17, sequence 1's 17 at 16 .. 0: backwards).
  HostTensor qd(B, R, H, D), kc(B, N, Hkv, D), vc(B, N, Hkv, D), kp(26, PS, Hkv, D),
      vp(26, PS, Hkv, D);
  auto table = Kokkos::View<int**, MemSpace>("table", B, 17);
  auto th = Kokkos::create_mirror_view(table);
  auto lengths = Kokkos::View<int*, MemSpace>("lengths", B);
  auto first = Kokkos::View<index_type*, MemSpace>("first", B);
  auto lh = Kokkos::create_mirror_view(lengths);
  auto fh = Kokkos::create_mirror_view(first);
  for (int b = 0; b < B; ++b) {
    lh(b) = len[b];
    fh(b) = len[b] - R;
    for (int i = 0; i < R; ++i)
      for (int x = 0; x < H; ++x)
        for (int d = 0; d < D; ++d) qd(b, i, x, d) = q(0, len[b] - R + i, x, d);
    for (int p = 0; p < 17; ++p) th(b, p) = b == 0 ? (p < 9 ? 25 - p : 0) : 16 - p;
    for (int j = 0; j < len[b]; ++j)
      for (int x = 0; x < Hkv; ++x)
        for (int d = 0; d < D; ++d) {
          kc(b, j, x, d) = k(0, j, x, d);
          vc(b, j, x, d) = v(0, j, x, d);
          kp(th(b, j / PS), j % PS, x, d) = k(0, j, x, d);
          vp(th(b, j / PS), j % PS, x, d) = v(0, j, x, d);
        }
  }
  Kokkos::deep_copy(table, th);
  Kokkos::deep_copy(lengths, lh);
  Kokkos::deep_copy(first, fh);
  V4<T> qv("q", B, R, H, D), kcv("kc", B, N, Hkv, D), vcv("vc", B, N, Hkv, D),
      kpv("kp", 26, PS, Hkv, D), vpv("vp", 26, PS, Hkv, D);
  upload(qd, qv);
  upload(kc, kcv);
  upload(vc, vcv);
  upload(kp, kpv);
  upload(vp, vpv);
  DecodeOptions opts;
  opts.invariant = true;
  opts.sinks = sinks;
  for (int tile : {16, 8}) {
    CAPTURE(tile);
    fo.invariant_tile = opts.invariant_tile = tile;
    const Rows whole = invariant_call<T>(q, k, v, 0, N, 0, N, mask, fo);
    for (int paged = 0; paged < 2; ++paged) {
      CAPTURE(paged);
      V4<T> o("o", B, R, H, D);
      V3<compute_t<T>> lse("lse", B, H, R);
      if (paged)
        attention_decode_paged(ExecSpace{}, qv, kpv, vpv, table, lengths, first, o, lse, mask,
                               OffsetPositions{}, opts);
      else
        attention_decode(ExecSpace{}, qv, kcv, vcv, lengths, first, o, lse, mask, OffsetPositions{},
                         opts);
      Kokkos::fence();
      const Rows got(o, lse);
      int differ = 0;
      for (int b = 0; b < B; ++b)
        for (int i = 0; i < R; ++i)
          for (int x = 0; x < H; ++x) {
            const int pos = len[b] - R + i;
            const std::size_t os = sizeof(T) * D;
            differ += std::memcmp(&got.o[((std::size_t(b) * R + i) * H + x) * os],
                                  &whole.o[(std::size_t(pos) * H + x) * os], os) != 0;
            differ += std::memcmp(&got.lse[((std::size_t(b) * H + x) * R + i) * 4],
                                  &whole.lse[(std::size_t(x) * N + pos) * 4], 4) != 0;
          }
      CHECK(differ == 0);
    }
  }
}

}  // namespace

TEST_CASE("invariant decode: attention_decode and attention_decode_paged, the one-device bits") {
  check_invariant_decode<float>(71);
  check_invariant_decode<bf16>(72);
  // 8-bit caches have no invariant mode: a clear error.
  V4<float> q("q", 1, 1, 2, 16), o("o", 1, 1, 2, 16);
  V3<float> lse("lse", 1, 2, 1), ks("ks", 1, 8, 1);
  V4<std::int8_t> k8("k8", 1, 8, 1, 16);
  Kokkos::View<int*, MemSpace> lengths("lengths", 1);
  Kokkos::View<index_type*, MemSpace> first("first", 1);
  DecodeOptions opts;
  opts.invariant = true;
  CHECK_THROWS_WITH_AS(attention_decode_quantized(ExecSpace{}, q, k8, k8, ks, ks, lengths, first, o,
                                                  lse, FullMask{}, OffsetPositions{}, opts),
                       doctest::Contains("8-bit caches have no invariant mode"), invalid_argument);
}

TEST_CASE("invariant: NaN and inf inputs, where the default mode has them") {
  // NaN in V[40][3] and K[77], inf in V[60][5] and Q[90]: each row's O, LSE,
  // and each gradient element NaN (or inf) exactly where the default mode's
  // is, forward and backward (causal, tile 16: chunks with and without a
  // non-finite row).
  const int N = 100, H = 2, D = 32;
  std::mt19937_64 rng(81);
  HostTensor q = random_tensor(1, N, H, D, rng), k = random_tensor(1, N, H, D, rng),
             v = random_tensor(1, N, H, D, rng), dout = random_tensor(1, N, H, D, rng);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (int x = 0; x < H; ++x) {
    v(0, 40, x, 3) = nan;
    v(0, 60, x, 5) = inf;
    for (int d = 0; d < D; ++d) k(0, 77, x, d) = x == 0 ? nan : 1.0;
    q(0, 90, x, 7) = x == 1 ? inf : q(0, 90, x, 7);
  }
  const V4<float> qd = rows_of<float>(q, 0, N), kd = rows_of<float>(k, 0, N),
                  vd = rows_of<float>(v, 0, N), dod = rows_of<float>(dout, 0, N);
  auto pattern = [](const auto& view) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
    std::vector<int> p(h.span());
    for (std::size_t i = 0; i < h.span(); ++i)
      p[i] = std::isnan(h.data()[i]) ? 2 : std::isinf(h.data()[i]) ? 1 : 0;
    return p;
  };
  std::vector<int> want[5], got[5];
  for (int inv = 0; inv < 2; ++inv) {
    V4<float> o("o", 1, N, H, D), dq("dq", 1, N, H, D), dk("dk", 1, N, H, D), dv("dv", 1, N, H, D);
    V3<float> lse("lse", 1, H, N);
    ForwardOptions opts;
    opts.invariant = inv == 1;
    opts.invariant_tile = 16;
    attention_forward(ExecSpace{}, qd, kd, vd, o, lse, CausalMask{}, opts);
    attention_backward(ExecSpace{}, qd, kd, vd, o, lse, dod, dq, dk, dv, CausalMask{}, opts);
    Kokkos::fence();
    std::vector<int>* out = inv ? got : want;
    out[0] = pattern(o);
    out[1] = pattern(lse);
    out[2] = pattern(dq);
    out[3] = pattern(dk);
    out[4] = pattern(dv);
  }
  for (int t = 0; t < 5; ++t) {
    CAPTURE(t);
    int nonfinite = 0, differ = 0;
    for (std::size_t i = 0; i < want[t].size(); ++i) {
      nonfinite += want[t][i] != 0;
      differ += want[t][i] != got[t][i];
    }
    CHECK(nonfinite > 0);
    CHECK(differ == 0);
  }
}
