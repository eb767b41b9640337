// SPDX-License-Identifier: Apache-2.0
// 8-bit KV cache storage: fp8_e4m3 (1 sign, 4 exponent bits, bias 7, 3
// fraction bits; no infinity, S.1111.111 is NaN; largest 448), fp8_e5m2
// (bias 15, 2 fraction bits, IEEE-style infinities and NaN; largest 57344),
// both as OCP FP8 defines them, and std::int8_t. A cached row (one token's
// head_dim values of one kv head) is stored as x / s in the 8-bit type with
// its own fp32 scale s = max|x| / q_max (q_max = 448, 57344, 127): the
// dequantized value is float(code) * s, one fp32 product.
//
// Rounding: to nearest, ties to even, saturating at +-q_max (x / s never
// exceeds it by more than a rounding). Error of one dequantized value
// against x (docs/numerics.md; u32 = 2^-24, the fp32 roundings of x / s and
// of code * s): int8 |x~ - x| <= s / 2 + 2 u32 (|x| + s) (s / 2 = max|x| /
// 254); fp8 |x~ - x| <= 2^-(m+1) |x| + 2^(emin-m-1) s + 2 u32 (|x| + s) (m
// = 3 or 2 fraction bits; emin = -6 or -14: the subnormals' half unit).
// NaN and infinity: fp8_e4m3 keeps NaN per value and stores +-inf as NaN;
// fp8_e5m2 keeps both; int8 holds neither: a row with a NaN or infinity gets
// the scale NaN (the row's every value reads NaN). The scale comes from the
// row's finite values.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>

#include <cstdint>
#include <type_traits>

namespace blockattn {

/// OCP FP8 E4M3 (as stored; convert with float(x) and fp8_e4m3(f)).
struct fp8_e4m3 {
  std::uint8_t bits = 0;
  fp8_e4m3() = default;
  KOKKOS_INLINE_FUNCTION explicit fp8_e4m3(float f);
  KOKKOS_INLINE_FUNCTION explicit operator float() const;
  static constexpr double unit_roundoff = 1.0 / 16;  // 2^-4
};
/// OCP FP8 E5M2.
struct fp8_e5m2 {
  std::uint8_t bits = 0;
  fp8_e5m2() = default;
  KOKKOS_INLINE_FUNCTION explicit fp8_e5m2(float f);
  KOKKOS_INLINE_FUNCTION explicit operator float() const;
  static constexpr double unit_roundoff = 1.0 / 8;  // 2^-3
};

namespace impl {
/// fp32 -> an 8-bit float with E exponent and M fraction bits (bias B),
/// round to nearest even, finite values saturating at the largest finite
/// code `max_code`; NaN -> nan_code, +-inf -> inf_code.
template <int M, int B>
KOKKOS_INLINE_FUNCTION std::uint8_t fp8_from_float(float f, std::uint32_t max_code,
                                                   std::uint32_t nan_code, std::uint32_t inf_code) {
  const std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 24) & 0x80u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return std::uint8_t(sign | nan_code);
  if (ax == 0x7f800000u) return std::uint8_t(sign | inf_code);
  const int e = int(ax >> 23) - 127;
  std::uint32_t h;
  if (e >= 1 - B) {  // normal
    h = (std::uint32_t(e + B) << M) | ((ax & 0x7fffffu) >> (23 - M));
    const std::uint32_t rem = ax & ((1u << (23 - M)) - 1u), half = 1u << (22 - M);
    if (rem > half || (rem == half && (h & 1u))) ++h;
  } else {  // subnormal: units of 2^(1 - B - M)
    const int s = 24 - B - M - e;
    if (s > 24 || ax < 0x00800000u) return std::uint8_t(sign);
    const std::uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    h = m >> s;
    const std::uint32_t rem = m & ((1u << s) - 1u), half = 1u << (s - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
  }
  return std::uint8_t(sign | (h > max_code ? max_code : h));
}
/// E4M3 bits -> fp32 (exact): the 7 magnitude bits moved under fp32's
/// exponent and scaled by 2^120 (subnormals too), NaN where they are all set.
KOKKOS_INLINE_FUNCTION float e4m3_to_float(std::uint8_t b) {
  const std::uint32_t mag = b & 0x7fu;
  float f = bits_float(mag << 20) * 1.329227995784916e36f;  // 2^120
  if (mag == 0x7fu) f = bits_float(0x7fc00000u);
  return bits_float(float_bits(f) | (std::uint32_t(b & 0x80u) << 24));
}
/// E5M2 bits -> fp32 (exact): as E4M3 with 2^112; exponent 31: inf or NaN.
KOKKOS_INLINE_FUNCTION float e5m2_to_float(std::uint8_t b) {
  const std::uint32_t mag = b & 0x7fu;
  float f = bits_float(mag << 21) * 5.192296858534828e33f;  // 2^112
  if (mag >= 0x7cu) f = bits_float(0x7f800000u | ((mag & 3u) << 21));
  return bits_float(float_bits(f) | (std::uint32_t(b & 0x80u) << 24));
}
}  // namespace impl

KOKKOS_INLINE_FUNCTION fp8_e4m3::fp8_e4m3(float f)
    : bits(impl::fp8_from_float<3, 7>(f, 0x7eu, 0x7fu, 0x7fu)) {}
KOKKOS_INLINE_FUNCTION fp8_e4m3::operator float() const {
  return impl::e4m3_to_float(bits);
}
KOKKOS_INLINE_FUNCTION fp8_e5m2::fp8_e5m2(float f)
    : bits(impl::fp8_from_float<2, 15>(f, 0x7bu, 0x7fu, 0x7cu)) {}
KOKKOS_INLINE_FUNCTION fp8_e5m2::operator float() const {
  return impl::e5m2_to_float(bits);
}

/// The 8-bit KV cache storage types (each row with an fp32 scale).
template <class S>
inline constexpr bool is_kv_quant_v =
    std::is_same<S, fp8_e4m3>::value || std::is_same<S, fp8_e5m2>::value ||
    std::is_same<S, std::int8_t>::value;

/// The largest code's magnitude: 448, 57344, 127.
template <class S>
inline constexpr float quant_max_v = std::is_same<S, fp8_e4m3>::value   ? 448.0f
                                     : std::is_same<S, fp8_e5m2>::value ? 57344.0f
                                                                        : 127.0f;

template <class S>
constexpr const char* quant_type_name() {
  return std::is_same<S, fp8_e4m3>::value   ? "fp8_e4m3"
         : std::is_same<S, fp8_e5m2>::value ? "fp8_e5m2"
                                            : "int8";
}

namespace impl {
/// The code of x / s: fp8 rounded to nearest even and saturating; int8
/// rounded to nearest (ties to even) and clamped to [-127, 127].
template <class S>
KOKKOS_INLINE_FUNCTION S quantize(float y) {
  if constexpr (std::is_same<S, std::int8_t>::value) {
    if (!(y == y)) return std::int8_t(0);  // NaN (its row's scale is NaN)
    const double r = y < -127.0f ? -127.0 : y > 127.0f ? 127.0 : double(y);
    int t = int(r >= 0.0 ? r + 0.5 : r - 0.5);  // to nearest, ties away (exact in double)
    const double d = double(t) - r;             // +-0.5 at a tie
    if ((d == 0.5 || d == -0.5) && (t & 1)) t -= d > 0.0 ? 1 : -1;
    return std::int8_t(t);
  } else {
    return S(y);
  }
}
/// The scale of a row of n values x(0 .. n) (quantize_row): max|x| / q_max
/// over the finite values (1 for a row of zeros); int8 rows with a NaN or an
/// infinity get NaN.
template <class S>
KOKKOS_INLINE_FUNCTION float quant_scale(float amax, bool non_finite) {
  if (std::is_same<S, std::int8_t>::value && non_finite) return bits_float(0x7fc00000u);
  return amax > 0.0f ? amax / quant_max_v<S> : 1.0f;
}
/// The value of a code (the scale applied separately).
KOKKOS_INLINE_FUNCTION float dequantize(std::int8_t c) {
  return float(c);
}
KOKKOS_INLINE_FUNCTION float dequantize(fp8_e4m3 c) {
  return e4m3_to_float(c.bits);
}
KOKKOS_INLINE_FUNCTION float dequantize(fp8_e5m2 c) {
  return e5m2_to_float(c.bits);
}
}  // namespace impl

}  // namespace blockattn
