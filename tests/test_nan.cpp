// SPDX-License-Identifier: Apache-2.0
// NaN and Inf: a non-finite input reaches exactly the outputs that can see it.
// One NaN (or Inf) is placed in Q, K, V or dO; forward and backward must give
// non-finite values exactly in the rows the semantics below name, and every
// other row must equal the fp64 reference of the same inputs with the poisoned
// entry set to 0 (it is invisible to those rows). Semantics (README "NaN and Inf"):
//   a row whose allowed logits contain a NaN (Q row or an allowed K row
//   non-finite): O row and LSE NaN;  V non-finite at (key c, column d): O(r, d)
//   non-finite for the rows r allowed to see c;  masked keys contribute
//   exactly nothing (selected out, never multiplied by 0);  gradients likewise.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend.hpp"
#include "forward_check.hpp"
#include "reference.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

template <class T>
using V4 = Kokkos::View<T****, MemSpace>;
template <class T>
using V3 = Kokkos::View<T***, MemSpace>;

enum class Where { q, k, v, dout };

struct Poison {
  Where where;
  int row;   // token
  int head;  // q head for q / dout, kv head for k / v
  int col;   // head-dim index
  double value;
};

template <class View>
HostTensor download4(const View& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  HostTensor t(int(v.extent(0)), int(v.extent(1)), int(v.extent(2)), int(v.extent(3)));
  for (int a = 0; a < t.b; ++a)
    for (int n = 0; n < t.n; ++n)
      for (int x = 0; x < t.h; ++x)
        for (int d = 0; d < t.d; ++d) t(a, n, x, d) = double(h(a, n, x, d));
  return t;
}

/// Which output rows must be non-finite, from the mask and the poison.
template <class Mask>
struct Expected {
  int n, h, hkv, group;
  std::vector<char> logit_bad, row_bad, o_bad_col;  // (h, n); o_bad_col: (h, n) column or -1
  std::vector<char> dk_bad, dv_bad;                 // (hkv, n)
  std::vector<int> o_col;
  Expected(const Mask& mask, int n_, int h_, int hkv_, const Poison& p)
      : n(n_), h(h_), hkv(hkv_), group(h_ / hkv_) {
    logit_bad.assign(std::size_t(h) * n, 0);
    row_bad.assign(std::size_t(h) * n, 0);
    o_col.assign(std::size_t(h) * n, -1);
    dk_bad.assign(std::size_t(hkv) * n, 0);
    dv_bad.assign(std::size_t(hkv) * n, 0);
    std::vector<char> dout_bad(std::size_t(h) * n, 0);
    for (int x = 0; x < h; ++x)
      for (int r = 0; r < n; ++r) {
        bool any_key = false;
        for (int c = 0; c < n; ++c) any_key = any_key || mask.allowed(r, c);
        if (!any_key) continue;  // fully masked: O = 0, LSE = -inf, no gradient
        const std::size_t i = std::size_t(x) * n + r;
        const bool sees = mask.allowed(r, p.row);
        const bool same_kv = x / group == p.head;
        if (p.where == Where::q && x == p.head && r == p.row) logit_bad[i] = 1;
        if (p.where == Where::k && same_kv && sees) logit_bad[i] = 1;
        if (p.where == Where::v && same_kv && sees) o_col[i] = p.col;
        if (p.where == Where::dout && x == p.head && r == p.row) dout_bad[i] = 1;
        // A row whose dS can hold a NaN: its logits, its O (through D), its dO.
        row_bad[i] = logit_bad[i] || o_col[i] >= 0 || dout_bad[i];
      }
    for (int x = 0; x < h; ++x)
      for (int r = 0; r < n; ++r) {
        const std::size_t i = std::size_t(x) * n + r;
        for (int c = 0; c < n; ++c) {
          if (!mask.allowed(r, c)) continue;
          const std::size_t j = std::size_t(x / group) * n + c;
          if (row_bad[i]) dk_bad[j] = 1;                   // dK += dS^T Q
          if (logit_bad[i] || dout_bad[i]) dv_bad[j] = 1;  // dV += P^T dO
        }
      }
  }
};

bool row_finite(const HostTensor& t, int b, int r, int x) {
  for (int d = 0; d < t.d; ++d)
    if (!std::isfinite(t(b, r, x, d))) return false;
  return true;
}

template <class T, class Mask>
void check_poison(const Mask& mask, const Poison& p) {
  const int n = 150, h = 2, hkv = 1, d = 40;
  INFO("poison where=", int(p.where), " row=", p.row, " head=", p.head, " col=", p.col,
       " value=", p.value, " T=", sizeof(T) == 4 ? "float" : "double");
  std::mt19937_64 rng(1234);
  HostTensor q = random_tensor(1, n, h, d, rng), k = random_tensor(1, n, hkv, d, rng),
             v = random_tensor(1, n, hkv, d, rng), dout = random_tensor(1, n, h, d, rng);
  V4<T> qd("q", 1, n, h, d), kd("k", 1, n, hkv, d), vd("v", 1, n, hkv, d), od("o", 1, n, h, d),
      dod("do", 1, n, h, d), dqd("dq", 1, n, h, d), dkd("dk", 1, n, hkv, d),
      dvd("dv", 1, n, hkv, d);
  V3<T> ld("lse", 1, h, n);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  upload(dout, dod);
  // The reference sees 0 at the poisoned entry (invisible to the rows it checks).
  HostTensor* target = p.where == Where::q   ? &q
                       : p.where == Where::k ? &k
                       : p.where == Where::v ? &v
                                             : &dout;
  const auto& dst = p.where == Where::q   ? qd
                    : p.where == Where::k ? kd
                    : p.where == Where::v ? vd
                                          : dod;
  (*target)(0, p.row, p.head, p.col) = 0.0;
  upload(*target, dst);
  {
    auto hv = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dst);
    hv(0, p.row, p.head, p.col) = T(p.value);
    Kokkos::deep_copy(dst, hv);
  }
  const double scale = 1.0 / std::sqrt(double(d));
  attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask);
  attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dqd, dkd, dvd, mask);
  ExecSpace().fence();
  const auto ref = reference_attention(q, k, v, mask, scale);
  const auto grads = reference_backward(q, k, v, dout, mask, scale);
  const HostTensor o = download4(od), dq = download4(dqd), dk = download4(dkd), dv = download4(dvd);
  auto lse = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ld);
  const Expected<Mask> want(mask, n, h, hkv, p);
  const double tol = std::is_same<T, double>::value ? 1e-11 : 2e-4;
  int wrong = 0;
  auto report = [&](const char* what, int r, int x, bool expect_bad, bool is_bad) {
    if (expect_bad == is_bad) return;
    if (++wrong <= 8) {
      const std::string msg = std::string(what) + " row " + std::to_string(r) + " head " +
                              std::to_string(x) + ": expected " +
                              (expect_bad ? "non-finite" : "finite") + ", got " +
                              (is_bad ? "non-finite" : "finite");
      MESSAGE(msg);
    }
  };
  double err_o = 0, err_g = 0, gmax = 1e-300;
  for (int x = 0; x < hkv; ++x)
    for (int r = 0; r < n; ++r)
      for (int c = 0; c < d; ++c)
        gmax = std::max({gmax, std::abs(grads.dk(0, r, x, c)), std::abs(grads.dv(0, r, x, c))});
  for (int x = 0; x < h; ++x)
    for (int r = 0; r < n; ++r) {
      const std::size_t i = std::size_t(x) * n + r;
      const double l = double(lse(0, x, r));
      report("LSE", r, x, want.logit_bad[i], std::isnan(l));
      if (!want.logit_bad[i] && std::isfinite(ref.lse[i])) {
        for (int c = 0; c < d; ++c) {
          const bool bad = !std::isfinite(o(0, r, x, c));
          const bool expect = want.o_col[i] == c;
          report("O", r, x, expect, bad);
          if (!bad && !expect) err_o = std::max(err_o, std::abs(o(0, r, x, c) - ref.o(0, r, x, c)));
        }
      } else if (want.logit_bad[i]) {
        report("O (whole row)", r, x, true,
               row_finite(o, 0, r, x) == false && std::isnan(o(0, r, x, 0)));
      }
      report("dQ", r, x, want.row_bad[i], !row_finite(dq, 0, r, x));
      if (!want.row_bad[i])
        for (int c = 0; c < d; ++c)
          err_g = std::max(err_g, std::abs(dq(0, r, x, c) - grads.dq(0, r, x, c)));
    }
  for (int x = 0; x < hkv; ++x)
    for (int r = 0; r < n; ++r) {
      const std::size_t j = std::size_t(x) * n + r;
      report("dK", r, x, want.dk_bad[j], !row_finite(dk, 0, r, x));
      report("dV", r, x, want.dv_bad[j], !row_finite(dv, 0, r, x));
      for (int c = 0; c < d; ++c) {
        if (!want.dk_bad[j])
          err_g = std::max(err_g, std::abs(dk(0, r, x, c) - grads.dk(0, r, x, c)));
        if (!want.dv_bad[j])
          err_g = std::max(err_g, std::abs(dv(0, r, x, c) - grads.dv(0, r, x, c)));
      }
    }
  CHECK(wrong == 0);
  CHECK(err_o <= tol);
  CHECK(err_g / gmax <= tol);
}

template <class T>
void check_all_places() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  // Row / key 70 sits inside a tile on every tile shape; window 37 makes
  // partial tiles whose other rows must stay clean.
  const SlidingWindowMask window = causal_window(37);
  // NaN of either sign (x86's default NaN, from 0 * inf, is negative) in Q,
  // K, V, dO; Inf in V and dO. (An Inf in Q or K makes logits +-Inf: a row
  // whose allowed logits are all -Inf is indistinguishable from a masked row
  // and gives O = 0, LSE = -inf; see the README.)
  for (double bad : {nan, -nan}) {
    check_poison<T>(window, {Where::q, 70, 1, 5, bad});
    check_poison<T>(window, {Where::k, 70, 0, 5, bad});
    check_poison<T>(CausalMask{}, {Where::q, 3, 0, 0, bad});
    check_poison<T>(CausalMask{}, {Where::k, 131, 0, 7, bad});
  }
  for (double bad : {nan, -nan, inf, -inf}) {
    check_poison<T>(window, {Where::v, 70, 0, 5, bad});
    check_poison<T>(window, {Where::dout, 70, 0, 5, bad});
    check_poison<T>(CausalMask{}, {Where::v, 140, 0, 39, bad});
    check_poison<T>(CausalMask{}, {Where::dout, 100, 1, 2, bad});
  }
  // Full mask: every row sees everything.
  check_poison<T>(FullMask{}, {Where::k, 0, 0, 0, nan});
}

}  // namespace

TEST_CASE_TEMPLATE("NaN and Inf reach exactly the outputs that can see them", T, double, float) {
  check_all_places<T>();
}
