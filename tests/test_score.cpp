// SPDX-License-Identifier: Apache-2.0
// Score policies (policy/score.hpp) and attention sinks (kernel/sinks.hpp) on
// one device: forward and backward against the fp64 reference with the
// modification applied, the gradients also against central finite
// differences, the rules for huge logits and fully masked rows, decode, and
// the argument checks.
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
#include "score_policies.hpp"
#include "user_masks.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

template <class T>
using V4 = Kokkos::View<T****, MemSpace>;
template <class T>
using V3 = Kokkos::View<T***, MemSpace>;

struct Shape4 {
  int b, nq, nk, h, hkv, d;
};

/// max |a - b| / max |b| (false in `finite` on a non-finite entry of a).
double rel_err(const std::vector<double>& a, const std::vector<double>& b, bool& finite) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) finite = false;
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return den > 0 ? num / den : num;
}

/// Sink logits on the device (fp32) and their values as the reference sees them.
struct Sinks {
  Kokkos::View<float*, MemSpace> logits, grad;
  std::vector<double> values;
  explicit Sinks(const std::vector<float>& s)
      : logits("sinks", s.size()), grad("sink_grad", s.size()) {
    auto h = Kokkos::create_mirror_view(logits);
    for (std::size_t i = 0; i < s.size(); ++i) {
      h(i) = s[i];
      values.push_back(double(s[i]));
    }
    Kokkos::deep_copy(logits, h);
  }
  std::vector<double> gradient() const {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), grad);
    return std::vector<double>(h.data(), h.data() + h.extent(0));
  }
};

/// Inputs, and what attention_forward + attention_backward make of them.
struct Run {
  HostTensor q, k, v, dout;
  HostTensor o, dq, dk, dv;
  std::vector<double> lse, dsink;
  std::vector<double> lse_forward;  // read before the backward ran
};

template <class T, class Mask>
Run forward_backward(const Shape4& s, const Mask& mask, std::uint64_t seed, ForwardOptions opts,
                     const Sinks* sinks, double amplitude) {
  std::mt19937_64 rng(seed);
  Run r;
  r.q = random_tensor(s.b, s.nq, s.h, s.d, rng, amplitude);
  r.k = random_tensor(s.b, s.nk, s.hkv, s.d, rng, amplitude);
  r.v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  r.dout = random_tensor(s.b, s.nq, s.h, s.d, rng);
  V4<T> qd("q", s.b, s.nq, s.h, s.d), kd("k", s.b, s.nk, s.hkv, s.d),
      vd("v", s.b, s.nk, s.hkv, s.d), od("o", s.b, s.nq, s.h, s.d), dod("do", s.b, s.nq, s.h, s.d),
      dqd("dq", s.b, s.nq, s.h, s.d), dkd("dk", s.b, s.nk, s.hkv, s.d),
      dvd("dv", s.b, s.nk, s.hkv, s.d);
  V3<compute_t<T>> ld("lse", s.b, s.h, s.nq);
  upload(r.q, qd);
  upload(r.k, kd);
  upload(r.v, vd);
  upload(r.dout, dod);
  if (sinks) {
    opts.sinks = sinks->logits;
    opts.sink_grad = sinks->grad;
  }
  attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask, opts);
  {
    auto lf = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ld);
    for (int b = 0; b < s.b; ++b)
      for (int h = 0; h < s.h; ++h)
        for (int i = 0; i < s.nq; ++i) r.lse_forward.push_back(lf(b, h, i));
  }
  attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dqd, dkd, dvd, mask, opts);
  Kokkos::fence();
  r.o = download(od);
  r.dq = download(dqd);
  r.dk = download(dkd);
  r.dv = download(dvd);
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ld);
  // (batch, head, row) order whatever the View's layout (LayoutLeft on GPUs).
  for (int b = 0; b < s.b; ++b)
    for (int h = 0; h < s.h; ++h)
      for (int i = 0; i < s.nq; ++i) r.lse.push_back(lh(b, h, i));
  if (sinks) r.dsink = sinks->gradient();
  return r;
}

/// Gradient tolerance relative to the largest entry (test_backward.cpp's
/// budget; 16-bit: the inputs are exact, the fp32 compute rounds once into
/// bf16 / fp16 outputs: 2^-7 relative, 4x margin).
template <class T>
double grad_tol() {
  if constexpr (std::is_same<T, double>::value) return 1e-11;
  if constexpr (std::is_same<T, float>::value) return 1e-4;
  return 3e-2;
}

/// Forward and backward of one (mask, policy, sinks) case against the fp64
/// reference with the modification applied.
template <class T, class Mask>
void check_case(const Shape4& s, const Mask& mask, std::uint64_t seed, const Sinks* sinks = nullptr,
                double amplitude = 2.0, ForwardOptions opts = {}) {
  const Run r = forward_backward<T>(s, mask, seed, opts, sinks, amplitude);
  const double scale = 1.0 / std::sqrt(double(s.d));
  const std::vector<double>* sv = sinks ? &sinks->values : nullptr;
  const ReferenceResult ref =
      reference_attention(r.q, r.k, r.v, mask, scale, opts.q_offset, opts.k_offset, sv);
  // The O a 16-bit forward returned (rounded) is what its backward uses.
  const HostTensor* o_used = std::is_same<compute_t<T>, T>::value ? nullptr : &r.o;
  const ReferenceGrads g = reference_backward(r.q, r.k, r.v, r.dout, mask, scale, opts.q_offset,
                                              opts.k_offset, o_used, sv);
  bool finite = true;
  const double eo = rel_err(r.o.data, ref.o.data, finite);
  // The LSE as the forward returned it, and as read after the backward
  // (which must leave it alone).
  double el = 0.0, el_fwd = 0.0;
  for (std::size_t i = 0; i < r.lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      CHECK(r.lse_forward[i] == ref.lse[i]);
      CHECK(r.lse[i] == ref.lse[i]);
      continue;
    }
    el_fwd = std::max(el_fwd, std::abs(r.lse_forward[i] - ref.lse[i]));
    el = std::max(el, std::abs(r.lse[i] - ref.lse[i]));
  }
  const double eq = rel_err(r.dq.data, g.dq.data, finite);
  const double ek = rel_err(r.dk.data, g.dk.data, finite);
  const double ev = rel_err(r.dv.data, g.dv.data, finite);
  const double es = sinks ? rel_err(r.dsink, g.dsink, finite) : 0.0;
  const double tol = grad_tol<T>();
  INFO("B=", s.b, " Nq=", s.nq, " Nk=", s.nk, " H=", s.h, "/", s.hkv, " D=", s.d, " o ", eo,
       " lse ", el_fwd, " (after the backward ", el, ") dq ", eq, " dk ", ek, " dv ", ev, " dsink ",
       es, " tol ", tol);
  CHECK(finite);
  CHECK(eo <= tol);
  CHECK(el_fwd <= (std::is_same<compute_t<T>, double>::value ? 1e-11 : 1e-4));
  CHECK(el <= (std::is_same<compute_t<T>, double>::value ? 1e-11 : 1e-4));
  CHECK(eq <= tol);
  CHECK(ek <= tol);
  CHECK(ev <= tol);
  CHECK(es <= std::max(tol, 1e-6));  // dL/dsinks is returned in fp32
}

const Shape4 shapes[] = {{1, 70, 90, 4, 2, 32}, {2, 130, 130, 4, 4, 64}};

template <class T>
void every_policy(std::uint64_t seed) {
  std::vector<index_type> off{0, 9, 40, 41, 100, 130};
  const Documents<MemSpace> docs(off);
  const Sinks sinks({0.5f, -1.0f, 2.0f, -std::numeric_limits<float>::infinity()});
  for (const Shape4& s : shapes) {
    const Alibi alibi = Alibi::geometric(s.h);
    for (const Sinks* sk : {static_cast<const Sinks*>(nullptr), &sinks}) {
      check_case<T>(s, with_score(CausalMask{}, SoftCap{1.5}), ++seed, sk);
      check_case<T>(s, with_score(causal_window(24), SoftCap{1.5}), ++seed, sk);
      check_case<T>(s, with_score(docs.mask(), SoftCap{1.5}), ++seed, sk);
      check_case<T>(s, with_score(CausalMask{}, alibi), ++seed, sk);
      check_case<T>(s, with_score(causal_window(24), alibi), ++seed, sk);
      check_case<T>(s, with_score(docs.mask(), alibi), ++seed, sk);
      check_case<T>(s, with_score(CausalMask{}, HeadTemperature{0.25}), ++seed, sk);
      check_case<T>(s, with_score(causal_window(24), HeadTemperature{0.25}), ++seed, sk);
      check_case<T>(s, with_score(docs.mask(), HeadTemperature{0.25}), ++seed, sk);
      // Sinks alone, and the symmetric ALiBi without a mask.
      check_case<T>(s, causal_window(24), ++seed, sk);
      check_case<T>(s, with_score(FullMask{}, Alibi::geometric(s.h, true)), ++seed, sk);
    }
  }
}

/// The bf16 backward of one case twice from the same forward (fp32 kernels):
/// with HostMatrix::automatic (the host matrix engine where this CPU has one)
/// and with HostMatrix::off (the fp32 kernels). Both against the fp64
/// gradients (the engine's rounding of P and dS adds at most 2^-8 of the
/// largest entry: within grad_tol<bf16>), or, with `nan_at` >= 0 (a NaN in q
/// at that row of head 1), NaN in the same gradient entries on both paths.
/// Returns how many gradient entries differ between the two.
template <class Mask>
long engine_against_fp32(const Shape4& s, const Mask& mask, std::uint64_t seed, int nan_at = -1) {
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng, 2.0);
  HostTensor k = random_tensor(s.b, s.nk, s.hkv, s.d, rng, 2.0);
  HostTensor v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  HostTensor dout = random_tensor(s.b, s.nq, s.h, s.d, rng);
  if (nan_at >= 0) q(0, nan_at, 1, 3) = std::numeric_limits<double>::quiet_NaN();
  V4<bf16> qd("q", s.b, s.nq, s.h, s.d), kd("k", s.b, s.nk, s.hkv, s.d),
      vd("v", s.b, s.nk, s.hkv, s.d), od("o", s.b, s.nq, s.h, s.d), dod("do", s.b, s.nq, s.h, s.d);
  V3<float> ld("lse", s.b, s.h, s.nq);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  upload(dout, dod);
  ForwardOptions opts;
  opts.host_matrix = HostMatrix::off;
  attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask, opts);
  const HostTensor o = download(od);
  HostTensor g[2][3];
  for (int w = 0; w < 2; ++w) {
    opts.host_matrix = w == 0 ? HostMatrix::off : HostMatrix::automatic;
    V4<bf16> dq("dq", s.b, s.nq, s.h, s.d), dk("dk", s.b, s.nk, s.hkv, s.d),
        dv("dv", s.b, s.nk, s.hkv, s.d);
    attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dq, dk, dv, mask, opts);
    Kokkos::fence();
    g[w][0] = download(dq);
    g[w][1] = download(dk);
    g[w][2] = download(dv);
  }
  long differ = 0;
  for (int x = 0; x < 3; ++x)
    for (std::size_t i = 0; i < g[0][x].data.size(); ++i) {
      const double a = g[0][x].data[i], b = g[1][x].data[i];
      differ += !(a == b || (a != a && b != b));
    }
  INFO("B=", s.b, " Nq=", s.nq, " Nk=", s.nk, " H=", s.h, "/", s.hkv, " D=", s.d);
  if (nan_at >= 0) {
    long nan_off = 0, nan_mismatch = 0;
    for (int x = 0; x < 3; ++x)
      for (std::size_t i = 0; i < g[0][x].data.size(); ++i) {
        const bool a = std::isnan(g[0][x].data[i]), b = std::isnan(g[1][x].data[i]);
        nan_off += a;
        nan_mismatch += a != b;
      }
    CHECK(nan_off > 0);
    CHECK(nan_mismatch == 0);
    return differ;
  }
  const double scale = 1.0 / std::sqrt(double(s.d));
  const ReferenceGrads ref = reference_backward(q, k, v, dout, mask, scale, 0, 0, &o, nullptr);
  const double tol = grad_tol<bf16>();
  for (int w = 0; w < 2; ++w) {
    bool finite = true;
    const double eq = rel_err(g[w][0].data, ref.dq.data, finite);
    const double ek = rel_err(g[w][1].data, ref.dk.data, finite);
    const double ev = rel_err(g[w][2].data, ref.dv.data, finite);
    INFO(std::string(w == 0 ? "fp32 kernels" : "automatic"), ": dq ", eq, " dk ", ek, " dv ", ev,
         " tol ", tol);
    CHECK(finite);
    CHECK(eq <= tol);
    CHECK(ek <= tol);
    CHECK(ev <= tol);
  }
  return differ;
}

}  // namespace

TEST_CASE("bf16 backward with a score policy on the host matrix engine") {
  // Where this CPU runs the bf16 backward on its matrix engine (AMX, or
  // AVX512-BF16 on AMD), a scored mask's backward runs there too (the
  // policy's pass on the key-major tiles): the gradients must differ from the
  // fp32 kernels' (the engine ran) and both meet the fp64 bound; elsewhere
  // both settings run the fp32 kernels and give the same bits. Masks with
  // and without allowed_keys (the keep-byte path), GQA, head dims padded.
  std::vector<index_type> off{0, 9, 40, 41, 100, 130, 170};
  const Documents<MemSpace> docs(off);
  const Shape4 cases[] = {{1, 200, 150, 4, 2, 64}, {2, 130, 130, 4, 4, 128}, {1, 70, 90, 2, 1, 40}};
  BackwardBlockOptions blk;
  blk.operands_bf16 = true;
  std::uint64_t seed = 3100;
  for (const Shape4& s : cases) {
    const auto m1 = with_score(CausalMask{}, SoftCap{1.5});
    const auto m2 = with_score(docs.mask(), Alibi::geometric(s.h));
    const auto m3 = with_score(causal_window(24), HeadTemperature{0.25});
    const auto m4 = with_score(DocumentCausalMask{37}, SoftCap{1.5});
    const auto m5 = with_score(FullMask{}, Alibi::geometric(s.h, true));
    const bool engine = backward_uses_matrix<float, ExecSpace, decltype(m1)>(s.d, blk);
    CHECK(backward_uses_matrix<float, ExecSpace, decltype(m4)>(s.d, blk) == engine);
    const long d[] = {engine_against_fp32(s, m1, ++seed), engine_against_fp32(s, m2, ++seed),
                      engine_against_fp32(s, m3, ++seed), engine_against_fp32(s, m4, ++seed),
                      engine_against_fp32(s, m5, ++seed)};
    for (const long x : d) CHECK((x > 0) == engine);
    // A NaN in q: the same gradient entries are NaN on both paths (partial
    // tile pairs whose Q holds it add their products by selects).
    engine_against_fp32(s, m1, ++seed, s.nq / 2);
    engine_against_fp32(s, m4, ++seed, s.nq / 3);
    if (!engine)
      MESSAGE("SKIPPED: the bf16 scored backward on the host matrix engine (",
              impl::host_matrix_engine().reason, ")");
  }
}

TEST_CASE("score policies and sinks match the fp64 reference, forward and backward") {
  // fp32, every case; fp64 (the portable kernel) on one of each policy (its
  // gradients also against finite differences below): every case in fp64 too
  // cost a minute of CI's compile time.
  every_policy<float>(900);
  std::vector<index_type> off{0, 9, 40, 41, 100, 130};
  const Documents<MemSpace> docs(off);
  const Sinks sinks({0.5f, -1.0f, 2.0f, -std::numeric_limits<float>::infinity()});
  for (const Shape4& s : shapes) {
    check_case<double>(s, with_score(docs.mask(), SoftCap{1.5}), 951, &sinks);
    check_case<double>(s, with_score(CausalMask{}, Alibi::geometric(s.h)), 952, &sinks);
    check_case<double>(s, with_score(causal_window(24), HeadTemperature{0.25}), 953);
  }
}

TEST_CASE("score policies and sinks in bf16 and fp16 (fp32 compute) match the fp64 reference") {
  // Each policy and each mask once (the fp32 kernels' 16-bit storage paths).
  const Sinks sinks({0.5f, -1.0f, 2.0f, 0.0f});
  std::vector<index_type> off{0, 9, 40, 41, 100, 130};
  const Documents<MemSpace> docs(off);
  for (const Shape4& s : shapes) {
    check_case<bf16>(s, with_score(CausalMask{}, SoftCap{1.5}), 1901, &sinks);
    check_case<bf16>(s, with_score(docs.mask(), Alibi::geometric(s.h)), 1902, &sinks);
    check_case<bf16>(s, with_score(causal_window(24), HeadTemperature{0.25}), 1903, &sinks);
    check_case<bf16>(s, with_score(causal_window(24), HeadTemperature{0.25}), 1904);
  }
  check_case<fp16>({1, 70, 90, 4, 2, 32}, with_score(CausalMask{}, SoftCap{1.5}), 2901, &sinks);
  check_case<fp16>({1, 70, 90, 4, 2, 32}, with_score(CausalMask{}, Alibi::geometric(4)), 2902,
                   &sinks);
}

TEST_CASE("the gradients of a score policy and of the sinks match central finite differences") {
  // fp64 on the library itself: L = sum(dO o O(q, k, v, sinks)), perturbed
  // one entry at a time by +-h; central differences err by ~h^2 f''' and
  // ~eps / h in rounding: 1e-5 gives ~1e-10 of a unit gradient; 1e-6 relative
  // to the largest entry leaves a wide margin and fails on any wrong term.
  const Shape4 s{1, 13, 13, 2, 1, 8};
  const auto mask = with_score(causal_window(9), SoftCap{1.0});
  const Alibi alibi = Alibi::geometric(2);
  for (int which = 0; which < 2; ++which) {
    const Sinks sinks({0.75f, -0.5f});
    ForwardOptions opts;
    opts.sinks = sinks.logits;
    opts.sink_grad = sinks.grad;
    std::mt19937_64 rng(4242 + which);
    HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng, 2.0),
               k = random_tensor(s.b, s.nk, s.hkv, s.d, rng, 2.0),
               v = random_tensor(s.b, s.nk, s.hkv, s.d, rng),
               dout = random_tensor(s.b, s.nq, s.h, s.d, rng);
    V4<double> qd("q", s.b, s.nq, s.h, s.d), kd("k", s.b, s.nk, s.hkv, s.d),
        vd("v", s.b, s.nk, s.hkv, s.d), od("o", s.b, s.nq, s.h, s.d),
        dod("do", s.b, s.nq, s.h, s.d), dqd("dq", s.b, s.nq, s.h, s.d),
        dkd("dk", s.b, s.nk, s.hkv, s.d), dvd("dv", s.b, s.nk, s.hkv, s.d);
    V3<double> ld("lse", s.b, s.h, s.nq);
    upload(dout, dod);
    auto loss = [&](HostTensor& qq, HostTensor& kk, HostTensor& vv) {
      upload(qq, qd);
      upload(kk, kd);
      upload(vv, vd);
      if (which == 0)
        attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask, opts);
      else
        attention_forward(ExecSpace{}, qd, kd, vd, od, ld, with_score(CausalMask{}, alibi), opts);
      Kokkos::fence();
      const HostTensor o = download(od);
      double l = 0.0;
      for (std::size_t i = 0; i < o.data.size(); ++i) l += o.data[i] * dout.data[i];
      return l;
    };
    loss(q, k, v);
    if (which == 0)
      attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dqd, dkd, dvd, mask, opts);
    else
      attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dqd, dkd, dvd,
                         with_score(CausalMask{}, alibi), opts);
    Kokkos::fence();
    const HostTensor dq = download(dqd), dk = download(dkd), dv = download(dvd);
    const std::vector<double> dsink = sinks.gradient();
    const double h = 1e-5;
    double worst = 0.0, largest = 1e-300;
    auto probe = [&](HostTensor& t, const HostTensor& grad, std::size_t i) {
      const double x = t.data[i];
      t.data[i] = x + h;
      const double up = loss(q, k, v);
      t.data[i] = x - h;
      const double down = loss(q, k, v);
      t.data[i] = x;
      const double fd = (up - down) / (2 * h);
      worst = std::max(worst, std::abs(fd - grad.data[i]));
      largest = std::max(largest, std::abs(fd));
    };
    for (std::size_t i = 0; i < q.data.size(); i += 7) probe(q, dq, i);
    for (std::size_t i = 0; i < k.data.size(); i += 5) probe(k, dk, i);
    for (std::size_t i = 0; i < v.data.size(); i += 11) probe(v, dv, i);
    // The sinks: perturb the fp32 logit itself (h = 2^-10 is exact in fp32).
    const double hs = 1.0 / 1024;
    for (int head = 0; head < s.h; ++head) {
      auto hv = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), sinks.logits);
      const float x = hv(head);
      hv(head) = float(x + hs);
      Kokkos::deep_copy(sinks.logits, hv);
      const double up = loss(q, k, v);
      hv(head) = float(x - hs);
      Kokkos::deep_copy(sinks.logits, hv);
      const double down = loss(q, k, v);
      hv(head) = x;
      Kokkos::deep_copy(sinks.logits, hv);
      const double fd = (up - down) / (2 * hs);
      // O is smooth in the sink: the h^2 term is ~1e-7 of the gradient here.
      INFO("sink ", head, " fd ", fd, " backward ", dsink[std::size_t(head)]);
      CHECK(std::abs(fd - dsink[std::size_t(head)]) <= 1e-5 * (1.0 + std::abs(fd)));
    }
    INFO("policy ", which, " max |fd - grad| ", worst, " max |fd| ", largest);
    CHECK(worst <= 1e-6 * largest);
  }
}

TEST_CASE(
    "softcap keeps huge logits finite; a fully masked row with a sink gives O = 0, LSE = sink") {
  // Logits up to ~1e36: softcap maps them into (-cap, cap) and its
  // derivative to 0; the result is that of the capped logits.
  const Shape4 s{1, 40, 40, 2, 2, 16};
  check_case<double>(s, with_score(CausalMask{}, SoftCap{30.0}), 31, nullptr, 1e15);
  check_case<float>(s, with_score(CausalMask{}, SoftCap{30.0}), 32, nullptr, 1e10);
  check_case<float>(s, with_score(CausalMask{}, SoftCap{30.0}), 33, nullptr, 1e18);

  // Queries at positions -10 .. 29 under a causal mask: rows -10 .. -1 see no
  // key. With a sink they get O = 0 and LSE = the sink, exactly.
  const Sinks sinks({1.25f, -3.0f});
  ForwardOptions opts;
  opts.q_offset = -10;
  check_case<float>(s, with_score(CausalMask{}, SoftCap{5.0}), 34, &sinks, 1.0, opts);
  const Run r = forward_backward<float>(s, CausalMask{}, 35, opts, &sinks, 1.0);
  for (int h = 0; h < s.h; ++h)
    for (int i = 0; i < 10; ++i) {
      CHECK(r.lse[std::size_t(h) * s.nq + std::size_t(i)] == double(sinks.values[std::size_t(h)]));
      for (int d = 0; d < s.d; ++d) CHECK(r.o(0, i, h, d) == 0.0);
      for (int d = 0; d < s.d; ++d) CHECK(r.dq(0, i, h, d) == 0.0);
    }
}

TEST_CASE("a NaN sink makes its head NaN and leaves the other heads alone") {
  const Shape4 s{1, 20, 20, 2, 1, 16};
  const Sinks sinks({std::numeric_limits<float>::quiet_NaN(), 0.5f});
  const Run r = forward_backward<float>(s, CausalMask{}, 36, {}, &sinks, 1.0);
  for (int i = 0; i < s.nq; ++i) {
    CHECK(std::isnan(r.lse[std::size_t(i)]));
    CHECK(std::isfinite(r.lse[std::size_t(s.nq + i)]));
    CHECK(std::isnan(r.o(0, i, 0, 3)));
    CHECK(std::isfinite(r.o(0, i, 1, 3)));
  }
}

TEST_CASE("decode with a score policy and sinks matches the fp64 reference") {
  // One new token per sequence at position len - 1 against its cache.
  const int B = 2, H = 4, HKV = 2, D = 32, cap = 300;
  std::mt19937_64 rng(77);
  HostTensor q = random_tensor(B, 1, H, D, rng, 2.0), k = random_tensor(B, cap, HKV, D, rng, 2.0),
             v = random_tensor(B, cap, HKV, D, rng);
  V4<float> qd("q", B, 1, H, D), kd("k", B, cap, HKV, D), vd("v", B, cap, HKV, D),
      od("o", B, 1, H, D);
  V3<float> ld("lse", B, H, 1);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  Kokkos::View<int*, MemSpace> len("len", B);
  Kokkos::View<index_type*, MemSpace> qpos("qpos", B);
  auto lh = Kokkos::create_mirror_view(len);
  auto ph = Kokkos::create_mirror_view(qpos);
  const int lengths[B] = {300, 171};
  for (int b = 0; b < B; ++b) {
    lh(b) = lengths[b];
    ph(b) = lengths[b] - 1;
  }
  Kokkos::deep_copy(len, lh);
  Kokkos::deep_copy(qpos, ph);
  const auto mask = with_score(causal_window(100), Alibi::geometric(H));
  const auto capped = with_score(CausalMask{}, SoftCap{1.0});
  const Sinks sinks({0.5f, -1.0f, 2.0f, 1.0f});
  for (int which = 0; which < 2; ++which) {
    DecodeOptions dopts;
    if (which == 1) dopts.sinks = sinks.logits;  // gpt-oss style, with softcap here
    if (which == 0)
      attention_decode(ExecSpace{}, qd, kd, vd, len, qpos, od, ld, mask, OffsetPositions{}, dopts);
    else
      attention_decode(ExecSpace{}, qd, kd, vd, len, qpos, od, ld, capped, OffsetPositions{},
                       dopts);
    Kokkos::fence();
    const HostTensor o = download(od);
    auto lse = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ld);
    for (int b = 0; b < B; ++b) {
      HostTensor qb(1, 1, H, D), kb(1, lengths[b], HKV, D), vb(1, lengths[b], HKV, D);
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) qb(0, 0, h, d) = q(b, 0, h, d);
      for (int j = 0; j < lengths[b]; ++j)
        for (int h = 0; h < HKV; ++h)
          for (int d = 0; d < D; ++d) {
            kb(0, j, h, d) = k(b, j, h, d);
            vb(0, j, h, d) = v(b, j, h, d);
          }
      const double scale = 1.0 / std::sqrt(double(D));
      const ReferenceResult ref =
          which == 0
              ? reference_attention(qb, kb, vb, mask, scale, lengths[b] - 1, 0)
              : reference_attention(qb, kb, vb, capped, scale, lengths[b] - 1, 0, &sinks.values);
      double err = 0.0;
      for (int h = 0; h < H; ++h) {
        err = std::max(err, std::abs(double(lse(b, h, 0)) - ref.lse[std::size_t(h)]));
        for (int d = 0; d < D; ++d)
          err = std::max(err, std::abs(o(b, 0, h, d) - ref.o(0, 0, h, d)));
      }
      INFO("policy ", which, " sequence ", b, " err ", err);
      CHECK(err <= 1e-5);
    }
  }
}

TEST_CASE("score policies and sinks: bad arguments name what was expected") {
  V4<float> q("q", 1, 8, 4, 16), k("k", 1, 8, 2, 16), v("v", 1, 8, 2, 16), o("o", 1, 8, 4, 16);
  V3<float> lse("lse", 1, 4, 8);
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string few = message([&] {
    attention_forward(ExecSpace{}, q, k, v, o, lse, with_score(CausalMask{}, Alibi::geometric(2)));
  });
  CHECK(few.find("argument 'mask'") != std::string::npos);
  CHECK(few.find("Alibi::heads = 2") != std::string::npos);
  const std::string cap = message([&] {
    attention_forward(ExecSpace{}, q, k, v, o, lse, with_score(FullMask{}, SoftCap{0.0}));
  });
  CHECK(cap.find("SoftCap::cap") != std::string::npos);
  const Sinks three({1.0f, 2.0f, 3.0f});
  ForwardOptions opts;
  opts.sinks = three.logits;
  const std::string sinks =
      message([&] { attention_forward(ExecSpace{}, q, k, v, o, lse, CausalMask{}, opts); });
  CHECK(sinks.find("'options.sinks' has extent(0) = 3") != std::string::npos);
  ForwardOptions grad_only;
  grad_only.sink_grad = three.grad;
  const std::string orphan = message([&] {
    attention_backward(ExecSpace{}, q, k, v, o, lse, o, q, k, v, CausalMask{}, grad_only);
  });
  CHECK(orphan.find("'options.sink_grad' is set but 'options.sinks' is empty") !=
        std::string::npos);
}

TEST_CASE("the planner plans a scored mask as its mask") {
  // A policy changes logits, not which pairs exist: every partition x schedule
  // gets the same prediction (makespan, validity) as under the plain mask.
  plan::Problem p;
  p.N = 65536;
  p.P = 8;
  p.heads = p.kv_heads = 8;
  p.dim = 128;
  for (const auto& hw : {plan::a100_nvlink(), plan::h100_cluster()}) {
    const auto plain = plan::compare(p, causal_window(4096), hw);
    const auto scored = plan::compare(p, with_score(causal_window(4096), SoftCap{30.0}), hw);
    REQUIRE(plain.size() == scored.size());
    for (std::size_t i = 0; i < plain.size(); ++i) {
      INFO(plain[i].partition, " ", plain[i].schedule);
      CHECK(plain[i].partition == scored[i].partition);
      CHECK(plain[i].schedule == scored[i].schedule);
      CHECK(plain[i].valid == scored[i].valid);
      CHECK(plain[i].makespan_s == scored[i].makespan_s);
    }
  }
}
