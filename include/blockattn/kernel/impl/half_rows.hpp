// SPDX-License-Identifier: Apache-2.0
// Contiguous rows of IEEE binary16 (fp16) widened to fp32 and narrowed back
// in vector instructions on x86 hosts, bitwise as the scalar conversions of
// core/half.hpp (fp16_to_float, fp16_bits).
//
// The scalar conversions are branchy bit manipulation (subnormals, inf, NaN,
// rounding): on a Zen 4 (1 thread, H = 16, N = 1024, D = 128, causal, perf)
// the O store's narrowing took about a quarter of the fp16 forward kernel's
// samples and the K/V packing 10 % of the call, and the fp16 forward ran at
// 0.64-0.86x the fp32 forward at N = 1024. vcvtph2ps / vcvtps2ph convert 16
// (AVX-512F) or 8 (F16C) values per instruction, exactly: the hardware widening
// is exact for every finite value and the narrowing rounds to nearest even with
// subnormals and overflow to inf as fp16_bits does; only NaN and inf bit
// patterns are rebuilt here to match the scalar rules (widening keeps a
// signalling NaN signalling; narrowing gives every NaN the one quiet NaN of
// its sign).
//
// The AVX-512 forms are the zero-masking ones: GCC 12's plain ones trip
// -Wmaybe-uninitialized through their _mm512_undefined_* operand.
//
// Chosen at compile time where the translation unit targets AVX-512F, or F16C
// + AVX2 (x86-64-v3); at run time in run-time dispatch builds compiled for
// less (kernel/isa.hpp: the x86-64 baseline), by the dispatched ISA: the
// AVX-512 forms under AVX-512 kernels, the F16C ones under AVX2 kernels on a
// CPU with F16C (CPUID), so that BLOCKATTN_HOST_ISA caps both alike; the
// scalar loop elsewhere (device code, other CPUs).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/isa.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#if !defined(__CUDA_ARCH__) && !defined(__HIP_DEVICE_COMPILE__) && \
    !defined(__SYCL_DEVICE_ONLY__) && (defined(__x86_64__) || defined(__i386__))
#if defined(__AVX512F__)
#define BLOCKATTN_HALF_ROWS 512
#include <immintrin.h>
#elif defined(__F16C__) && defined(__AVX2__)
#define BLOCKATTN_HALF_ROWS 256
#include <immintrin.h>
#elif BLOCKATTN_HOST_DISPATCH
#define BLOCKATTN_HALF_ROWS -1  // chosen at run time (half_rows_dispatched)
#include <cpuid.h>
#include <immintrin.h>
#endif
#endif
#if !defined(BLOCKATTN_HALF_ROWS)
#define BLOCKATTN_HALF_ROWS 0
#endif

// The vector forms' target attributes: none where the translation unit has
// their ISA, the dispatched ISA's (with F16C for the 256-bit ones) otherwise.
#if BLOCKATTN_HALF_ROWS < 0
#define BLOCKATTN_HALF_ROWS_512 (BLOCKATTN_HOST_DISPATCH_AVX512 != 0)
#define BLOCKATTN_HALF_ROWS_256 1
#define BLOCKATTN_HALF_TARGET_512 BLOCKATTN_TARGET_AVX512
#define BLOCKATTN_HALF_TARGET_256 __attribute__((target("avx2,fma,f16c")))
#else
#define BLOCKATTN_HALF_ROWS_512 (BLOCKATTN_HALF_ROWS == 512)
#define BLOCKATTN_HALF_ROWS_256 (BLOCKATTN_HALF_ROWS == 256)
#define BLOCKATTN_HALF_TARGET_512
#define BLOCKATTN_HALF_TARGET_256
#endif

namespace blockattn {
namespace impl {

/// Whether widen_fp16_row / narrow_fp16_row run vector instructions here
/// (512, 256), the scalar loop (0), or decide at run time (-1: dispatch).
inline constexpr int half_rows_width = BLOCKATTN_HALF_ROWS;

#if BLOCKATTN_HALF_ROWS < 0
/// The vector width the conversions run at in this process (dispatch
/// builds): 512 under the AVX-512 kernels, 256 under the AVX2 ones where the
/// CPU has F16C, else 0.
inline int half_rows_dispatched() {
  static const int width = []() noexcept {
    HostIsa isa = HostIsa::generic;
    try {
      isa = dispatched_host_isa();
    } catch (...) {
      // A bad BLOCKATTN_HOST_ISA: the kernels' own call reports it; scalar here.
    }
    if (isa == HostIsa::avx512 && BLOCKATTN_HALF_ROWS_512) return 512;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if ((isa == HostIsa::avx512 || isa == HostIsa::avx2) && __get_cpuid(1, &a, &b, &c, &d) != 0 &&
        (c & bit_F16C) != 0)
      return 256;
    return 0;
  }();
  return width;
}
#endif

#if BLOCKATTN_HALF_ROWS_512
/// widen_fp16's 16-wide part: the values [0, i) it converted, i returned.
template <bool Scaled>
BLOCKATTN_HALF_TARGET_512 inline int widen_fp16_512(float* dst, const fp16* src, int n,
                                                    float scale) {
  int i = 0;
  const __m512 f = _mm512_set1_ps(scale);
  const __m512i exp16 = _mm512_set1_epi32(0x7c00), sign16 = _mm512_set1_epi32(0x8000);
  const __m512i man16 = _mm512_set1_epi32(0x3ff), exp32 = _mm512_set1_epi32(0x7f800000);
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m512i x = _mm512_maskz_cvtepu16_epi32(0xFFFF, h);
    // inf / NaN: sign | 0x7f800000 | mantissa << 13 (fp16_to_float's rule).
    const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, exp16), exp16);
    const __m512i s = _mm512_or_si512(
        _mm512_or_si512(_mm512_maskz_slli_epi32(0xFFFF, _mm512_and_si512(x, sign16), 16), exp32),
        _mm512_maskz_slli_epi32(0xFFFF, _mm512_and_si512(x, man16), 13));
    const __m512 w =
        _mm512_mask_blend_ps(special, _mm512_maskz_cvtph_ps(0xFFFF, h), _mm512_castsi512_ps(s));
    _mm512_storeu_ps(dst + i, Scaled ? _mm512_mul_ps(f, w) : w);
  }
  return i;
}

/// narrow_fp16_row's 16-wide part: the values [0, i) it converted, i returned.
BLOCKATTN_HALF_TARGET_512 inline int narrow_fp16_512(fp16* dst, const float* src, int n,
                                                     float scale) {
  int i = 0;
  const __m512 f = _mm512_set1_ps(scale);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf32 = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet16 = _mm512_set1_epi32(0x7e00);
  for (; i + 16 <= n; i += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(src + i), f);
    const __m512i u = _mm512_castps_si512(y);
    // NaN: sign | 0x7e00 (fp16_bits' one quiet NaN), whatever the payload.
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs_mask), inf32);
    const __m512i h = _mm512_maskz_cvtepu16_epi32(
        0xFFFF, _mm512_maskz_cvtps_ph(0xFFFF, y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m512i q = _mm512_or_si512(
        _mm512_maskz_srli_epi32(0xFFFF, _mm512_maskz_andnot_epi32(0xFFFF, abs_mask, u), 16),
        quiet16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_maskz_cvtepi32_epi16(0xFFFF, _mm512_mask_blend_epi32(nan, h, q)));
  }
  return i;
}
#endif

#if BLOCKATTN_HALF_ROWS_256
/// widen_fp16's 8-wide part (F16C + AVX2).
template <bool Scaled>
BLOCKATTN_HALF_TARGET_256 inline int widen_fp16_256(float* dst, const fp16* src, int n,
                                                    float scale) {
  int i = 0;
  const __m256 f = _mm256_set1_ps(scale);
  const __m256i exp16 = _mm256_set1_epi32(0x7c00), sign16 = _mm256_set1_epi32(0x8000);
  const __m256i man16 = _mm256_set1_epi32(0x3ff), exp32 = _mm256_set1_epi32(0x7f800000);
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i x = _mm256_cvtepu16_epi32(h);
    const __m256i special = _mm256_cmpeq_epi32(_mm256_and_si256(x, exp16), exp16);
    const __m256i s =
        _mm256_or_si256(_mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(x, sign16), 16), exp32),
                        _mm256_slli_epi32(_mm256_and_si256(x, man16), 13));
    const __m256 w =
        _mm256_blendv_ps(_mm256_cvtph_ps(h), _mm256_castsi256_ps(s), _mm256_castsi256_ps(special));
    _mm256_storeu_ps(dst + i, Scaled ? _mm256_mul_ps(f, w) : w);
  }
  return i;
}

/// narrow_fp16_row's 8-wide part (F16C + AVX2).
BLOCKATTN_HALF_TARGET_256 inline int narrow_fp16_256(fp16* dst, const float* src, int n,
                                                     float scale) {
  int i = 0;
  const __m256 f = _mm256_set1_ps(scale);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf32 = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet16 = _mm256_set1_epi32(0x7e00);
  for (; i + 8 <= n; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(src + i), f);
    const __m256i u = _mm256_castps_si256(y);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf32);
    const __m256i h =
        _mm256_cvtepu16_epi32(_mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i q =
        _mm256_or_si256(_mm256_srli_epi32(_mm256_andnot_si256(abs_mask, u), 16), quiet16);
    const __m256i bits = _mm256_blendv_epi8(h, q, nan);
    // 8 x 32-bit lanes (each < 2^16) to 8 x 16 bits.
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), packed);
  }
  return i;
}
#endif

/// dst[i] = scale * float(src[i]) for i < n (Scaled), float(src[i]) (not):
/// bitwise the scalar expression.
template <bool Scaled>
KOKKOS_INLINE_FUNCTION void widen_fp16(float* dst, const fp16* src, int n, float scale) {
  int i = 0;
#if BLOCKATTN_HALF_ROWS == 512
  i = widen_fp16_512<Scaled>(dst, src, n, scale);
#elif BLOCKATTN_HALF_ROWS == 256
  i = widen_fp16_256<Scaled>(dst, src, n, scale);
#elif BLOCKATTN_HALF_ROWS < 0
  const int width = half_rows_dispatched();
#if BLOCKATTN_HALF_ROWS_512
  if (width == 512) i = widen_fp16_512<Scaled>(dst, src, n, scale);
#endif
  if (width == 256) i = widen_fp16_256<Scaled>(dst, src, n, scale);
#endif
  for (; i < n; ++i) dst[i] = Scaled ? scale * float(src[i]) : float(src[i]);
}

/// dst[i] = scale * float(src[i]) for i < n.
KOKKOS_INLINE_FUNCTION void widen_fp16_row(float* dst, const fp16* src, int n, float scale) {
  widen_fp16<true>(dst, src, n, scale);
}

/// dst[i] = float(src[i]) for i < n (signalling NaNs stay signalling).
KOKKOS_INLINE_FUNCTION void widen_fp16_row(float* dst, const fp16* src, int n) {
  widen_fp16<false>(dst, src, n, 1.0f);
}

/// dst[i] = fp16(src[i] * scale) for i < n: bitwise the scalar expression.
KOKKOS_INLINE_FUNCTION void narrow_fp16_row(fp16* dst, const float* src, int n, float scale) {
  int i = 0;
#if BLOCKATTN_HALF_ROWS == 512
  i = narrow_fp16_512(dst, src, n, scale);
#elif BLOCKATTN_HALF_ROWS == 256
  i = narrow_fp16_256(dst, src, n, scale);
#elif BLOCKATTN_HALF_ROWS < 0
  const int width = half_rows_dispatched();
#if BLOCKATTN_HALF_ROWS_512
  if (width == 512) i = narrow_fp16_512(dst, src, n, scale);
#endif
  if (width == 256) i = narrow_fp16_256(dst, src, n, scale);
#endif
  for (; i < n; ++i) dst[i] = fp16(src[i] * scale);
}

/// dst[d * stride] = S(src[d] * scale) for d < n: fp16 rows of unit stride
/// by narrow_fp16_row, everything else as that scalar expression.
template <class S, class T>
KOKKOS_INLINE_FUNCTION void store_scaled_row(S* dst, std::ptrdiff_t stride, const T* src, int n,
                                             T scale) {
  if constexpr (std::is_same<S, fp16>::value && std::is_same<T, float>::value) {
    if (stride == 1) return narrow_fp16_row(dst, src, n, scale);
  }
  if (stride == 1)  // the unit-stride loop apart: it vectorises
    for (int d = 0; d < n; ++d) dst[d] = S(src[d] * scale);
  else
    for (int d = 0; d < n; ++d) dst[d * stride] = S(src[d] * scale);
}

/// dst[d] = T(src[d * stride]) for d < n: fp16 rows of unit stride by
/// widen_fp16_row, everything else as that scalar expression.
template <class T, class S>
KOKKOS_INLINE_FUNCTION void load_row(T* dst, const S* src, std::ptrdiff_t stride, int n) {
  if constexpr (std::is_same<S, fp16>::value && std::is_same<T, float>::value) {
    if (stride == 1) return widen_fp16_row(dst, src, n);
  }
  if (stride == 1)
    for (int d = 0; d < n; ++d) dst[d] = T(src[d]);
  else
    for (int d = 0; d < n; ++d) dst[d] = T(src[d * stride]);
}

/// Whether load_row / store_scaled_row convert S <-> T in vectors here.
template <class T, class S>
inline constexpr bool vector_half_rows_v =
    half_rows_width != 0 && std::is_same<S, fp16>::value&& std::is_same<T, float>::value;

}  // namespace impl
}  // namespace blockattn
