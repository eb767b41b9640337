// SPDX-License-Identifier: Apache-2.0
// cuda_emu (cuda_emu.hpp): the fp16 type and conversions of cuda_fp16.h that
// BlockAttn's kernels use (round to nearest even, subnormals kept).
#pragma once

#include "cuda_emu.hpp"

#include <blockattn/core/half.hpp>

struct __half_raw {
  unsigned short x;
};
struct __half {
  unsigned short __x;
  __half() = default;
  constexpr __half(const __half_raw& r) : __x(r.x) {}
  constexpr operator __half_raw() const { return {__x}; }
};
struct alignas(4) __half2 {
  __half x, y;
};

inline __half __float2half_rn(float f) {
  return __half_raw{blockattn::impl::fp16_bits(f)};
}
inline float __half2float(__half h) {
  return blockattn::impl::fp16_to_float(h.__x);
}
inline __half2 __floats2half2_rn(float lo, float hi) {
  return {__float2half_rn(lo), __float2half_rn(hi)};
}
