// SPDX-License-Identifier: Apache-2.0
// exp2 for the softmax numerators: arguments are <= 0 (s - rowmax) or -inf.
#pragma once

#include <blockattn/core/config.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace blockattn::impl {

template <class To, class From>
KOKKOS_FORCEINLINE_FUNCTION To bit_cast(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  To y;
  std::memcpy(&y, &x, sizeof(To));
  return y;
}

/// True for +-inf and NaN (exponent bits all ones), by integer test: valid
/// in device code and unaffected by the compiler's floating-point flags.
template <class T>
KOKKOS_FORCEINLINE_FUNCTION bool is_nonfinite(T x) {
  using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  constexpr Bits exponent = sizeof(T) == 4 ? Bits(0x7f800000u) : Bits(0x7ff0000000000000ull);
  return (bit_cast<Bits>(x) & exponent) == exponent;
}

/// A quiet NaN of T.
template <class T>
KOKKOS_FORCEINLINE_FUNCTION T quiet_nan() {
  using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  return bit_cast<T>(sizeof(T) == 4 ? Bits(0x7fc00000u) : Bits(0x7ff8000000000000ull));
}

/// The constants of the fp32 exp2 below (also used by the vector versions,
/// host/micro_gemm_simd.hpp).
struct Exp2fConstants {
  static constexpr float min_arg = -126.0f;          // smallest argument with a normal result
  static constexpr float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  static constexpr float c1 = 6.931472028550421e-1f, c2 = 2.402264791363012e-1f,
                         c3 = 5.550332471162809e-2f, c4 = 9.618437357674640e-3f,
                         c5 = 1.339887440266574e-3f, c6 = 1.535336188319500e-4f;
  static constexpr std::uint32_t exponent_bias = 127, mantissa_bits = 23;
};

/// 2^x for x <= 0 in fp32 (also correct for 0 < x < 128), written as
/// straight-line arithmetic so that host compilers vectorise the softmax row
/// loop and device compilers accept it. Returns exactly 0 for x < -126 and for
/// x = -inf, so masked logits contribute nothing; NaN of either sign gives
/// NaN.
///
/// Range reduction x = n + f with n = round(x) (the 1.5 * 2^23 trick, no
/// float->int conversion) and |f| <= 1/2; 2^f by the degree-6 polynomial of
/// Cephes' exp2f (relative error <= 1.2e-7, about 1 ulp); 2^n assembled in the
/// exponent field. Arguments below -126 run through the same arithmetic (in
/// unsigned integers: no overflow) and are then cleared by one mask, taken
/// from a comparison that is true for NaN (not x < -126), so a NaN argument
/// keeps the NaN the polynomial made of it. The select is an integer mask,
/// not a branch: GCC refuses to if-convert a conditional float computation
/// under its default -ftrapping-math, and the loop then stays scalar (5x
/// slower).
KOKKOS_FORCEINLINE_FUNCTION float exp2_nonpositive(float x) {
  using C = Exp2fConstants;
  // A local copy: bit_cast takes a reference, and device code may not refer
  // to a static member (nvcc: "undefined in device code").
  constexpr float round_magic = C::round_magic;
  const std::uint32_t keep = 0u - static_cast<std::uint32_t>(!(x < C::min_arg));
  const std::uint32_t n_bits =
      bit_cast<std::uint32_t>(x + round_magic) - bit_cast<std::uint32_t>(round_magic);
  const std::int32_t n = bit_cast<std::int32_t>(n_bits);
  const float f = x - static_cast<float>(n);  // in [-1/2, 1/2] for x >= -126
  const float poly =
      1.0f + f * (C::c1 + f * (C::c2 + f * (C::c3 + f * (C::c4 + f * (C::c5 + f * C::c6)))));
  const float two_n = bit_cast<float>((n_bits + C::exponent_bias) << C::mantissa_bits);
  return bit_cast<float>(bit_cast<std::uint32_t>(poly * two_n) & keep);
}

/// fp64: the library exp2 (about 1 ulp); fp64 is the accuracy path, not the
/// speed path.
KOKKOS_FORCEINLINE_FUNCTION double exp2_nonpositive(double x) {
  return kmath::exp2(x);
}

}  // namespace blockattn::impl
