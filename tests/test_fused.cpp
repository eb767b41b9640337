// SPDX-License-Identifier: Apache-2.0
// Which calls the fused path takes (kernel/cudnn/fused_path.hpp), on the host
// emulation of the fused provider (-DBLOCKATTN_EMULATE_FUSED): band masks on
// any offsets go fused, everything else and portable_only to BlockAttn's
// kernels, a call whose rows see no key is filled without a vendor call, and
// the fused results (bf16, fp16; forward and backward; GQA) are within one
// 16-bit rounding of fp32 results of the fp64 reference and agree with the
// portable path. (On a GPU, test_half_attention.cpp checks cuDNN's results
// against the fused bound.)
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "forward_check.hpp"
#include "reference.hpp"
#include "user_masks.hpp"

#if !defined(BLOCKATTN_EMULATE_FUSED)
#error "test_fused.cpp tests the emulated fused provider: compile with -DBLOCKATTN_EMULATE_FUSED"
#endif

using namespace blockattn;
using namespace blockattn::test;

namespace {

using V4 = Kokkos::View<bf16****, MemSpace>;
using L3 = Kokkos::View<float***, MemSpace>;

struct Call {
  V4 q, k, v, o, dout, dq, dk, dv;
  L3 lse;
  Call(int nq, int nk, int heads, int kv_heads, int dim, std::uint64_t seed)
      : q("q", 1, nq, heads, dim),
        k("k", 1, nk, kv_heads, dim),
        v("v", 1, nk, kv_heads, dim),
        o("o", 1, nq, heads, dim),
        dout("do", 1, nq, heads, dim),
        dq("dq", 1, nq, heads, dim),
        dk("dk", 1, nk, kv_heads, dim),
        dv("dv", 1, nk, kv_heads, dim),
        lse("lse", 1, heads, nq) {
    std::mt19937_64 rng(seed);
    HostTensor a = random_tensor(1, nq, heads, dim, rng),
               b = random_tensor(1, nk, kv_heads, dim, rng),
               c = random_tensor(1, nk, kv_heads, dim, rng),
               d = random_tensor(1, nq, heads, dim, rng);
    upload(a, q);
    upload(b, k);
    upload(c, v);
    upload(d, dout);
  }
  /// Forward and backward; the paths each took.
  template <class Mask>
  std::pair<BlockPathCounts, BlockPathCounts> run(const Mask& mask, ForwardOptions opts) {
    BlockPathCounts fwd, bwd;
    opts.paths = &fwd;
    attention_forward(ExecSpace{}, q, k, v, o, lse, mask, opts);
    opts.paths = &bwd;
    attention_backward(ExecSpace{}, q, k, v, o, lse, dout, dq, dk, dv, mask, opts);
    Kokkos::fence();
    return {fwd, bwd};
  }
};

template <class Mask>
void expect_path_at(int line, const Mask& mask, ForwardOptions opts, bool fused, int pieces,
                    int nq = 48, int nk = 40) {
  INFO("expect_path at line " << line);
  Call c(nq, nk, 4, 2, 64, 11);
  const auto [fwd, bwd] = c.run(mask, opts);
  for (const BlockPathCounts& p : {fwd, bwd}) {
    CHECK(p.fused == (fused ? 1 : 0));
    CHECK(p.portable == (fused ? 0 : 1));
    CHECK(p.fused_pieces == (fused ? pieces : 0));
  }
}
#define expect_path(...) expect_path_at(__LINE__, __VA_ARGS__)

/// max |a - b| / max(1, max |b|) over two bf16 Views of one shape.
double max_diff(const V4& a, const V4& b) {
  auto ha = to_host(a);
  auto hb = to_host(b);
  double m = 0.0, largest = 1.0;
  for (std::size_t i = 0; i < ha.span(); ++i) {
    const double y = double(float(hb.data()[i]));
    m = std::fmax(m, std::abs(double(float(ha.data()[i])) - y));
    largest = std::fmax(largest, std::abs(y));
  }
  return m / largest;
}

}  // namespace

/// The fused forward and backward of S against the fp64 reference: every
/// element within u16 (|x| + largest) + the fp32 bound, where largest is
/// the largest entry of the reference (the emulation computes in fp32 and
/// rounds once; cuDNN's bound is test_half_attention.cpp's fused_bound).
template <class S, class Mask>
void check_numbers(const Mask& mask, ForwardOptions opts, int nq, int nk, int heads, int kv_heads,
                   int dim, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(1, nq, heads, dim, rng),
             k = random_tensor(1, nk, kv_heads, dim, rng),
             v = random_tensor(1, nk, kv_heads, dim, rng),
             dout = random_tensor(1, nq, heads, dim, rng);
  using W = Kokkos::View<S****, MemSpace>;
  W qd("q", 1, nq, heads, dim), kd("k", 1, nk, kv_heads, dim), vd("v", 1, nk, kv_heads, dim),
      od("o", 1, nq, heads, dim), dod("do", 1, nq, heads, dim), dqd("dq", 1, nq, heads, dim),
      dkd("dk", 1, nk, kv_heads, dim), dvd("dv", 1, nk, kv_heads, dim);
  L3 ld("lse", 1, heads, nq);
  upload(q, qd);  // now the rounded values
  upload(k, kd);
  upload(v, vd);
  upload(dout, dod);
  BlockPathCounts paths;
  opts.paths = &paths;
  attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask, opts);
  attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dqd, dkd, dvd, mask, opts);
  Kokkos::fence();
  CHECK(paths.fused == 2);
  const double scale = 1.0 / std::sqrt(double(dim));
  const ReferenceResult ref =
      reference_attention(q, k, v, mask, scale, opts.q_offset, opts.k_offset);
  const auto get = [](const W& w) {
    auto h = to_host(w);
    HostTensor t(int(w.extent(0)), int(w.extent(1)), int(w.extent(2)), int(w.extent(3)));
    for (std::size_t i = 0; i < t.data.size(); ++i) t.data[i] = double(float(h.data()[i]));
    return t;
  };
  const HostTensor o = get(od);
  const ReferenceGrads g =
      reference_backward(q, k, v, dout, mask, scale, opts.q_offset, opts.k_offset, &o);
  const auto worst = [](const HostTensor& got, const HostTensor& want, double e32) {
    double largest = 0.0, w = 0.0;
    for (double x : want.data) largest = std::fmax(largest, std::abs(x));
    for (std::size_t i = 0; i < got.data.size(); ++i)
      w = std::fmax(w, std::abs(got.data[i] - want.data[i]) /
                           (e32 * largest + S::unit_roundoff * (std::abs(want.data[i]) + largest)));
    return w;
  };
  auto lh = to_host(ld);
  double lse_err = 0.0;
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < nq; ++i) {
      const double want = ref.lse[std::size_t(h) * nq + i], got = lh(0, h, i);
      lse_err = std::isinf(want) ? (got == want ? lse_err : 1e300)
                                 : std::fmax(lse_err, std::abs(got - want));
    }
  INFO(value_type_name<S>() << " " << nq << "x" << nk << " heads " << heads << "/" << kv_heads
                            << " dim " << dim);
  CHECK(worst(o, ref.o, 1e-5) <= 1.0);
  CHECK(lse_err <= 1e-4);
  CHECK(worst(get(dqd), g.dq, 1e-4) <= 1.0);
  CHECK(worst(get(dkd), g.dk, 1e-4) <= 1.0);
  CHECK(worst(get(dvd), g.dv, 1e-4) <= 1.0);
}

TEST_CASE_TEMPLATE("fused path: within one 16-bit rounding of the fp64 reference", S, bf16, fp16) {
  ForwardOptions opts;
  check_numbers<S>(FullMask{}, opts, 33, 50, 4, 2, 64, 1);
  check_numbers<S>(CausalMask{}, opts, 64, 64, 2, 1, 128, 2);
  check_numbers<S>(SlidingWindowMask{9, 4}, opts, 40, 56, 2, 2, 40, 3);
  opts.k_offset = 7;  // rows 0..6 see nothing
  check_numbers<S>(CausalMask{}, opts, 30, 45, 3, 1, 64, 4);
}

TEST_CASE("fused path: which calls it takes") {
  ForwardOptions opts;
  expect_path(FullMask{}, opts, true, 1);
  expect_path(CausalMask{}, opts, true, 1);
  expect_path(causal_window(8), opts, true, 1, 40, 48);  // rows <= keys: a left bound
  expect_path(SlidingWindowMask{6, 3}, opts, true, 1, 40, 48);
  expect_path(PrefixLMMask{0}, opts, true, 1);                // causal everywhere: a band
  expect_path(PrefixLMMask{100}, opts, true, 1);              // every key in the prefix: full
  expect_path(PrefixLMMask{20}, opts, false, 0);              // straddles the prefix: not a band
  expect_path(test::DocumentCausalMask{16}, opts, false, 0);  // no band()
  const Documents<MemSpace> docs(std::vector<index_type>{0, 10, 48});
  expect_path(docs.mask(), opts, false, 0);  // two documents
  const Documents<MemSpace> one(std::vector<index_type>{0, 48});
  expect_path(one.mask(), opts, true, 1);  // inside one document: causal
  // A window taller than its keys: cuDNN's left bound needs no more rows than keys.
  expect_path(causal_window(4), opts, false, 0, 40, 13);
  // Offsets: keys after the queries' start cut rows off (one piece); keys all
  // after every query: nothing to compute, rows filled without a vendor call.
  opts.k_offset = 5;
  expect_path(CausalMask{}, opts, true, 1);
  opts.k_offset = 1000;
  expect_path(CausalMask{}, opts, true, 0);
  // portable_only takes our kernels.
  ForwardOptions portable;
  portable.portable_only = true;
  expect_path(FullMask{}, portable, false, 0);
}

TEST_CASE("fused path: rows that see no key, and agreement with the portable path") {
  // Queries at 0..47, keys at 5..44, causal: rows 0..4 see nothing.
  ForwardOptions opts;
  opts.k_offset = 5;
  Call fused(48, 40, 4, 2, 64, 21), portable(48, 40, 4, 2, 64, 21);
  fused.run(CausalMask{}, opts);
  ForwardOptions p = opts;
  p.portable_only = true;
  portable.run(CausalMask{}, p);
  auto lse = to_host(fused.lse);
  auto o = to_host(fused.o);
  auto dq = to_host(fused.dq);
  int wrong = 0;
  for (int h = 0; h < 4; ++h)
    for (int i = 0; i < 5; ++i) {
      wrong += !(std::isinf(lse(0, h, i)) && lse(0, h, i) < 0);
      for (int d = 0; d < 64; ++d) wrong += float(o(0, i, h, d)) != 0.0f;
      for (int d = 0; d < 64; ++d) wrong += float(dq(0, i, h, d)) != 0.0f;
    }
  CHECK(wrong == 0);
  // Both within one bf16 rounding of fp32 results (test_half_attention.cpp
  // bounds each against fp64): a few units of 2^-8 apart at most, relative
  // to the largest entry.
  CHECK(max_diff(fused.o, portable.o) <= 4.0 / 256);
  CHECK(max_diff(fused.dq, portable.dq) <= 4.0 / 256);
  CHECK(max_diff(fused.dk, portable.dk) <= 4.0 / 256);
  CHECK(max_diff(fused.dv, portable.dv) <= 4.0 / 256);
  // A call with no allowed pair: O = 0, LSE = -inf, zero gradients everywhere.
  opts.k_offset = 1000;
  Call empty(16, 16, 2, 2, 64, 3);
  empty.run(CausalMask{}, opts);
  auto el = to_host(empty.lse);
  auto edk = to_host(empty.dk);
  int bad = 0;
  for (std::size_t i = 0; i < el.span(); ++i)
    bad += !(std::isinf(el.data()[i]) && el.data()[i] < 0);
  for (std::size_t i = 0; i < edk.span(); ++i) bad += float(edk.data()[i]) != 0.0f;
  CHECK(bad == 0);
}

// A travelled query slot carries D = rowsum(dO o O), not O; the fused
// backward takes O only to form D, so it gets a proxy O
// (impl::travelled_operands, used by fused_travelled_rows): every row's
// sum over dO o proxy must give D back up to one rounding of the proxy to
// the storage type (relative u16, plus the fp32 arithmetic: (dim + 4) 2^-24),
// without overflow (|proxy| <= max|O|); a tiny D (below the type's normal
// range) within half a subnormal spacing times max|dO| more; zero rows zero,
// non-finite D or dO a NaN row; LSE back in the natural log.
TEST_CASE_TEMPLATE("fused path: a travelled slot's proxy O gives its D back", S, bf16, fp16) {
  const int rows = 40, dim = 12, padded = 16;
  Kokkos::View<S****, Kokkos::LayoutRight, MemSpace> dout("dout", 1, 2, rows, padded),
      proxy("proxy", 1, 2, rows, padded);
  Kokkos::View<float***, Kokkos::LayoutRight, MemSpace> lse2("lse2", 1, 2, rows),
      drow("drow", 1, 2, rows), lse("lse", 1, 2, rows);
  auto hd = Kokkos::create_mirror_view(dout);
  auto hl = Kokkos::create_mirror_view(lse2);
  auto hr = Kokkos::create_mirror_view(drow);
  std::mt19937_64 rng(77);
  std::normal_distribution<double> g(0.0, 1.0);
  const bool is_fp16 = std::is_same<S, fp16>::value;
  std::vector<double> omax(std::size_t(2 * rows), 0.0);
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < rows; ++i) {
      // Row kinds: 0 random; 1 some dO zero; 2 all dO zero; 3 a tiny D; 4 a
      // large O (fp16: near its largest value); 5 NaN D; 6 inf in dO.
      const int kind = i % 7;
      const double big = is_fp16 ? 6.0e4 : 1.0e30;
      float D = 0.0f;
      double om = 0.0;
      for (int d = 0; d < padded; ++d) {
        float x = d < dim ? float(S(float(g(rng)))) : 0.0f;
        if (kind == 1 && d % 3 == 0) x = 0.0f;
        if (kind == 2) x = 0.0f;
        const double o = kind == 4 ? big * (d % 2 ? 1.0 : -0.5) : g(rng);
        const float os = float(S(float(o)));
        if (d < dim) {
          D += x * os;
          om = std::max(om, std::abs(double(os)));
        }
        hd(0, h, i, d) = S(x);
      }
      if (kind == 3) D = is_fp16 ? 3.0e-6f : 1.0e-39f;
      if (kind == 5) D = std::numeric_limits<float>::quiet_NaN();
      if (kind == 6) hd(0, h, i, 5) = S(std::numeric_limits<float>::infinity());
      omax[std::size_t(h * rows + i)] = kind == 3 ? 1.0 : om;
      hr(0, h, i) = D;
      hl(0, h, i) = i == rows - 1 ? -std::numeric_limits<float>::infinity()
                                  : float(0.5 * i - 3.0) * 1.44269504f;
    }
  Kokkos::deep_copy(dout, hd);
  Kokkos::deep_copy(lse2, hl);
  Kokkos::deep_copy(drow, hr);
  impl::travelled_operands(ExecSpace(), dout, lse2, drow, dim, proxy, lse);
  auto hp = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), proxy);
  auto hn = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  const double u = S::unit_roundoff, rel = u + (dim + 4) * std::ldexp(1.0, -24);
  const double sub = is_fp16 ? std::ldexp(1.0, -25) : std::ldexp(1.0, -134);
  int wrong = 0;
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < rows; ++i) {
      const int kind = i % 7;
      const double D = hr(0, h, i);
      double sum = 0.0, m = 0.0, pmax = 0.0;
      bool nan_row = true, padding_zero = true;
      for (int d = 0; d < padded; ++d) {
        const double p = float(hp(0, h, i, d)), x = float(hd(0, h, i, d));
        nan_row = nan_row && std::isnan(p);
        if (d >= dim) {
          padding_zero = padding_zero && (p == 0.0 || kind >= 5);
          continue;
        }
        sum += x * p;
        m = std::max(m, std::abs(x));
        pmax = std::max(pmax, std::abs(p));
      }
      if (kind >= 5) {
        wrong += !nan_row;
      } else {
        const double err = std::abs(sum - D), bd = rel * std::abs(D) + (kind == 3 ? sub * m : 0.0);
        wrong += !(err <= bd);
        wrong += !(pmax <= omax[std::size_t(h * rows + i)] * (1.0 + std::ldexp(1.0, -20)));
        wrong += !padding_zero;
        if (kind == 2) wrong += pmax != 0.0;
      }
      const double l = hn(0, h, i);
      if (i == rows - 1)
        wrong += !(std::isinf(l) && l < 0);
      else
        wrong += !(std::abs(l - (0.5 * i - 3.0)) <= 1e-6);
      if (wrong) {
        INFO("head " << h << " row " << i << " kind " << kind << " D " << D << " sum " << sum
                     << " |proxy| " << pmax << " lse " << l);
        CHECK(wrong == 0);
        return;
      }
    }
  CHECK(wrong == 0);
}
