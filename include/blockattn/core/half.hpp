// SPDX-License-Identifier: Apache-2.0
// 16-bit storage types: bf16 (1 sign, 8 exponent, 7 fraction bits: fp32's
// range) and fp16 (IEEE binary16: 5 exponent, 10 fraction bits). Two bytes on
// every backend and compiler (Kokkos 3.4's host half_t is a float), trivially
// copyable, usable in device code. Arithmetic happens in fp32: convert with
// float(x) (exact) and bf16(f) / fp16(f) (round to nearest, ties to even;
// overflow to +-inf; NaN stays NaN, quiet, with its sign).
//
// Unit roundoff of the storage (half an ulp at 1): bf16 2^-8, fp16 2^-11.
#pragma once

#include <blockattn/core/config.hpp>

#include <cstdint>
#include <type_traits>

namespace blockattn {

namespace impl {
KOKKOS_INLINE_FUNCTION std::uint32_t float_bits(float f) {
  std::uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
}
KOKKOS_INLINE_FUNCTION float bits_float(std::uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

/// fp32 -> bf16 bits, round to nearest even.
KOKKOS_INLINE_FUNCTION std::uint16_t bf16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x0040u);  // quiet NaN
  return std::uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/// fp32 -> IEEE binary16 bits, round to nearest even (subnormals included).
KOKKOS_INLINE_FUNCTION std::uint16_t fp16_bits(float f) {
  const std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return std::uint16_t(sign | 0x7e00u);   // NaN (quiet)
  if (ax >= 0x477ff000u) return std::uint16_t(sign | 0x7c00u);  // >= 65520: inf
  if (ax >= 0x38800000u) {                                      // normal: >= 2^-14
    const std::uint32_t e = (ax >> 23) - 112u, m = ax & 0x7fffffu;
    std::uint32_t h = (e << 10) | (m >> 13);
    const std::uint32_t rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry moves up the exponent
    return std::uint16_t(sign | h);
  }
  if (ax <= 0x33000000u) return std::uint16_t(sign);  // <= 2^-25: zero (2^-25 ties to even 0)
  // Subnormal: units of 2^-24.
  const std::uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126u - e;  // 14 .. 24
  std::uint32_t h = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (h & 1u))) ++h;
  return std::uint16_t(sign | h);
}

KOKKOS_INLINE_FUNCTION float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float v = float(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return bits_float(float_bits(v) | sign);
  }
  if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));  // inf, NaN
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}
}  // namespace impl

/// bfloat16 storage. float(x) is exact; bf16(f) rounds to nearest even.
struct bf16 {
  std::uint16_t bits;
  bf16() = default;
  KOKKOS_INLINE_FUNCTION explicit bf16(float f) : bits(impl::bf16_bits(f)) {}
  KOKKOS_INLINE_FUNCTION explicit operator float() const {
    return impl::bits_float(std::uint32_t(bits) << 16);
  }
  KOKKOS_INLINE_FUNCTION explicit operator double() const { return double(float(*this)); }
  KOKKOS_INLINE_FUNCTION static bf16 from_bits(std::uint16_t b) {
    bf16 x;
    x.bits = b;
    return x;
  }
  /// Unit roundoff of the storage: 2^-8.
  static constexpr double unit_roundoff = 1.0 / 256;
};

/// IEEE binary16 storage. float(x) is exact; fp16(f) rounds to nearest even.
struct fp16 {
  std::uint16_t bits;
  fp16() = default;
  KOKKOS_INLINE_FUNCTION explicit fp16(float f) : bits(impl::fp16_bits(f)) {}
  KOKKOS_INLINE_FUNCTION explicit operator float() const { return impl::fp16_to_float(bits); }
  KOKKOS_INLINE_FUNCTION explicit operator double() const { return double(float(*this)); }
  KOKKOS_INLINE_FUNCTION static fp16 from_bits(std::uint16_t b) {
    fp16 x;
    x.bits = b;
    return x;
  }
  /// Unit roundoff of the storage: 2^-11.
  static constexpr double unit_roundoff = 1.0 / 2048;
};

static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable<bf16>::value &&
                  std::is_trivially_default_constructible<bf16>::value,
              "BlockAttn: bf16 must be a trivially copyable 16-bit type");
static_assert(sizeof(fp16) == 2 && std::is_trivially_copyable<fp16>::value &&
                  std::is_trivially_default_constructible<fp16>::value,
              "BlockAttn: fp16 must be a trivially copyable 16-bit type");

/// True for the 16-bit storage types (stored in 16 bits, computed in fp32).
template <class T>
inline constexpr bool is_half_storage_v =
    std::is_same<T, bf16>::value || std::is_same<T, fp16>::value;

/// The value types the kernels take for Q, K, V, O and the gradients.
template <class T>
inline constexpr bool is_value_type_v =
    std::is_same<T, float>::value || std::is_same<T, double>::value || is_half_storage_v<T>;

/// The type a storage type is computed in: fp32 for bf16 and fp16 (LSE, the
/// softmax state and every accumulator), the type itself for float and double.
template <class T>
struct compute_type {
  using type = T;
};
template <>
struct compute_type<bf16> {
  using type = float;
};
template <>
struct compute_type<fp16> {
  using type = float;
};
template <class T>
using compute_t = typename compute_type<T>::type;

/// The name of a value type, for messages and benches.
template <class T>
constexpr const char* value_type_name() {
  if constexpr (std::is_same<T, float>::value)
    return "fp32";
  else if constexpr (std::is_same<T, double>::value)
    return "fp64";
  else if constexpr (std::is_same<T, bf16>::value)
    return "bf16";
  else if constexpr (std::is_same<T, fp16>::value)
    return "fp16";
  else
    return "unsupported";
}

}  // namespace blockattn
