// SPDX-License-Identifier: Apache-2.0
// The 16-bit storage types: every bf16 / fp16 value converts to fp32 exactly
// and back to itself; fp32 -> 16 bits rounds to the nearest representable
// value, ties to even, checked against the neighbours in double arithmetic on
// every fp32 pattern near a rounding boundary and a stride through all others.
#include <doctest/doctest.h>

#include <blockattn/core/half.hpp>
#include <blockattn/kernel/impl/half_rows.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace blockattn;

namespace {

float from_bits32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <class H>
double value(std::uint16_t bits) {
  return double(float(H::from_bits(bits)));
}

/// The 16-bit patterns in increasing order of value for non-negative numbers
/// are 0x0000 .. max finite, then inf: the neighbours of a pattern are +-1.
template <class H>
std::uint16_t max_finite() {
  return std::is_same<H, bf16>::value ? 0x7f7f : 0x7bff;
}

/// Is `got` the correctly rounded (nearest, ties to even) 16-bit value of f?
template <class H>
bool rounds_right(float f, std::uint16_t got) {
  const double x = std::fabs(double(f));
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if ((got & 0x8000) != sign) return false;
  const std::uint16_t mag = got & 0x7fff, top = max_finite<H>();
  const double maxv = value<H>(top), ulp_top = maxv - value<H>(top - 1);
  if (x >= maxv + ulp_top / 2) {  // beyond the midpoint to the next power: inf
    // The midpoint itself: max finite has an odd fraction, so the tie goes up.
    const std::uint16_t inf = std::is_same<H, bf16>::value ? 0x7f80 : 0x7c00;
    return mag == inf;
  }
  if (mag > top) return false;
  const double v = value<H>(mag);
  const double below = mag > 0 ? value<H>(mag - 1) : -1.0;
  const double above = mag < top ? value<H>(mag + 1) : maxv + ulp_top;
  const double d = std::fabs(x - v);
  if (mag > 0 && std::fabs(x - below) < d) return false;
  if (std::fabs(x - above) < d) return false;
  // Ties: the even pattern.
  if ((mag > 0 && std::fabs(x - below) == d) || std::fabs(x - above) == d) return (mag & 1) == 0;
  return true;
}

template <class H>
void check_float(std::uint32_t u, int& bad) {
  const float f = from_bits32(u);
  const std::uint16_t got = H(f).bits;
  if (std::isnan(f)) {
    const bool nan = std::isnan(float(H::from_bits(got)));
    const bool quiet = std::is_same<H, bf16>::value ? (got & 0x0040) : (got & 0x0200);
    if (!nan || !quiet || bool(got & 0x8000) != bool(u & 0x80000000u)) ++bad;
    return;
  }
  if (!rounds_right<H>(f, got)) {
    if (bad < 5) FAIL_CHECK("fp32 bits " << u << " -> " << got);
    ++bad;
  }
}

/// fp32 patterns near every rounding boundary of H (low bits around the
/// halfway point of the dropped fraction), for all high bits, plus a stride
/// through all 2^32 patterns.
template <class H>
int check_rounding() {
  int bad = 0;
  const int dropped = std::is_same<H, bf16>::value ? 16 : 13;
  const std::uint32_t halfway = 1u << (dropped - 1), mask = (1u << dropped) - 1;
  const std::uint32_t lows[] = {0, 1, halfway - 1, halfway, halfway + 1, mask};
  for (std::uint64_t hi = 0; hi < (std::uint64_t(1) << (32 - dropped)); ++hi)
    for (std::uint32_t lo : lows) check_float<H>(std::uint32_t(hi << dropped) | lo, bad);
  for (std::uint64_t u = 0; u < (std::uint64_t(1) << 32); u += 4099)
    check_float<H>(std::uint32_t(u), bad);
  return bad;
}

template <class H>
void check_exact_round_trip() {
  int bad = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const H h = H::from_bits(std::uint16_t(b));
    const float f = float(h);
    if (std::isnan(f)) {
      if (!std::isnan(float(H(f)))) ++bad;
      continue;
    }
    if (H(f).bits != b) ++bad;
  }
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("bf16 and fp16: every value converts to fp32 exactly and back to itself") {
  check_exact_round_trip<bf16>();
  check_exact_round_trip<fp16>();
  // Known encodings.
  CHECK(float(bf16::from_bits(0x3f80)) == 1.0f);
  CHECK(float(bf16::from_bits(0x7f7f)) == 0x1.fep127f);
  CHECK(float(fp16::from_bits(0x3c00)) == 1.0f);
  CHECK(float(fp16::from_bits(0x7bff)) == 65504.0f);
  CHECK(float(fp16::from_bits(0x0001)) == 0x1p-24f);
  CHECK(float(fp16::from_bits(0x03ff)) == 0x3ffp-24f);
  CHECK(std::isinf(float(fp16::from_bits(0xfc00))));
}

TEST_CASE("fp32 -> bf16 / fp16 rounds to nearest, ties to even, overflow to inf") {
  CHECK(check_rounding<bf16>() == 0);
  CHECK(check_rounding<fp16>() == 0);
  // Ties, spelled out.
  CHECK(fp16(1.0f + 0x1p-11f).bits == 0x3c00);      // tie -> even (down)
  CHECK(fp16(1.0f + 3 * 0x1p-11f).bits == 0x3c02);  // tie -> even (up)
  CHECK(fp16(65519.0f).bits == 0x7bff);             // below the midpoint
  CHECK(fp16(65520.0f).bits == 0x7c00);             // the midpoint: inf
  CHECK(fp16(0x1p-25f).bits == 0x0000);             // tie with 0 -> 0
  CHECK(fp16(0x1.000002p-25f).bits == 0x0001);      // just above -> 2^-24
  CHECK(fp16(-0x1.8p-24f).bits == 0x8002);          // 1.5 units -> 2 (even)
  CHECK(bf16(1.0f + 0x1p-8f).bits == 0x3f80);       // tie -> even
  CHECK(bf16(std::numeric_limits<float>::max()).bits == 0x7f80);
  CHECK(bf16(-0.0f).bits == 0x8000);
  CHECK(fp16(-0.0f).bits == 0x8000);
  CHECK(bf16::unit_roundoff == 0x1p-8);
  CHECK(fp16::unit_roundoff == 0x1p-11);
}

TEST_CASE("fp16 rows: the vector widening and narrowing are bitwise the scalar conversions") {
  // kernel/impl/half_rows.hpp: AVX-512F or F16C where this file is compiled
  // for them or, in a run-time dispatch build, where the dispatched ISA has
  // them; the scalar loop elsewhere (then this compares the loop with itself;
  // the message says which ran). Rows of odd lengths take the scalar tail too.
#if BLOCKATTN_HALF_ROWS < 0
  const int width = impl::half_rows_dispatched();
  // The isa_* / dispatch_* runs name the ISA they cap the dispatch at.
  if (const char* isa = std::getenv("BLOCKATTN_EXPECT_DISPATCHED")) {
    INFO("BLOCKATTN_EXPECT_DISPATCHED=", isa);
    if (std::string(isa) == "avx512") CHECK(width == (BLOCKATTN_HOST_DISPATCH_AVX512 ? 512 : 0));
    if (std::string(isa) == "avx2") CHECK(width == 256);  // every AVX2 CPU has F16C
    if (std::string(isa) == "sse2") CHECK(width == 0);
  }
#else
  const int width = impl::half_rows_width;
#endif
  MESSAGE(
      "fp16 rows: ", width == 0 ? std::string("scalar") : std::to_string(width) + "-bit vectors",
      std::string(impl::half_rows_width < 0 ? " (chosen at run time)" : ""));
  // Widening: every fp16 pattern (signalling NaNs included), scales 1 and 0.125.
  std::vector<fp16> h(65536 + 7);
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = fp16::from_bits(std::uint16_t(i * 40503u));
  for (std::size_t i = 0; i < 65536; ++i) h[i] = fp16::from_bits(std::uint16_t(i));
  std::vector<float> w(h.size());
  long bad = 0;
  for (const float scale : {1.0f, 0.125f}) {
    impl::widen_fp16_row(w.data(), h.data(), int(h.size()), scale);
    for (std::size_t i = 0; i < h.size(); ++i) {
      const float want = scale * float(h[i]);
      std::uint32_t a, b;
      std::memcpy(&a, &w[i], 4);
      std::memcpy(&b, &want, 4);
      bad += a != b;
    }
  }
  CHECK(bad == 0);
  // Narrowing: fp32 patterns near every fp16 rounding boundary (the ties and
  // their neighbours, subnormal ones and the overflow midpoint included),
  // inf, NaNs with payloads, and random patterns; scales 1 and 3.
  std::vector<float> f;
  for (std::uint32_t e = 0; e < 256; ++e)
    for (std::uint32_t m : {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x2000u, 0x3000u, 0x7fffffu,
                            0x400000u, 0x401000u, 0x3ff000u})
      for (std::uint32_t sign : {0u, 0x80000000u}) f.push_back(from_bits32(sign | e << 23 | m));
  std::mt19937 rng(5);
  for (int i = 0; i < 200000; ++i) f.push_back(from_bits32(rng()));
  f.push_back(65519.0f);
  f.push_back(65520.0f);
  f.push_back(0x1p-25f);
  f.push_back(0x1.000002p-25f);
  std::vector<fp16> out(f.size());
  for (const float scale : {1.0f, 3.0f}) {
    impl::narrow_fp16_row(out.data(), f.data(), int(f.size()), scale);
    for (std::size_t i = 0; i < f.size(); ++i) bad += out[i].bits != fp16(f[i] * scale).bits;
  }
  CHECK(bad == 0);
}
