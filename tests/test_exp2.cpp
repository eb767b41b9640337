// SPDX-License-Identifier: Apache-2.0
// Host-only: accuracy of the fp32 exp2 used for softmax numerators.
#include <doctest/doctest.h>

#include <blockattn/kernel/host/micro_gemm_simd.hpp>
#include <blockattn/kernel/impl/exp2.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

using blockattn::impl::exp2_nonpositive;

TEST_CASE("fp32 exp2 on [-126, 0] is within 2.5e-7 relative of the fp64 value") {
  // Tolerance: the polynomial's 1.2e-7 plus rounding of the reduced argument
  // and of the final product, about 2 ulp of fp32 (ulp/2 = 6e-8).
  double worst = 0.0;
  for (int i = 0; i <= 2000000; ++i) {
    const float x = -126.0f * static_cast<float>(i) / 2000000.0f;
    const double want = std::exp2(static_cast<double>(x));
    const double got = exp2_nonpositive(x);
    worst = std::max(worst, std::abs(got - want) / want);
  }
  CHECK(worst < 2.5e-7);
  CHECK(exp2_nonpositive(0.0f) == 1.0f);
  CHECK(exp2_nonpositive(-0.0f) == 1.0f);
  CHECK(exp2_nonpositive(-1.0f) == 0.5f);
}

TEST_CASE("fp32 exp2 gives exactly 0 below the normal range and for -inf") {
  CHECK(exp2_nonpositive(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(exp2_nonpositive(-126.5f) == 0.0f);
  CHECK(exp2_nonpositive(-1.0e30f) == 0.0f);
  CHECK(exp2_nonpositive(-std::numeric_limits<double>::infinity()) == 0.0);
}

TEST_CASE("fp32 exp2 keeps NaN of either sign, scalar and in a vectorised loop") {
  // x86's default NaN (e.g. from inf - inf) has the sign bit set. The mask
  // that clears arguments below -126 must keep NaN: compare a loop the
  // compiler vectorises (as the softmax row) with scalar calls.
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(exp2_nonpositive(qnan)));
  CHECK(std::isnan(exp2_nonpositive(-qnan)));
  constexpr int n = 64;
  float in[n], out[n];
  for (int i = 0; i < n; ++i) in[i] = -0.37f * float(i * i % 97) - (i % 7 == 0 ? 200.0f : 0.0f);
  in[3] = qnan;
  in[17] = -qnan;
  in[40] = -std::numeric_limits<float>::infinity();
  in[41] = -126.0f;
  in[42] = -126.0001f;
  for (int i = 0; i < n; ++i) out[i] = exp2_nonpositive(in[i]);
  for (int i = 0; i < n; ++i) {
    INFO("x = ", in[i]);
    if (std::isnan(in[i])) {
      CHECK(std::isnan(out[i]));
    } else if (in[i] < -126.0f) {
      CHECK(out[i] == 0.0f);
    } else {
      const double want = std::exp2(double(in[i]));
      CHECK(std::abs(double(out[i]) - want) <= 2.5e-7 * want);
    }
  }
}

#if BLOCKATTN_SIMD_KERNELS
/// check(V*) for the vector class of Isa (AVX2 or AVX-512: the build's, or one
/// it dispatches to at run time) where this CPU runs it, inside a function of
/// that ISA's target; nothing where the build or the CPU lacks it.
template <blockattn::HostIsa Isa, class Check>
void on_vector_isa(const Check& check) {
  using namespace blockattn;
  if constexpr (impl::simd_exp2_rows<Isa, float, 16>()) {
    if (impl::detect_host_isa() < Isa) return;  // not on this CPU
    MESSAGE(std::string(host_isa_name(Isa)));
    impl::HostIsaEntry<Isa>::run([&] { check(static_cast<impl::simd_for_t<Isa>*>(nullptr)); });
  }
}

/// on_vector_isa for AVX2 and AVX-512.
template <class Check>
void on_vector_isas(const Check& check) {
  on_vector_isa<blockattn::HostIsa::avx2>(check);
  on_vector_isa<blockattn::HostIsa::avx512>(check);
}

template <class V>
void check_simd_exp2_row_of() {
  using blockattn::impl::simd_exp2_row;
  using blockattn::impl::simd_row_max;
  constexpr int lanes = 16, n = 4096;
  const float inf = std::numeric_limits<float>::infinity();
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  for (const bool with_nan : {true, false})
    for (const float m : {0.0f, 3.25f, -17.5f}) {
      std::vector<float> s(n), want(n);
      for (int c = 0; c < n; ++c)
        s[c] = m - 130.0f * static_cast<float>(c) / static_cast<float>(n);  // s - m in (-130, 0]
      s[5] = -inf;
      s[6] = with_nan ? qnan : m - 1.0f;
      s[7] = with_nan ? -qnan : m - 2.0f;
      s[8] = m - 126.0f;
      s[9] = m - 126.0001f;
      s[10] = m;
      // The row max skips NaN and starts from its m argument.
      CHECK(simd_row_max<V, lanes>(s.data(), n, -inf) == m);
      CHECK(simd_row_max<V, lanes>(s.data(), n, m + 0.5f) == m + 0.5f);
      s[n - 1] = m + 7.0f;  // the largest in the last vector
      CHECK(simd_row_max<V, lanes>(s.data(), n, -inf) == m + 7.0f);
      s[n - 1] = m - 1.0f;
      std::vector<float> masked(n, -inf);
      masked[3] = with_nan ? qnan : -inf;
      CHECK(simd_row_max<V, lanes>(masked.data(), n, -inf) == -inf);

      double want_sum = 0.0;
      for (int c = 0; c < n; ++c) {
        want[c] = exp2_nonpositive(s[c] - m);
        want_sum += std::isnan(want[c]) ? 0.0 : double(want[c]);
      }
      const float sum = simd_exp2_row<V, lanes>(s.data(), n, m);
      // The polynomial runs in FMA steps here; the scalar function may or may
      // not be contracted (-ffp-contract): within 2 ulp of each other.
      int bad = 0;
      for (int c = 0; c < n; ++c) {
        if (std::isnan(want[c])) {
          bad += std::isnan(s[c]) ? 0 : 1;
          continue;
        }
        if (want[c] == 0.0f || c == 10) {
          bad += s[c] == want[c] ? 0 : 1;  // exact zeros below -126, and 2^0 = 1
          continue;
        }
        bad += std::abs(s[c] - want[c]) <= 2.5e-7f * want[c] ? 0 : 1;
      }
      CHECK(bad == 0);
      CHECK(s[5] == 0.0f);
      CHECK(s[9] == 0.0f);
      CHECK(s[10] == 1.0f);
      if (with_nan) {
        CHECK(std::isnan(s[6]));
        CHECK(std::isnan(s[7]));
        CHECK(std::isnan(sum));  // a NaN logit makes the row sum NaN
      } else {
        // n / lanes additions per lane, then log2(lanes) pairwise ones, each
        // within half an ulp of its partial sum (all terms positive), and the
        // terms themselves within 2.5e-7 of the fp64 sum's.
        CHECK(std::abs(double(sum) - want_sum) <= (n / lanes + 4 + 4) * 6e-8 * want_sum);
      }
    }
}
#endif

#if BLOCKATTN_SIMD_KERNELS
/// exp2_nonpositive's arithmetic with every polynomial step one fused
/// multiply-add (std::fma: one rounding, as vfmadd) and 2^n applied by one
/// rounded multiply: what every vector exp2 must return, bit for bit (the
/// AVX2 one builds 2^n in the exponent field, the AVX-512 one scales by
/// vscalefps).
float exp2_fma_form(float x) {
  using C = blockattn::impl::Exp2fConstants;
  if (x < C::min_arg) return 0.0f;
  const float magic = C::round_magic;
  const float n = (x + magic) - magic;
  const float f = x - n;
  float poly = std::fma(f, C::c6, C::c5);
  poly = std::fma(f, poly, C::c4);
  poly = std::fma(f, poly, C::c3);
  poly = std::fma(f, poly, C::c2);
  poly = std::fma(f, poly, C::c1);
  poly = std::fma(f, poly, 1.0f);
  return poly * std::ldexp(1.0f, static_cast<int>(n));
}

template <class V>
void check_simd_exp2_bitwise_of() {
  // Every 997th float in [-127, -0] and [+0, 127), and the edges.
  std::vector<float> x;
  auto from_bits = [](std::uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  };
  for (std::uint32_t u = 0x80000000u; u <= 0xC2FE0000u; u += 997) x.push_back(from_bits(u));
  for (std::uint32_t u = 0x00000000u; u < 0x42FE0000u; u += 997) x.push_back(from_bits(u));
  for (const float e :
       {-126.0f, -126.00001f, -125.99999f, -125.5f, -126.5f, -149.5f, -0.5f, 0.5f, -1.0e30f,
        -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()})
    x.push_back(e);
  while (x.size() % 16 != 0) x.push_back(0.0f);
  // The softmax's exponent pass with row max 0: exp2 of s - 0 = s.
  std::vector<float> got = x;
  blockattn::impl::simd_exp2_row<V, 16>(got.data(), static_cast<int>(got.size()), 0.0f);
  int differ = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float want = exp2_fma_form(x[i]);
    if (std::isnan(want)) {
      differ += std::isnan(got[i]) ? 0 : 1;
    } else if (std::memcmp(&want, &got[i], sizeof want) != 0) {
      if (differ < 5) MESSAGE("x = ", x[i], ": got ", got[i], ", want ", want);
      ++differ;
    }
  }
  CHECK(x.size() > 2000000);
  CHECK(differ == 0);
}

#endif

#if BLOCKATTN_SIMD_KERNELS
/// V::load_codes_to at every start in a run of all 256 codes (twice, so
/// that every start has a whole vector): each lane the scalar conversion's
/// value (core/quant.hpp), bitwise, NaN where it is NaN.
template <class V, class C>
int widen_mismatches() {
  constexpr int W = V::width;
  std::uint8_t raw[512];
  for (int i = 0; i < 512; ++i) raw[i] = std::uint8_t(i);
  int bad = 0;
  for (int c0 = 0; c0 < 256; ++c0) {
    typename V::type x;
    V::load_codes_to(x, reinterpret_cast<const C*>(raw + c0));
    float out[W];
    V::store_from(out, x);
    for (int l = 0; l < W; ++l) {
      C code;
      std::memcpy(&code, raw + c0 + l, 1);
      const float want = float(code);
      if (std::isnan(want) ? !std::isnan(out[l]) : std::memcmp(&want, &out[l], 4) != 0) ++bad;
    }
  }
  return bad;
}
#endif

TEST_CASE("8-bit codes widened in vectors (AVX2, AVX-512): every code its scalar value, exactly") {
#if BLOCKATTN_SIMD_KERNELS
  on_vector_isas([](auto* v) {
    using V = std::remove_pointer_t<decltype(v)>;
    CHECK(widen_mismatches<V, std::int8_t>() == 0);
    CHECK(widen_mismatches<V, blockattn::fp8_e4m3>() == 0);
    CHECK(widen_mismatches<V, blockattn::fp8_e5m2>() == 0);
  });
#endif
}

TEST_CASE("vector exp2 (AVX2, AVX-512): bitwise exp2_nonpositive's arithmetic in FMA steps") {
#if BLOCKATTN_SIMD_KERNELS
  on_vector_isas([](auto* v) { check_simd_exp2_bitwise_of<std::remove_pointer_t<decltype(v)>>(); });
#endif
}

TEST_CASE(
    "simd_exp2_row, simd_row_max: exp2_nonpositive of s - m per element, the row sum and the row "
    "max") {
#if BLOCKATTN_SIMD_KERNELS
  // The forward softmax's exponent pass in explicit vectors.
  on_vector_isas([](auto* v) { check_simd_exp2_row_of<std::remove_pointer_t<decltype(v)>>(); });
#endif
}

#if BLOCKATTN_SIMD_KERNELS
// The forward softmax's R-row passes (simd_row_max_group, simd_exp2_row_group)
// interleave independent rows; each row's max, P and sum must be bitwise the
// one-row passes' (simd_row_max, simd_exp2_row), whatever the other rows hold.
template <class V>
void check_simd_row_groups_of() {
  using namespace blockattn::impl;
  constexpr int lanes = 16, R = 3, n = 128, ld = 160;  // ld > n: the gap is left alone
  const float inf = std::numeric_limits<float>::infinity();
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  std::uint32_t state = 12345u;
  auto uniform = [&state] {  // [0, 1), 24 bits
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / 16777216.0f;
  };
  int cases = 0;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> s(R * ld), m(R);
    for (int r = 0; r < R; ++r) {
      const float spread = 1.0f + 200.0f * uniform();  // some rows reach below -126
      for (int c = 0; c < ld; ++c) s[r * ld + c] = (c < n) ? spread * (uniform() - 0.5f) : 777.0f;
      const int kind = (trial + 5 * r) % 7;
      if (kind == 1) s[r * ld + (trial % n)] = -inf;
      if (kind == 2) s[r * ld + (trial * 7 % n)] = qnan;
      if (kind == 3)  // a row without a finite logit: the caller's -inf row max
        for (int c = 0; c < n; ++c) s[r * ld + c] = -inf;
      if (kind == 4) s[r * ld + n - 1] = 90.0f;  // the largest in the last vector
      m[r] = kind == 5 ? 3.0f : (kind == 6 ? -inf : -100.0f * uniform());
    }
    // One row at a time.
    std::vector<float> want = s, want_max(R), want_sum(R);
    for (int r = 0; r < R; ++r) {
      want_max[r] = simd_row_max<V, lanes>(want.data() + r * ld, n, m[r]);
      if (want_max[r] != -inf)
        want_sum[r] = simd_exp2_row<V, lanes>(want.data() + r * ld, n, want_max[r]);
    }
    bool all_finite = true;
    for (int r = 0; r < R; ++r) all_finite = all_finite && want_max[r] != -inf;
    // R rows at once.
    std::vector<float> got = s, got_max(R), got_sum(R);
    simd_row_max_group<V, lanes, R>(got.data(), ld, n, m.data(), got_max.data());
    for (int r = 0; r < R; ++r) CHECK(std::memcmp(&got_max[r], &want_max[r], sizeof(float)) == 0);
    if (!all_finite) continue;  // the kernel takes such groups row by row
    simd_exp2_row_group<V, lanes, R>(got.data(), ld, n, got_max.data(), got_sum.data());
    ++cases;
    for (int r = 0; r < R; ++r) {
      const bool same_sum = std::memcmp(&got_sum[r], &want_sum[r], sizeof(float)) == 0 ||
                            (std::isnan(got_sum[r]) && std::isnan(want_sum[r]));
      CHECK(same_sum);
    }
    int differ = 0;
    for (int i = 0; i < R * ld; ++i) {
      const bool same = std::memcmp(&got[i], &want[i], sizeof(float)) == 0 ||
                        (std::isnan(got[i]) && std::isnan(want[i]));
      differ += same ? 0 : 1;
    }
    CHECK(differ == 0);
  }
  CHECK(cases > 50);
}

#endif

TEST_CASE("softmax row groups (AVX2, AVX-512): each row bitwise the one-row max and exp2 passes") {
#if BLOCKATTN_SIMD_KERNELS
  on_vector_isas([](auto* v) { check_simd_row_groups_of<std::remove_pointer_t<decltype(v)>>(); });
#endif
}
