// SPDX-License-Identifier: Apache-2.0
// 8-bit KV caches (core/quant.hpp, attention_decode_quantized): every fp8
// code converts back to itself and fp32 values round to the nearest code;
// the dequantized values of a row are within the stated bound of the
// originals (docs/numerics.md); decode over an fp8_e4m3 / fp8_e5m2 / int8
// cache (fp32, bf16 queries; GQA; masks; splits) matches the fp64 reference
// of the dequantized values within attention_decode's bound, and the fp64
// reference of the original values within that bound plus the quantization
// error's effect; NaN rules; argument errors.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <cmath>
#include <cstring>
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
using V4 = Kokkos::View<T****, Kokkos::LayoutRight, MemSpace>;
using F3 = Kokkos::View<float***, Kokkos::LayoutRight, MemSpace>;

/// The bound on |x~ - x| of one dequantized value (core/quant.hpp): s the
/// row's scale.
template <class S>
double quant_bound(double x, double s) {
  const double u32 = std::ldexp(1.0, -24);
  if constexpr (std::is_same<S, std::int8_t>::value) {
    return s / 2 + u32 * 2 * (std::abs(x) + s);
  } else {
    const int m = std::is_same<S, fp8_e4m3>::value ? 3 : 2;
    const int emin = std::is_same<S, fp8_e4m3>::value ? -6 : -14;
    return std::ldexp(1.0, -(m + 1)) * std::abs(x) + std::ldexp(1.0, emin - m - 1) * s +
           u32 * 2 * (std::abs(x) + s);
  }
}

/// Rows of t (b, n, h, :) quantized as the caches do: codes and one scale
/// per row; `deq` gets the dequantized values.
template <class S>
void quantize_rows(const HostTensor& t, std::vector<S>& codes, std::vector<float>& scales,
                   HostTensor& deq) {
  const int D = t.d;
  codes.assign(t.data.size(), S{});
  scales.assign(t.data.size() / std::size_t(D), 0.0f);
  std::size_t row = 0;
  for (int b = 0; b < t.b; ++b)
    for (int n = 0; n < t.n; ++n)
      for (int h = 0; h < t.h; ++h, ++row) {
        float amax = 0.0f;
        for (int d = 0; d < D; ++d) amax = std::max(amax, std::abs(float(t(b, n, h, d))));
        const float s = amax > 0.0f ? amax / quant_max_v<S> : 1.0f;
        scales[row] = s;
        for (int d = 0; d < D; ++d) {
          const S c = impl::quantize<S>(float(t(b, n, h, d)) / s);
          codes[row * std::size_t(D) + std::size_t(d)] = c;
          deq(b, n, h, d) = double(impl::dequantize(c) * s);
        }
      }
}

template <class S>
Kokkos::View<S****, Kokkos::LayoutRight, MemSpace> upload_codes(const std::vector<S>& c, int b,
                                                                int n, int h, int d) {
  Kokkos::View<S****, Kokkos::LayoutRight, MemSpace> v("codes", b, n, h, d);
  auto m = Kokkos::create_mirror_view(v);
  std::memcpy(m.data(), c.data(), c.size() * sizeof(S));
  Kokkos::deep_copy(v, m);
  return v;
}
F3 upload_scales(const std::vector<float>& s, int b, int n, int h) {
  F3 v("scales", b, n, h);
  auto m = Kokkos::create_mirror_view(v);
  std::memcpy(m.data(), s.data(), s.size() * sizeof(float));
  Kokkos::deep_copy(v, m);
  return v;
}

template <class S, class QT, class Mask>
void check_quant_decode(const std::vector<int>& lengths, int rows, int H, int Hkv, int D,
                        int splits, const Mask& mask, std::uint64_t seed) {
  const int B = int(lengths.size());
  int cap = 1;
  for (int l : lengths) cap = std::max(cap, l);
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(B, rows, H, D, rng, 2.0);
  HostTensor k = random_tensor(B, cap, Hkv, D, rng, 2.0);
  HostTensor v = random_tensor(B, cap, Hkv, D, rng);
  V4<QT> qd("q", B, rows, H, D), o("o", B, rows, H, D);
  upload(q, qd);
  HostTensor kq = k, vq = v;
  std::vector<S> kc, vc;
  std::vector<float> ks, vs;
  quantize_rows(k, kc, ks, kq);
  quantize_rows(v, vc, vs, vq);
  // The dequantized values against the originals, value by value.
  double worst_value = 0.0;
  for (std::size_t i = 0; i < k.data.size(); ++i) {
    const std::size_t row = i / std::size_t(D);
    worst_value = std::max(worst_value,
                           std::abs(kq.data[i] - k.data[i]) / quant_bound<S>(k.data[i], ks[row]));
    worst_value = std::max(worst_value,
                           std::abs(vq.data[i] - v.data[i]) / quant_bound<S>(v.data[i], vs[row]));
  }
  CHECK(worst_value <= 1.0);
  const auto kd = upload_codes(kc, B, cap, Hkv, D), vd = upload_codes(vc, B, cap, Hkv, D);
  const F3 ksd = upload_scales(ks, B, cap, Hkv), vsd = upload_scales(vs, B, cap, Hkv);
  Kokkos::View<int*, MemSpace> len("len", B);
  Kokkos::View<index_type*, MemSpace> qpos("qpos", B);
  auto lh = Kokkos::create_mirror_view(len);
  auto ph = Kokkos::create_mirror_view(qpos);
  for (int b = 0; b < B; ++b) {
    lh(b) = lengths[std::size_t(b)];
    ph(b) = std::max(0, lengths[std::size_t(b)] - rows);
  }
  Kokkos::deep_copy(len, lh);
  Kokkos::deep_copy(qpos, ph);
  F3 lse("lse", B, H, rows);
  DecodeOptions opts;
  opts.splits = splits;
  attention_decode_quantized(ExecSpace{}, qd, kd, vd, ksd, vsd, len, qpos, o, lse, mask,
                             OffsetPositions{}, opts);
  Kokkos::fence();
  auto oh = to_host(o);
  auto lsh = to_host(lse);
  double worst_deq = 0.0, worst_orig = 0.0;
  bool ok = true;
  for (int b = 0; b < B; ++b) {
    const int L = lengths[std::size_t(b)];
    if (L == 0) continue;
    auto slice = [&](const HostTensor& t, int n0, int n) {
      HostTensor r(1, n, t.h, t.d);
      for (int i = 0; i < n; ++i)
        for (int h = 0; h < t.h; ++h)
          for (int d = 0; d < t.d; ++d) r(0, i, h, d) = t(b, n0 + i, h, d);
      return r;
    };
    const double sc = 1.0 / std::sqrt(double(D));
    const HostTensor qb = slice(q, 0, rows);
    const ReferenceResult deq = reference_attention(qb, slice(kq, 0, L), slice(vq, 0, L), mask, sc,
                                                    std::max(0, L - rows), 0);
    const ReferenceResult orig =
        reference_attention(qb, slice(k, 0, L), slice(v, 0, L), mask, sc, std::max(0, L - rows), 0);
    // The kernel's bound on the dequantized values (fp32 arithmetic; a
    // 16-bit O rounded once); against the originals, more: a logit moves by
    // at most |q| . |k~ - k| <= scale sum_d |q_d| e_k (e_k: the key's value
    // bound), which changes O by at most 2 max|V| times that, and each value
    // by its own bound e_v.
    double tol = tolerance<float>(deq, D, L);
    if constexpr (!std::is_same<QT, float>::value) tol += 2.0 * QT::unit_roundoff;
    double ek = 0.0, ev = 0.0, qsum = 0.0;
    for (int j = 0; j < L; ++j)
      for (int g = 0; g < Hkv; ++g) {
        const std::size_t row = (std::size_t(b) * cap + j) * Hkv + g;
        for (int d = 0; d < D; ++d) {
          ek = std::max(ek, quant_bound<S>(k(b, j, g, d), ks[row]));
          ev = std::max(ev, quant_bound<S>(v(b, j, g, d), vs[row]));
        }
      }
    for (double x : qb.data) qsum = std::max(qsum, std::abs(x));
    const double logit = sc * D * qsum * ek;
    const double extra = 2.0 * 1.0 * (std::exp(2 * logit) - 1.0) + ev;
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < rows; ++i) {
        const double want = deq.lse[std::size_t(h) * rows + i];
        const double got = double(lsh(b, h, i));
        if (std::isinf(want)) {
          ok = ok && std::isinf(got);
          continue;
        }
        worst_deq = std::max(worst_deq, std::abs(got - want) / tol);
        worst_orig = std::max(
            worst_orig, std::abs(got - orig.lse[std::size_t(h) * rows + i]) / (tol + 2 * logit));
        for (int d = 0; d < D; ++d) {
          const double x = double(oh(b, i, h, d));
          worst_deq = std::max(worst_deq, std::abs(x - deq.o(0, i, h, d)) / tol);
          worst_orig = std::max(worst_orig, std::abs(x - orig.o(0, i, h, d)) / (tol + extra));
        }
      }
  }
  INFO(std::string(quant_type_name<S>()), " q ", std::string(value_type_name<QT>()), " H=", H,
       " Hkv=", Hkv, " D=", D, " rows=", rows, " splits=", splits, ": value err/bound ",
       worst_value, ", O/LSE vs dequantized ", worst_deq, ", vs originals ", worst_orig);
  CHECK(ok);
  CHECK(worst_deq <= 1.0);
  CHECK(worst_orig <= 1.0);
}

}  // namespace

TEST_SUITE("quant") {
  TEST_CASE("fp8 codes: every code converts back to itself, values to the nearest code") {
    for (int b = 0; b < 256; ++b) {
      fp8_e4m3 c;
      c.bits = std::uint8_t(b);
      const float f = float(c);
      if ((b & 0x7f) == 0x7f) {
        CHECK(std::isnan(f));
      } else if (f != 0.0f) {
        CHECK(fp8_e4m3(f).bits == b);
      }
      fp8_e5m2 e;
      e.bits = std::uint8_t(b);
      const float g = float(e);
      if ((b & 0x7c) == 0x7c) {
        CHECK(((b & 3) == 0 ? std::isinf(g) : std::isnan(g)));
      } else if (g != 0.0f) {
        CHECK(fp8_e5m2(g).bits == b);
      }
    }
    CHECK(float(fp8_e4m3(448.0f)) == 448.0f);
    CHECK(float(fp8_e4m3(1e6f)) == 448.0f);  // saturates
    CHECK(std::isnan(float(fp8_e4m3(std::numeric_limits<float>::infinity()))));
    CHECK(float(fp8_e5m2(1e6f)) == 57344.0f);
    CHECK(std::isinf(float(fp8_e5m2(std::numeric_limits<float>::infinity()))));
    CHECK(float(fp8_e4m3(0.001953125f)) == 0.001953125f);  // the smallest subnormal, 2^-9
    CHECK(float(fp8_e4m3(0.0009765625f)) == 0.0f);         // 2^-10: a tie, to even (0)
    CHECK(float(fp8_e4m3(1.0625f)) == 1.0f);               // a tie between 1 and 1.125: even
    CHECK(float(fp8_e4m3(1.1875f)) == 1.25f);              // a tie between 1.125 and 1.25
    CHECK(impl::quantize<std::int8_t>(2.5f) == 2);
    CHECK(impl::quantize<std::int8_t>(-3.5f) == -4);
    CHECK(impl::quantize<std::int8_t>(0.49999997f) == 0);
    CHECK(impl::quantize<std::int8_t>(300.0f) == 127);
    // Nearest: the brute-force nearest code of values across the range.
    std::mt19937_64 rng(3);
    std::uniform_real_distribution<float> u(-500.0f, 500.0f);
    int far4 = 0, far5 = 0;
    for (int i = 0; i < 20000; ++i) {
      const float x = i % 2 ? u(rng) : u(rng) * 1e-3f;
      float b4 = 0.0f, b5 = 0.0f;
      for (int b = 0; b < 256; ++b) {
        fp8_e4m3 c;
        c.bits = std::uint8_t(b);
        fp8_e5m2 e;
        e.bits = std::uint8_t(b);
        if (std::isfinite(float(c)) && std::abs(float(c) - x) < std::abs(b4 - x)) b4 = float(c);
        if (std::isfinite(float(e)) && std::abs(float(e) - x) < std::abs(b5 - x)) b5 = float(e);
      }
      far4 += std::abs(float(fp8_e4m3(x)) - x) > std::abs(b4 - x);
      far5 += std::abs(float(fp8_e5m2(x)) - x) > std::abs(b5 - x);
    }
    CHECK(far4 == 0);
    CHECK(far5 == 0);
  }

  TEST_CASE_TEMPLATE("decode over an 8-bit cache matches fp64 within the stated bounds", S,
                     fp8_e4m3, fp8_e5m2, std::int8_t) {
    const std::vector<int> lengths = {1, 40, 0, 700};
    std::uint64_t seed = 21;
    for (int splits : {0, 3}) {
      check_quant_decode<S, float>(lengths, 1, 8, 2, 64, splits, CausalMask{}, seed++);
      check_quant_decode<S, bf16>(lengths, 3, 4, 4, 32, splits, causal_window(100), seed++);
    }
    check_quant_decode<S, float>({2000}, 1, 8, 1, 128, 0, CausalMask{}, seed++);
    // bf16 queries, 8 and 16 rows per kv head: the AMX tiles where they run
    // (decode_amx.hpp; codes widened to bf16 exactly).
    check_quant_decode<S, bf16>({2000, 77}, 2, 8, 2, 64, 0, CausalMask{}, seed++);
    check_quant_decode<S, bf16>({1500}, 1, 16, 1, 128, 0, causal_window(300), seed++);
  }

  TEST_CASE("attention_decode_quantized: NaN stays where it is visible; argument errors") {
    const int B = 1, L = 40, H = 2, D = 16;
    V4<float> q("q", B, 1, H, D), o("o", B, 1, H, D);
    Kokkos::View<fp8_e4m3****, Kokkos::LayoutRight, MemSpace> k("k", B, L, 1, D),
        v("v", B, L, 1, D);
    F3 ks("ks", B, L, 1), vs("vs", B, L, 1), bad("bad", B, L + 1, 1), lse("lse", B, H, 1);
    Kokkos::View<int*, MemSpace> len("len", B);
    Kokkos::View<index_type*, MemSpace> qpos("qpos", B);
    Kokkos::deep_copy(len, L);
    Kokkos::deep_copy(qpos, index_type(L - 1));
    Kokkos::deep_copy(ks, 1.0f);
    Kokkos::deep_copy(vs, 1.0f);
    // Value 3 of key 5 is NaN: only column 3 of the output is NaN.
    auto vh = Kokkos::create_mirror_view(v);
    Kokkos::deep_copy(vh, v);
    vh(0, 5, 0, 3) = fp8_e4m3(std::numeric_limits<float>::quiet_NaN());
    Kokkos::deep_copy(v, vh);
    attention_decode_quantized(ExecSpace{}, q, k, v, ks, vs, len, qpos, o, lse, CausalMask{});
    Kokkos::fence();
    auto oh = to_host(o);
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d) CHECK(std::isnan(oh(0, 0, h, d)) == (d == 3));
    CHECK_THROWS_WITH_AS(
        attention_decode_quantized(ExecSpace{}, q, k, v, bad, vs, len, qpos, o, lse),
        doctest::Contains("argument 'k_scales' has extent(1) (capacity) = 41, expected 40"),
        invalid_argument);
    CHECK_THROWS_WITH_AS(
        attention_decode_quantized(ExecSpace{}, q, k, v, ks, bad, len, qpos, o, lse),
        doctest::Contains("argument 'v_scales' has extent(1)"), invalid_argument);
  }
}
