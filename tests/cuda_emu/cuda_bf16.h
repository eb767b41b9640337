// SPDX-License-Identifier: Apache-2.0
// cuda_emu (cuda_emu.hpp): the bf16 type and conversions of cuda_bf16.h that
// BlockAttn's kernels use (round to nearest even; NaN stays NaN).
#pragma once

#include "cuda_emu.hpp"

#include <blockattn/core/half.hpp>

#include <cstdint>

struct __nv_bfloat16_raw {
  unsigned short x;
};
struct __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  constexpr __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
  constexpr operator __nv_bfloat16_raw() const { return {__x}; }
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return __nv_bfloat16_raw{blockattn::impl::bf16_bits(f)};
}
inline float __bfloat162float(__nv_bfloat16 h) {
  return blockattn::impl::bits_float(std::uint32_t(h.__x) << 16);
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
