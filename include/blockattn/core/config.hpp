// SPDX-License-Identifier: Apache-2.0
// Basic types, version, and the small Kokkos 3.4 .. 4.x compatibility layer.
#pragma once

#include <Kokkos_Core.hpp>

#include <cstdint>

#define BLOCKATTN_VERSION_MAJOR 0
#define BLOCKATTN_VERSION_MINOR 1
#define BLOCKATTN_VERSION_PATCH 0

/// Full unrolling of loops with compile-time trip counts (register tiles).
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__) || defined(__clang__)
#define BLOCKATTN_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define BLOCKATTN_UNROLL _Pragma("GCC unroll 64")
#else
#define BLOCKATTN_UNROLL
#endif

namespace blockattn {

/// Global token positions and extents. 64-bit so that positions of sequences
/// spread over many ranks never overflow.
using index_type = std::int64_t;

namespace impl {

// Kokkos 3.7 moved the math functions from Kokkos::Experimental into Kokkos
// and 4.x removed the old spelling; everything in BlockAttn goes through here.
#if KOKKOS_VERSION >= 30700
namespace kmath = ::Kokkos;
#else
namespace kmath = ::Kokkos::Experimental;
#endif

template <class T>
KOKKOS_INLINE_FUNCTION constexpr T infinity() {
  return Kokkos::Experimental::infinity<T>::value;
}

/// ln(2) and log2(e): the kernels work in base 2 and convert at the boundary.
template <class T>
inline constexpr T ln2 = T(0.693147180559945309417232121458176568);
template <class T>
inline constexpr T log2e = T(1.442695040888963407359924681001892137);

}  // namespace impl
}  // namespace blockattn
