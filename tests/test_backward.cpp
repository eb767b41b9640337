// SPDX-License-Identifier: Apache-2.0
// Single-device backward against the fp64 reference of the naive formula, a
// central finite-difference check, and fully masked rows.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backend.hpp"
#include "forward_check.hpp"
#include "reference.hpp"
#include "user_masks.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

template <class T>
using V4 = Kokkos::View<T****, MemSpace>;
template <class T>
using V3 = Kokkos::View<T***, MemSpace>;

/// max |a - b| / max |b|; false if a has a NaN/inf.
double rel_err(const HostTensor& a, const HostTensor& b, bool& finite) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.data.size(); ++i) {
    if (!std::isfinite(a.data[i])) finite = false;
    num = std::max(num, std::abs(a.data[i] - b.data[i]));
    den = std::max(den, std::abs(b.data[i]));
  }
  return den > 0 ? num / den : num;
}

/// Tolerances (relative to the largest gradient entry): the backward re-forms
/// P from the saved LSE and adds up to Nq or Nk products of D-term dot products;
/// random-walk rounding gives ~sqrt(D * N) * eps * (logit condition), ~1e-14
/// (fp64) and ~1e-6..1e-5 (fp32) here; 1e-11 and 1e-4 leave a margin of 100x.
template <class T>
constexpr double grad_tol() {
  return std::is_same<T, double>::value ? 1e-11 : 1e-4;
}

struct Shape4 {
  int b, nq, nk, h, hkv, d;
};

/// Random q, k, v, dO of shape s (from `seed`) and what attention_forward +
/// attention_backward on this backend make of them, on the host.
struct Run {
  HostTensor q, k, v, dout;  // inputs
  HostTensor o, dq, dk, dv;  // outputs
  std::vector<double> lse;
};

template <class T, class Mask>
Run forward_backward(const Shape4& s, const Mask& mask, std::uint64_t seed,
                     const ForwardOptions& opts = {}) {
  std::mt19937_64 rng(seed);
  Run r;
  r.q = random_tensor(s.b, s.nq, s.h, s.d, rng);
  r.k = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  r.v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  r.dout = random_tensor(s.b, s.nq, s.h, s.d, rng);
  V4<T> qd("q", s.b, s.nq, s.h, s.d), kd("k", s.b, s.nk, s.hkv, s.d),
      vd("v", s.b, s.nk, s.hkv, s.d), od("o", s.b, s.nq, s.h, s.d), dod("do", s.b, s.nq, s.h, s.d),
      dqd("dq", s.b, s.nq, s.h, s.d), dkd("dk", s.b, s.nk, s.hkv, s.d),
      dvd("dv", s.b, s.nk, s.hkv, s.d);
  V3<T> ld("lse", s.b, s.h, s.nq);
  upload(r.q, qd);
  upload(r.k, kd);
  upload(r.v, vd);
  upload(r.dout, dod);
  attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask, opts);
  attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dqd, dkd, dvd, mask, opts);
  Kokkos::fence();
  r.o = download(od);
  r.dq = download(dqd);
  r.dk = download(dkd);
  r.dv = download(dvd);
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ld);
  r.lse.assign(lh.data(), lh.data() + lh.span());
  return r;
}

template <class T, class Mask>
void run_case(const Shape4& s, const Mask& mask, std::uint64_t seed, ForwardOptions opts = {}) {
  const Run r = forward_backward<T>(s, mask, seed, opts);
  const double scale = std::isnan(opts.scale) ? 1.0 / std::sqrt(double(s.d)) : opts.scale;
  const ReferenceGrads ref =
      reference_backward(r.q, r.k, r.v, r.dout, mask, scale, opts.q_offset, opts.k_offset);
  bool finite = true;
  const double eq = rel_err(r.dq, ref.dq, finite);
  const double ek = rel_err(r.dk, ref.dk, finite);
  const double ev = rel_err(r.dv, ref.dv, finite);
  INFO("B=", s.b, " Nq=", s.nq, " Nk=", s.nk, " H=", s.h, "/", s.hkv, " D=", s.d, " dq ", eq,
       " dk ", ek, " dv ", ev);
  CHECK(finite);
  CHECK(eq <= grad_tol<T>());
  CHECK(ek <= grad_tol<T>());
  CHECK(ev <= grad_tol<T>());
}

const Shape4 shapes[] = {{1, 1, 1, 1, 1, 64},
                         {1, 70, 45, 2, 1, 40},
                         {2, 64, 64, 2, 2, 64},
                         {1, 97, 130, 4, 2, 128},
                         {1, 50, 80, 1, 1, 200}};

}  // namespace

TEST_CASE_TEMPLATE("backward matches the fp64 reference for every mask", T, BLOCKATTN_TEST_TYPES) {
  std::uint64_t seed = 500;
  for (const Shape4& s : shapes) {
    run_case<T>(s, FullMask{}, ++seed);
    run_case<T>(s, CausalMask{}, ++seed);
    run_case<T>(s, SlidingWindowMask{17, 9}, ++seed);
    run_case<T>(s, PrefixLMMask{30}, ++seed);
    // Packed documents (offsets in the backend's memory), causal and windowed.
    std::vector<index_type> off{0};
    const index_type len = s.nq > s.nk ? s.nq : s.nk;
    for (index_type cut : {1, 9, 10, 44, 90})
      if (cut < len) off.push_back(cut);
    off.push_back(len);
    const Documents<MemSpace> docs(off);
    run_case<T>(s, docs.mask(), ++seed);
    run_case<T>(s, docs.mask(false, 12, 3), ++seed);
  }
  ForwardOptions opts;
  opts.q_offset = 100;
  opts.k_offset = 60;
  run_case<T>({1, 66, 90, 2, 1, 64}, CausalMask{}, 77, opts);
}

TEST_CASE_TEMPLATE("fully masked rows get zero gradients and no NaN", T, BLOCKATTN_TEST_TYPES) {
  // Keys start at position 40: causal queries 0..39 see nothing.
  ForwardOptions opts;
  opts.k_offset = 40;
  const int nq = 70, nk = 50, d = 32;
  std::mt19937_64 rng(9);
  HostTensor q = random_tensor(1, nq, 1, d, rng), k = random_tensor(1, nk, 1, d, rng),
             v = random_tensor(1, nk, 1, d, rng), dout = random_tensor(1, nq, 1, d, rng);
  V4<T> qd("q", 1, nq, 1, d), kd("k", 1, nk, 1, d), vd("v", 1, nk, 1, d), od("o", 1, nq, 1, d),
      dod("do", 1, nq, 1, d), dqd("dq", 1, nq, 1, d), dkd("dk", 1, nk, 1, d),
      dvd("dv", 1, nk, 1, d);
  V3<T> ld("lse", 1, 1, nq);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  upload(dout, dod);
  attention_forward(ExecSpace{}, qd, kd, vd, od, ld, CausalMask{}, opts);
  attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dqd, dkd, dvd, CausalMask{}, opts);
  const HostTensor dq = download(dqd), dk = download(dkd), dv = download(dvd);
  int zero_rows = 0;
  bool finite = true;
  for (int i = 0; i < nq; ++i) {
    bool zero = true;
    for (int x = 0; x < d; ++x) {
      finite = finite && std::isfinite(dq(0, i, 0, x));
      zero = zero && dq(0, i, 0, x) == 0.0;
    }
    zero_rows += i < 40 && zero;
  }
  for (double x : dk.data) finite = finite && std::isfinite(x);
  for (double x : dv.data) finite = finite && std::isfinite(x);
  CHECK(finite);
  // Rows 0..39 see no key: exactly zero.
  CHECK(zero_rows == 40);
  // Row 40 sees exactly one key (P = 1): dS = dP - Delta = dO.v - dO.o with o = v,
  // zero in exact arithmetic; the two dot products are summed in different
  // orders (the block product, the delta pass), so they may differ by up to
  // 2 d eps sum|dO_x v_x| (two d-term sums, gamma_d each). dq = scale dS k.
  double dov = 0, kmax = 0;
  for (int x = 0; x < d; ++x) {
    dov += std::abs(dout(0, 40, 0, x) * v(0, 0, 0, x));
    kmax = std::max(kmax, std::abs(k(0, 0, 0, x)));
  }
  const double eps = std::numeric_limits<T>::epsilon();
  const double bound = 2.0 * d * eps * dov * kmax / std::sqrt(double(d));
  for (int x = 0; x < d; ++x) {
    INFO("row 40, x = ", x, ": dq ", dq(0, 40, 0, x), ", bound ", bound);
    CHECK(std::abs(dq(0, 40, 0, x)) <= bound);
  }
}

#if !(defined(BLOCKATTN_TEST_FP32_ONLY) && BLOCKATTN_TEST_FP32_ONLY)  // fp64: backend.hpp
TEST_CASE("central finite differences agree with the backward (fp64, tiny shapes)") {
  // L = sum(dO o O); dL/dx ~ (L(x + h) - L(x - h)) / 2h with truncation error
  // ~h^2 |L'''| ~ 1e-10 and rounding ~eps |L| / h ~ 1e-11 at h = 1e-5; the
  // check allows 1e-6 relative to the largest gradient entry.
  const int nq = 9, nk = 11, h = 2, hkv = 1, d = 5;
  std::mt19937_64 rng(21);
  HostTensor q = random_tensor(1, nq, h, d, rng), k = random_tensor(1, nk, hkv, d, rng),
             v = random_tensor(1, nk, hkv, d, rng), dout = random_tensor(1, nq, h, d, rng);
  const CausalMask mask;
  ForwardOptions opts;
  opts.q_offset = nk - nq;
  auto loss = [&](const HostTensor& qq, const HostTensor& kk, const HostTensor& vv) {
    V4<double> qd("q", 1, nq, h, d), kd("k", 1, nk, hkv, d), vd("v", 1, nk, hkv, d),
        od("o", 1, nq, h, d);
    V3<double> ld("lse", 1, h, nq);
    HostTensor a = qq, b = kk, c = vv;
    upload(a, qd);
    upload(b, kd);
    upload(c, vd);
    attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask, opts);
    const HostTensor o = download(od);
    double l = 0;
    for (std::size_t i = 0; i < o.data.size(); ++i) l += o.data[i] * dout.data[i];
    return l;
  };
  V4<double> qd("q", 1, nq, h, d), kd("k", 1, nk, hkv, d), vd("v", 1, nk, hkv, d),
      od("o", 1, nq, h, d), dod("do", 1, nq, h, d), dqd("dq", 1, nq, h, d),
      dkd("dk", 1, nk, hkv, d), dvd("dv", 1, nk, hkv, d);
  V3<double> ld("lse", 1, h, nq);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  upload(dout, dod);
  attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask, opts);
  attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dqd, dkd, dvd, mask, opts);
  const HostTensor grads[3] = {download(dqd), download(dkd), download(dvd)};
  const double step = 1e-5;
  for (int which = 0; which < 3; ++which) {
    const HostTensor& g = grads[which];
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < g.data.size(); ++i) {
      HostTensor plus[3] = {q, k, v}, minus[3] = {q, k, v};
      plus[which].data[i] += step;
      minus[which].data[i] -= step;
      const double fd =
          (loss(plus[0], plus[1], plus[2]) - loss(minus[0], minus[1], minus[2])) / (2 * step);
      worst = std::max(worst, std::abs(fd - g.data[i]));
      scale = std::max(scale, std::abs(g.data[i]));
    }
    INFO("tensor ", which, " worst ", worst, " scale ", scale);
    CHECK(scale > 0);
    CHECK(worst <= 1e-6 * scale);
  }
}
#endif

TEST_CASE_TEMPLATE("fused and two-kernel backward give bitwise the same gradients", T,
                   BLOCKATTN_TEST_TYPES) {
  // impl::launch_backward picks the one-pass fused KeyKernel on host spaces when
  // there are enough (batch, kv head) pairs for the threads; both must sum in
  // the same order. Forced both ways here, every mask kind, GQA, padding.
  // With the key tiles split over 3 teams per pair (key_slices, for fewer
  // pairs than threads), dK and dV stay bitwise the same and dQ adds the 3
  // partial sums: equal within rounding (1e-12 fp64, 1e-5 fp32 of the largest
  // |dQ|; a sum of at most 4 tiles' partials in another order).
  using V4 = Kokkos::View<T****, MemSpace>;
  using V3 = Kokkos::View<T***, MemSpace>;
  for (const Shape4& s : {Shape4{2, 70, 45, 4, 2, 40}, Shape4{1, 130, 97, 2, 1, 64},
                          Shape4{1, 100, 100, 1, 1, 128}, Shape4{1, 200, 390, 2, 1, 24}}) {
    std::mt19937_64 rng(11);
    V4 q("q", s.b, s.nq, s.h, s.d), k("k", s.b, s.nk, s.hkv, s.d), v("v", s.b, s.nk, s.hkv, s.d),
        o("o", s.b, s.nq, s.h, s.d), dout("do", s.b, s.nq, s.h, s.d);
    V3 lse("lse", s.b, s.h, s.nq);
    HostTensor h_q = random_tensor(s.b, s.nq, s.h, s.d, rng);
    upload(h_q, q);
    HostTensor h_k = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
    upload(h_k, k);
    HostTensor h_v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
    upload(h_v, v);
    HostTensor h_dout = random_tensor(s.b, s.nq, s.h, s.d, rng);
    upload(h_dout, dout);
    auto both = [&](const auto& mask) {
      attention_forward(ExecSpace{}, q, k, v, o, lse, mask);
      V4 dq[3], dk[3], dv[3];
      for (int f = 0; f < 3; ++f) {
        dq[f] = V4("dq", s.b, s.nq, s.h, s.d);
        dk[f] = V4("dk", s.b, s.nk, s.hkv, s.d);
        dv[f] = V4("dv", s.b, s.nk, s.hkv, s.d);
        using Shape = BackwardTileShape<T, impl::is_host_space_v<ExecSpace>>;
        impl::with_shape_for<Shape>(s.d, [&](auto static_d, auto shape) {
          constexpr int SD = decltype(static_d)::value;
          using S = decltype(shape);
          const int dp = impl::padded_head_dim<S, SD>(s.d);
          auto keys = impl::allocate_packed_keys<T, MemSpace>(s.b, s.hkv, s.nk, dp, S::block_k);
          impl::pack_keys(ExecSpace{}, k, v, keys);
          auto queries = impl::allocate_packed_queries<T, MemSpace>(s.b, s.h, s.nq, dp, S::block_q);
          impl::pack_queries<impl::kernel_isa_v<ExecSpace, S>>(ExecSpace{}, q, dout, o, lse,
                                                               queries);
          impl::ForwardExtents e{s.b, s.h, s.hkv, s.nq, s.nk, s.d};
          impl::BackwardBlock blk;
          blk.kernels =
              f == 0 ? impl::BackwardBlock::Kernels::split : impl::BackwardBlock::Kernels::fused;
          blk.key_slices = f == 2 ? 3 : 1;
          impl::launch_backward<ExecSpace, T, SD, S>(
              ExecSpace{}, e, queries, keys, dq[f], dk[f], dv[f], mask, OffsetPositions{0},
              OffsetPositions{0}, T(1 / std::sqrt(double(s.d))), blk);
        });
        Kokkos::fence();
      }
      for (auto pair : {std::make_pair(dq[0], dq[1]), std::make_pair(dk[0], dk[1]),
                        std::make_pair(dv[0], dv[1]), std::make_pair(dk[0], dk[2]),
                        std::make_pair(dv[0], dv[2])}) {
        auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, pair.first);
        auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, pair.second);
        CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
      }
      auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, dq[0]);
      auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, dq[2]);
      double largest = 0, worst = 0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        largest = std::max(largest, std::abs(double(a.data()[i])));
        worst = std::max(worst, std::abs(double(a.data()[i]) - double(b.data()[i])));
      }
      INFO("dQ with 3 key slices: largest difference ", worst, " of largest |dQ| ", largest);
      CHECK(largest > 0);
      CHECK(worst <= (std::is_same<T, double>::value ? 1e-12 : 1e-5) * largest);
    };
    both(FullMask{});
    both(CausalMask{});
    both(causal_window(30));
  }
}

namespace {

/// O, LSE, dQ, dK, dV of one causal forward + backward call, flattened.
template <class T>
std::vector<double> flat_outputs(const Shape4& s, std::uint64_t seed) {
  const Run r = forward_backward<T>(s, CausalMask{}, seed);
  std::vector<double> all;
  for (const HostTensor* t : {&r.o, &r.dq, &r.dk, &r.dv})
    all.insert(all.end(), t->data.begin(), t->data.end());
  all.insert(all.end(), r.lse.begin(), r.lse.end());
  return all;
}

}  // namespace

TEST_CASE_TEMPLATE("the buffer cache gives the results of per-call allocation", T,
                   BLOCKATTN_TEST_TYPES) {
  // Calls carve their packed blocks from a cached buffer that earlier, larger
  // calls filled: a small call after a large one must still see zero padding
  // and zeroed dQ accumulators, and blocks of one call must not overlap.
  const Shape4 calls[] = {{1, 70, 45, 2, 1, 40},
                          {2, 200, 260, 2, 1, 64},
                          {1, 33, 20, 1, 1, 8},
                          {1, 130, 97, 4, 2, 128},
                          {1, 70, 45, 2, 1, 40}};
  const std::size_t limit = buffer_cache_limit();
  // The default: a sixteenth of physical memory within [64 MiB, 4 GiB], or
  // BLOCKATTN_BUFFER_CACHE_MB (whole MiB; anything else is an error naming it).
  if (std::getenv("BLOCKATTN_BUFFER_CACHE_MB") == nullptr) {
    CHECK(limit >= (std::size_t(64) << 20));
    CHECK(limit <= (std::size_t(4) << 30));
  }
  CHECK(impl::parse_buffer_cache_mb("0") == 0);
  CHECK(impl::parse_buffer_cache_mb("256") == (std::size_t(256) << 20));
  for (const char* bad : {"", "-1", "1.5", "64MB", "9999999999"}) {
    INFO("BLOCKATTN_BUFFER_CACHE_MB=\"", bad, "\"");
    CHECK_THROWS_WITH_AS(impl::parse_buffer_cache_mb(bad),
                         doctest::Contains("BLOCKATTN_BUFFER_CACHE_MB"), invalid_argument);
  }
  std::vector<std::vector<double>> cached, uncached, tight;
  for (const Shape4& s : calls) cached.push_back(flat_outputs<T>(s, 3));
  set_buffer_cache_limit(0);  // off: every block allocated and freed per call
  CHECK(buffer_cache_limit() == 0);
  for (const Shape4& s : calls) uncached.push_back(flat_outputs<T>(s, 3));
  set_buffer_cache_limit(64 << 10);  // smaller than the larger calls need
  for (const Shape4& s : calls) tight.push_back(flat_outputs<T>(s, 3));
  set_buffer_cache_limit(limit);
  for (std::size_t i = 0; i < cached.size(); ++i) {
    INFO("call ", i);
    CHECK(cached[i] == uncached[i]);
    CHECK(tight[i] == uncached[i]);
  }
}

TEST_CASE_TEMPLATE(
    "every backward input and output in LayoutLeft gives bitwise the LayoutRight "
    "gradients",
    T, BLOCKATTN_TEST_TYPES) {
  // pack_queries and pack_keys read the user's rows through their stride: a
  // column-major Q, K, V, O, LSE, dO (head-dim stride = batch x seq x heads)
  // and column-major dQ, dK, dV give bitwise the gradients of row-major ones.
  // Shapes with query, key and head-dim padding, and GQA.
  using VR = Kokkos::View<T****, Kokkos::LayoutRight, MemSpace>;
  using VL = Kokkos::View<T****, Kokkos::LayoutLeft, MemSpace>;
  using LR = Kokkos::View<T***, Kokkos::LayoutRight, MemSpace>;
  using LL = Kokkos::View<T***, Kokkos::LayoutLeft, MemSpace>;
  for (const Shape4& s : {Shape4{2, 70, 45, 4, 2, 40}, Shape4{1, 97, 130, 2, 1, 128}}) {
    std::mt19937_64 rng(23);
    HostTensor hq = random_tensor(s.b, s.nq, s.h, s.d, rng);
    HostTensor hk = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
    HostTensor hv = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
    HostTensor hdo = random_tensor(s.b, s.nq, s.h, s.d, rng);
    VR q("q", s.b, s.nq, s.h, s.d), k("k", s.b, s.nk, s.hkv, s.d), v("v", s.b, s.nk, s.hkv, s.d),
        o("o", s.b, s.nq, s.h, s.d), dout("do", s.b, s.nq, s.h, s.d), dq("dq", s.b, s.nq, s.h, s.d),
        dk("dk", s.b, s.nk, s.hkv, s.d), dv("dv", s.b, s.nk, s.hkv, s.d);
    VL ql("ql", s.b, s.nq, s.h, s.d), kl("kl", s.b, s.nk, s.hkv, s.d),
        vl("vl", s.b, s.nk, s.hkv, s.d), ol("ol", s.b, s.nq, s.h, s.d),
        doutl("dol", s.b, s.nq, s.h, s.d), dql("dql", s.b, s.nq, s.h, s.d),
        dkl("dkl", s.b, s.nk, s.hkv, s.d), dvl("dvl", s.b, s.nk, s.hkv, s.d);
    LR lse("lse", s.b, s.h, s.nq);
    LL lsel("lsel", s.b, s.h, s.nq);
    upload(hq, q);
    upload(hk, k);
    upload(hv, v);
    upload(hdo, dout);
    upload(hq, ql);
    upload(hk, kl);
    upload(hv, vl);
    upload(hdo, doutl);
    attention_forward(ExecSpace{}, q, k, v, o, lse, CausalMask{});
    Kokkos::deep_copy(ol, o);
    Kokkos::deep_copy(lsel, lse);
    attention_backward(ExecSpace{}, q, k, v, o, lse, dout, dq, dk, dv, CausalMask{});
    attention_backward(ExecSpace{}, ql, kl, vl, ol, lsel, doutl, dql, dkl, dvl, CausalMask{});
    Kokkos::fence();
    INFO("B=", s.b, " Nq=", s.nq, " Nk=", s.nk, " H=", s.h, "/", s.hkv, " D=", s.d);
    const HostTensor right = download(dq);
    CHECK(right.data == download(dql).data);
    CHECK(download(dk).data == download(dkl).data);
    CHECK(download(dv).data == download(dvl).data);
    CHECK(right.data != std::vector<double>(right.data.size(), 0.0));
  }
}
