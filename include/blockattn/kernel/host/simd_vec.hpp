// SPDX-License-Identifier: Apache-2.0
// The vector classes of the explicit-register host kernels: one per ISA
// (SimdVec512: AVX-512F; SimdVec256: AVX2 + FMA; SimdVec128: SSE2 and NEON
// through GNU vectors) and SimdFor<Isa>. Included by micro_gemm_simd.hpp
// only, which uses the BLOCKATTN_SIMD_* / BLOCKATTN_TARGET_* macros defined
// here and undefines them at its end.
#pragma once

#include <blockattn/core/quant.hpp>
#include <blockattn/kernel/impl/exp2.hpp>
#include <blockattn/kernel/isa.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

// Which vector classes this translation unit defines: the compile-time ISA's,
// and under run-time dispatch (isa.hpp) the 256- and 512-bit ones above it,
// their operations compiled under target attributes (BLOCKATTN_TARGET_256 /
// _512, empty where the compile-time ISA has them).
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__) || defined(__SYCL_DEVICE_ONLY__)
#define BLOCKATTN_SIMD_KERNELS 0
#else
#if defined(__AVX512F__)
#define BLOCKATTN_SIMD_512 1  // AVX-512 intrinsics
#define BLOCKATTN_TARGET_512
#elif BLOCKATTN_HOST_DISPATCH
#define BLOCKATTN_SIMD_512 1
#define BLOCKATTN_TARGET_512 BLOCKATTN_TARGET_AVX512
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define BLOCKATTN_SIMD_256 1  // AVX2 intrinsics
#define BLOCKATTN_TARGET_256
#elif BLOCKATTN_HOST_DISPATCH && !(defined(__AVX2__) && defined(__FMA__))
#define BLOCKATTN_SIMD_256 1
#define BLOCKATTN_TARGET_256 BLOCKATTN_TARGET_AVX2
#endif
#if (defined(__GNUC__) || defined(__clang__)) && !(defined(__AVX2__) && defined(__FMA__)) && \
    (defined(__SSE2__) || (defined(__aarch64__) && defined(__ARM_NEON)))
#define BLOCKATTN_SIMD_128 1  // 128-bit GNU vectors
#endif
#if defined(BLOCKATTN_SIMD_512) || defined(BLOCKATTN_SIMD_256) || defined(BLOCKATTN_SIMD_128)
#define BLOCKATTN_SIMD_KERNELS 1
#else
#define BLOCKATTN_SIMD_KERNELS 0
#endif
#endif

#if BLOCKATTN_SIMD_KERNELS
#if defined(BLOCKATTN_SIMD_512) || defined(BLOCKATTN_SIMD_256)
#include <immintrin.h>
#endif

#if defined(__clang__)
#define BLOCKATTN_HOST_UNROLL _Pragma("unroll")
#else
#define BLOCKATTN_HOST_UNROLL _Pragma("GCC unroll 16")
#endif

namespace blockattn::impl {

// The operations the kernels below use, on vectors passed by reference: the
// kernels are templates without target attributes, so under run-time dispatch
// (isa.hpp) a vector passed by value between them and these targeted
// functions would use two calling conventions if a call stayed out of line
// (at -O0, say). By reference, the code is right whatever the compiler
// inlines; inlined (the kernels run inside a flattened function of the
// vector's target) nothing of the references remains. The value operations
// of each class are for functions of its own target only.
#define BLOCKATTN_SIMD_REFERENCE_OPS(TARGET)                           \
  TARGET static void set_zero(type& x) {                               \
    x = zero();                                                        \
  }                                                                    \
  TARGET static void load_to(type& x, const float* p) {                \
    x = load(p);                                                       \
  }                                                                    \
  /* x = p[0 .. width), kept in a register (see simd_tile_product) */  \
  TARGET static void load_pinned(type& x, const float* p) {            \
    x = in_register(load(p));                                          \
  }                                                                    \
  TARGET static void store_from(float* p, const type& x) {             \
    store(p, x);                                                       \
  }                                                                    \
  TARGET static void broadcast_to(type& x, const float* p) {           \
    x = broadcast(p);                                                  \
  }                                                                    \
  TARGET static void mul_to(type& x, const type& a, const type& b) {   \
    x = mul(a, b);                                                     \
  }                                                                    \
  /* acc = a * b + acc */                                              \
  TARGET static void fma_to(type& acc, const type& a, const type& b) { \
    acc = fma(a, b, acc);                                              \
  }                                                                    \
  /* acc = x > acc ? x : acc */                                        \
  TARGET static void max_to(type& acc, const type& x) {                \
    acc = max(x, acc);                                                 \
  }                                                                    \
  /* acc = acc + x */                                                  \
  TARGET static void add_to(type& acc, const type& x) {                \
    acc = add(acc, x);                                                 \
  }                                                                    \
  /* x = a - b */                                                      \
  TARGET static void sub_to(type& x, const type& a, const type& b) {   \
    x = sub(a, b);                                                     \
  }

#if defined(BLOCKATTN_SIMD_512) || defined(BLOCKATTN_SIMD_256)
#if defined(__AVX2__) && defined(__F16C__)
#define BLOCKATTN_TARGET_WIDEN8
#define BLOCKATTN_WIDEN8_F16C 1
#elif defined(__AVX2__)
#define BLOCKATTN_TARGET_WIDEN8
#define BLOCKATTN_WIDEN8_F16C 0
#else
#define BLOCKATTN_TARGET_WIDEN8 BLOCKATTN_TARGET_AVX2
#define BLOCKATTN_WIDEN8_F16C 1  // the dispatch target has F16C (isa.hpp)
#endif
/// 8 codes of an 8-bit KV cache at p widened to fp32, exactly
/// (core/quant.hpp): int8 by sign extension; E4M3 by moving the magnitude
/// bits under fp32's exponent and scaling by 2^120, subnormals included,
/// then S.1111.111 to NaN and the sign; E5M2, fp16's upper byte, through
/// F16C's vcvtph2ps (inf and NaN included; without F16C as E4M3, by 2^112).
/// On a Sapphire Rapids (bench_decode --quant) E5M2 through fp16 ran 1.5x
/// the fp32-exponent construction; E4M3 through fp16 (its magnitude times
/// 2^8) ran 0.85x of it on AVX2: more operations than it saves.
BLOCKATTN_TARGET_WIDEN8 inline __m256 widen8_i8(const std::int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
template <int Shift, int MaxFinite>
BLOCKATTN_TARGET_WIDEN8 inline __m256 widen8_fp8(const std::uint8_t* p, float scale) {
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi32(0x7f));
  __m256 f =
      _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, Shift)), _mm256_set1_ps(scale));
  const __m256i special = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(MaxFinite));
  // E4M3: NaN (quiet); E5M2: inf with mantissa 0, else NaN.
  const __m256i bits =
      Shift == 20
          ? _mm256_set1_epi32(0x7fc00000)
          : _mm256_or_si256(_mm256_set1_epi32(0x7f800000),
                            _mm256_slli_epi32(_mm256_and_si256(mag, _mm256_set1_epi32(3)), 21));
  f = _mm256_blendv_ps(f, _mm256_castsi256_ps(bits), _mm256_castsi256_ps(special));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}
BLOCKATTN_TARGET_WIDEN8 inline __m256 widen8_e4m3(const std::uint8_t* p) {
  return widen8_fp8<20, 0x7e>(p, 1.329227995784916e36f);  // 2^120
}
BLOCKATTN_TARGET_WIDEN8 inline __m256 widen8_e5m2(const std::uint8_t* p) {
#if BLOCKATTN_WIDEN8_F16C
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
#else
  return widen8_fp8<21, 0x7b>(p, 5.192296858534828e33f);  // 2^112
#endif
}
#undef BLOCKATTN_WIDEN8_F16C
#endif

#if defined(BLOCKATTN_SIMD_512)
/// One 512-bit AVX-512 vector of floats and its operations.
struct SimdVec512 {
  using type = __m512;
  static constexpr int width = 16, registers = 32;
  static constexpr bool has_exp2 = true;
  BLOCKATTN_TARGET_512 static type zero() { return _mm512_setzero_ps(); }
  BLOCKATTN_TARGET_512 static type load(const float* p) { return _mm512_loadu_ps(p); }
  /// x, made opaque to the compiler so that it stays in a register (see
  /// simd_tile_product).
  BLOCKATTN_TARGET_512 static type in_register(type x) {
    __asm__("" : "+v"(x));
    return x;
  }
  BLOCKATTN_TARGET_512 static void store(float* p, type x) { _mm512_storeu_ps(p, x); }
  BLOCKATTN_TARGET_512 static type broadcast(const float* p) { return _mm512_set1_ps(*p); }
  BLOCKATTN_TARGET_512 static type mul(type a, type b) { return _mm512_mul_ps(a, b); }
  BLOCKATTN_TARGET_512 static type fma(type a, type b, type c) { return _mm512_fmadd_ps(a, b, c); }
  /// a > b ? a : b per lane (b when either is NaN), as the scalar expression:
  /// vmaxps' rule, which GCC keeps (operands never swapped unless
  /// -ffinite-math-only). The maskz form: _mm512_max_ps's GCC 12 header trips
  /// -Wmaybe-uninitialized through _mm512_undefined_ps.
  BLOCKATTN_TARGET_512 static type max(type a, type b) { return _mm512_maskz_max_ps(0xFFFF, a, b); }
  BLOCKATTN_TARGET_512 static type add(type a, type b) { return _mm512_add_ps(a, b); }
  BLOCKATTN_TARGET_512 static type sub(type a, type b) { return _mm512_sub_ps(a, b); }
  /// exp2_nonpositive (exp2.hpp) per lane, its arithmetic with the polynomial
  /// in FMA steps, and bitwise its result: n = round(x) as the float
  /// (x + 1.5 * 2^23) - 1.5 * 2^23 (exact for |x| < 2^22), f = x - n, and
  /// 2^n applied by vscalefps (poly * 2^n rounded once, as the scalar
  /// poly * two_n with two_n = 2^n normal for n >= -126) instead of building
  /// 2^n in the exponent field: 11 vector operations instead of 15. The
  /// zero-masking keeps exp2_nonpositive's rule (0 below -126 and for -inf,
  /// where f is NaN; NaN for a NaN x). The maskz intrinsics avoid GCC 12's
  /// _mm512_undefined_* (-Wmaybe-uninitialized).
  BLOCKATTN_TARGET_512 static type exp2_nonpositive(type x) {
    using C = Exp2fConstants;
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(C::min_arg), _CMP_NLT_UQ);
    const __m512 magic = _mm512_set1_ps(C::round_magic);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(x, magic), magic);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 poly = _mm512_fmadd_ps(f, _mm512_set1_ps(C::c6), _mm512_set1_ps(C::c5));
    poly = _mm512_fmadd_ps(f, poly, _mm512_set1_ps(C::c4));
    poly = _mm512_fmadd_ps(f, poly, _mm512_set1_ps(C::c3));
    poly = _mm512_fmadd_ps(f, poly, _mm512_set1_ps(C::c2));
    poly = _mm512_fmadd_ps(f, poly, _mm512_set1_ps(C::c1));
    poly = _mm512_fmadd_ps(f, poly, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, poly, n);
  }
  /// The largest lane (NaN-free x): halves folded onto each other, 8 lanes,
  /// 4, 2, 1 (four steps instead of fifteen dependent scalar ones).
  /// (The maskz intrinsics: see exp2_nonpositive.)
  BLOCKATTN_TARGET_512 static float reduce_max(type x) {
    constexpr __mmask16 all = 0xFFFF;
    const __m512 folded = max(x, _mm512_maskz_shuffle_f32x4(all, x, x, 0x4E));  // halves swapped
    const __m128 x4 = _mm_max_ps(_mm512_maskz_extractf32x4_ps(0xF, folded, 0),
                                 _mm512_maskz_extractf32x4_ps(0xF, folded, 1));
    const __m128 x2 = _mm_max_ps(x4, _mm_movehl_ps(x4, x4));
    return _mm_cvtss_f32(_mm_max_ss(x2, _mm_movehdup_ps(x2)));
  }
  /// The sum of the lanes in the same pairwise order: lane i + lane i + 8,
  /// then + 4, + 2, + 1.
  BLOCKATTN_TARGET_512 static float reduce_add(type x) {
    constexpr __mmask16 all = 0xFFFF;
    const __m512 folded = add(x, _mm512_maskz_shuffle_f32x4(all, x, x, 0x4E));
    const __m128 x4 = _mm_add_ps(_mm512_maskz_extractf32x4_ps(0xF, folded, 0),
                                 _mm512_maskz_extractf32x4_ps(0xF, folded, 1));
    const __m128 x2 = _mm_add_ps(x4, _mm_movehl_ps(x4, x4));
    return _mm_cvtss_f32(_mm_add_ss(x2, _mm_movehdup_ps(x2)));
  }
  BLOCKATTN_SIMD_REFERENCE_OPS(BLOCKATTN_TARGET_512)
  /// x = 16 bf16 values (raw bits) at p, widened exactly (bits << 16).
  BLOCKATTN_TARGET_512 static void load_bf16_to(type& x, const std::uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    // The maskz forms: see exp2_nonpositive.
    const __m512i w = _mm512_maskz_cvtepu16_epi32(0xFFFF, h);
    x = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, w, 16));
  }
  /// x = 16 codes of an 8-bit cache widened to fp32: two halves of 8
  /// (widen8_*, the AVX2 conversions) joined.
  BLOCKATTN_TARGET_512 static type join(__m256 lo, __m256 hi) {
    // The mask forms from zeros: see exp2_nonpositive (GCC 12's unoptimised
    // casts and inserts from 256 bits pass an undefined register).
    const __m512d z = _mm512_setzero_pd();
    const __m512d l = _mm512_mask_insertf64x4(z, 0xFF, z, _mm256_castps_pd(lo), 0);
    return _mm512_castpd_ps(_mm512_mask_insertf64x4(l, 0xFF, l, _mm256_castps_pd(hi), 1));
  }
  /// x = 16 codes of an 8-bit cache widened to fp32, exactly: widen8_*'s
  /// arithmetic on 16 lanes (vcvtph2ps of 16 halves is AVX-512F; the maskz
  /// forms: GCC 12's unmasked ones trip -Wmaybe-uninitialized, see max).
  BLOCKATTN_TARGET_512 static __m256i codes16(const void* p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  BLOCKATTN_TARGET_512 static void load_codes_to(type& x, const std::int8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    x = _mm512_maskz_cvtepi32_ps(0xFFFF, _mm512_maskz_cvtepi8_epi32(0xFFFF, b));
  }
  BLOCKATTN_TARGET_512 static void load_codes_to(type& x, const fp8_e4m3* p) {
    // widen8_fp8's construction on 16 lanes; the sign by one ternary-logic
    // operation (f | (w << 24 & 2^31)).
    const __m512i w =
        _mm512_maskz_cvtepu8_epi32(0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi32(0x7f));
    const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, mag, 20)),
                                   _mm512_set1_ps(1.329227995784916e36f));  // 2^120
    const __m512 g = _mm512_mask_mov_ps(f, _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7e)),
                                        _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
    x = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(g),
                                                      _mm512_maskz_slli_epi32(0xFFFF, w, 24),
                                                      _mm512_set1_epi32(int(0x80000000u)), 0xF8));
  }
  BLOCKATTN_TARGET_512 static void load_codes_to(type& x, const fp8_e5m2* p) {
    x = _mm512_maskz_cvtph_ps(0xFFFF, _mm256_slli_epi16(codes16(p), 8));
  }
  /// out[j] = the sum of x[j]'s lanes for j < 16, the 16 sums by a tree of
  /// two-source permutes (lane_pair_sum), in reduce_add's pairwise order:
  /// 15 adds and 30 permutes for 16 horizontal sums (the decode kernel's
  /// dot products, host/decode_simd.hpp).
  BLOCKATTN_TARGET_512 static void lane_sums_to(float* out, const type (&x)[16]) {
    type y[8], z[4];
    for (int i = 0; i < 8; ++i) y[i] = lane_pair_sum<8>(x[2 * i], x[2 * i + 1]);
    for (int i = 0; i < 4; ++i) z[i] = lane_pair_sum<4>(y[2 * i], y[2 * i + 1]);
    const type w0 = lane_pair_sum<2>(z[0], z[1]), w1 = lane_pair_sum<2>(z[2], z[3]);
    store(out, lane_pair_sum<1>(w0, w1));
  }
  /// Lanes of x and y in segments of 2B: the first 8 lanes of the result are
  /// x's segments folded (lane t of a segment + lane t + B), the last 8 y's.
  /// Applied with B = 8, 4, 2, 1 to 16 vectors, lane j of the last one is the
  /// sum of vector j's lanes.
  template <int B>
  BLOCKATTN_TARGET_512 static type lane_pair_sum(type x, type y) {
    alignas(64) static constexpr int lo[16] = {
#define BLOCKATTN_LANE(o) ((o) < 8 ? 0 : 16) + ((o) % 8) / B * 2 * B + (o) % B
        BLOCKATTN_LANE(0),  BLOCKATTN_LANE(1),  BLOCKATTN_LANE(2),  BLOCKATTN_LANE(3),
        BLOCKATTN_LANE(4),  BLOCKATTN_LANE(5),  BLOCKATTN_LANE(6),  BLOCKATTN_LANE(7),
        BLOCKATTN_LANE(8),  BLOCKATTN_LANE(9),  BLOCKATTN_LANE(10), BLOCKATTN_LANE(11),
        BLOCKATTN_LANE(12), BLOCKATTN_LANE(13), BLOCKATTN_LANE(14), BLOCKATTN_LANE(15)};
#undef BLOCKATTN_LANE
    const __m512i l = _mm512_load_si512(lo);
    const __m512i h = _mm512_add_epi32(l, _mm512_set1_epi32(B));
    return add(_mm512_permutex2var_ps(x, l, y), _mm512_permutex2var_ps(x, h, y));
  }
  /// p = exp2_nonpositive(s[0 .. width) * s2 - l2) (one rounding for the
  /// product and difference), ds = p * (dp[0 .. width) - d): the backward's
  /// P and dS of a row (see simd_p_ds_row).
  BLOCKATTN_TARGET_512 static void p_ds_to(type& p, type& ds, const float* s, const float* dp,
                                           const type& s2, const type& l2, const type& d) {
    p = exp2_nonpositive(_mm512_fmsub_ps(load(s), s2, l2));
    ds = mul(p, sub(load(dp), d));
  }
  BLOCKATTN_TARGET_512 static void reduce_max_to(float& out, const type& x) {
    out = reduce_max(x);
  }
  BLOCKATTN_TARGET_512 static void reduce_add_to(float& out, const type& x) {
    out = reduce_add(x);
  }
  /// p = exp2_nonpositive(s[0 .. width) - m)
  BLOCKATTN_TARGET_512 static void exp2_sub_to(type& p, const float* s, const type& m) {
    p = exp2_nonpositive(sub(load(s), m));
  }
};
#endif
#if defined(BLOCKATTN_SIMD_256)
/// One 256-bit AVX2 vector of floats and its operations.
struct SimdVec256 {
  using type = __m256;
  static constexpr int width = 8, registers = 16;
  static constexpr bool has_exp2 = true;
  BLOCKATTN_TARGET_256 static type zero() { return _mm256_setzero_ps(); }
  BLOCKATTN_TARGET_256 static type load(const float* p) { return _mm256_loadu_ps(p); }
  BLOCKATTN_TARGET_256 static type in_register(type x) {  // see the AVX-512 variant
    __asm__("" : "+v"(x));
    return x;
  }
  BLOCKATTN_TARGET_256 static void store(float* p, type x) { _mm256_storeu_ps(p, x); }
  BLOCKATTN_TARGET_256 static type broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  BLOCKATTN_TARGET_256 static type mul(type a, type b) { return _mm256_mul_ps(a, b); }
  BLOCKATTN_TARGET_256 static type fma(type a, type b, type c) { return _mm256_fmadd_ps(a, b, c); }
  /// a > b ? a : b per lane (b when either is NaN), as the scalar expression.
  BLOCKATTN_TARGET_256 static type max(type a, type b) { return _mm256_max_ps(a, b); }
  BLOCKATTN_TARGET_256 static type add(type a, type b) { return _mm256_add_ps(a, b); }
  BLOCKATTN_TARGET_256 static type sub(type a, type b) { return _mm256_sub_ps(a, b); }
  /// exp2_nonpositive (exp2.hpp) per lane, its arithmetic with the polynomial
  /// in FMA steps, and bitwise its result. n = round(x) as the float
  /// (x + 1.5 * 2^23) - 1.5 * 2^23 (exact for |x| < 2^22, the value the
  /// integer n converts to), and 2^n's bits from x + 1.5 * 2^23's in one
  /// integer add: (bits(x + magic) - bits(magic) + bias) << 23, the two
  /// constants folded into one (the same value modulo 2^32): 14 vector
  /// operations instead of 15 (no int -> float conversion, one integer add).
  BLOCKATTN_TARGET_256 static type exp2_nonpositive(type x) {
    using C = Exp2fConstants;
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(C::min_arg), _CMP_NLT_UQ);
    const __m256 magic = _mm256_set1_ps(C::round_magic);
    const __m256 shifted = _mm256_add_ps(x, magic);
    const __m256 f = _mm256_sub_ps(x, _mm256_sub_ps(shifted, magic));
    __m256 poly = _mm256_fmadd_ps(f, _mm256_set1_ps(C::c6), _mm256_set1_ps(C::c5));
    poly = _mm256_fmadd_ps(f, poly, _mm256_set1_ps(C::c4));
    poly = _mm256_fmadd_ps(f, poly, _mm256_set1_ps(C::c3));
    poly = _mm256_fmadd_ps(f, poly, _mm256_set1_ps(C::c2));
    poly = _mm256_fmadd_ps(f, poly, _mm256_set1_ps(C::c1));
    poly = _mm256_fmadd_ps(f, poly, _mm256_set1_ps(1.0f));
    // bias - bits(magic): two constants (folded or hoisted by the compiler).
    const __m256i offset =
        _mm256_sub_epi32(_mm256_set1_epi32(C::exponent_bias), _mm256_castps_si256(magic));
    const __m256i biased = _mm256_add_epi32(_mm256_castps_si256(shifted), offset);
    const __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(biased, C::mantissa_bits));
    return _mm256_and_ps(_mm256_mul_ps(poly, two_n), keep);
  }
  /// The largest lane (NaN-free x) and the lane sum, pairwise as the
  /// AVX-512 variant's last three steps.
  BLOCKATTN_TARGET_256 static float reduce_max(type x) {
    const __m128 x4 = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 x2 = _mm_max_ps(x4, _mm_movehl_ps(x4, x4));
    return _mm_cvtss_f32(_mm_max_ss(x2, _mm_movehdup_ps(x2)));
  }
  BLOCKATTN_TARGET_256 static float reduce_add(type x) {
    const __m128 x4 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 x2 = _mm_add_ps(x4, _mm_movehl_ps(x4, x4));
    return _mm_cvtss_f32(_mm_add_ss(x2, _mm_movehdup_ps(x2)));
  }
  BLOCKATTN_SIMD_REFERENCE_OPS(BLOCKATTN_TARGET_256)
  /// x = 8 bf16 values (raw bits) at p, widened exactly (bits << 16).
  BLOCKATTN_TARGET_256 static void load_bf16_to(type& x, const std::uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  /// x = 8 codes of an 8-bit cache widened to fp32 (widen8_*).
  BLOCKATTN_TARGET_256 static void load_codes_to(type& x, const std::int8_t* p) {
    x = widen8_i8(p);
  }
  BLOCKATTN_TARGET_256 static void load_codes_to(type& x, const fp8_e4m3* p) {
    x = widen8_e4m3(&p->bits);
  }
  BLOCKATTN_TARGET_256 static void load_codes_to(type& x, const fp8_e5m2* p) {
    x = widen8_e5m2(&p->bits);
  }
  /// out[j] = the sum of x[j]'s lanes for j < 8: horizontal adds of
  /// neighbouring lanes (two levels), then the 128-bit halves added.
  BLOCKATTN_TARGET_256 static void lane_sums_to(float* out, const type (&x)[8]) {
    const __m256 t0 = _mm256_hadd_ps(x[0], x[1]), t1 = _mm256_hadd_ps(x[2], x[3]);
    const __m256 t2 = _mm256_hadd_ps(x[4], x[5]), t3 = _mm256_hadd_ps(x[6], x[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    store(out, add(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
  }
  BLOCKATTN_TARGET_256 static void p_ds_to(type& p, type& ds, const float* s, const float* dp,
                                           const type& s2, const type& l2, const type& d) {
    p = exp2_nonpositive(_mm256_fmsub_ps(load(s), s2, l2));
    ds = mul(p, sub(load(dp), d));
  }
  BLOCKATTN_TARGET_256 static void reduce_max_to(float& out, const type& x) { out = reduce_max(x); }
  BLOCKATTN_TARGET_256 static void reduce_add_to(float& out, const type& x) { out = reduce_add(x); }
  BLOCKATTN_TARGET_256 static void exp2_sub_to(type& p, const float* s, const type& m) {
    p = exp2_nonpositive(sub(load(s), m));
  }
};
#endif
#if defined(BLOCKATTN_SIMD_128)
/// One 128-bit vector of floats (SSE2 or NEON register) as a GNU vector.
struct SimdVec128 {
  typedef float type __attribute__((vector_size(16)));
  static constexpr bool has_exp2 = false;
#if defined(__aarch64__)
  static constexpr int width = 4, registers = 32;
#else
  static constexpr int width = 4, registers = 16;
#endif
  static type zero() {
    return type{0.f, 0.f, 0.f, 0.f};
  }
  static type load(const float* p) {
    type x;
    std::memcpy(&x, p, sizeof(x));
    return x;
  }
  static void store(float* p, type x) {
    std::memcpy(p, &x, sizeof(x));
  }
  static type in_register(type x) {  // see the AVX-512 variant
    return x;
  }
  static type broadcast(const float* p) {
    const float v = *p;
    return type{v, v, v, v};
  }
  static type mul(type a, type b) {
    return a * b;
  }
  static type fma(type a, type b, type c) {
    return a * b + c;
  }
  /// a > b ? a : b per lane, as the scalar expression.
  static type max(type a, type b) {
    return a > b ? a : b;
  }
  static type add(type a, type b) {
    return a + b;
  }
  static type sub(type a, type b) {
    return a - b;
  }
  /// The largest lane (NaN-free x), pairwise as the wider variants.
  static float reduce_max(type x) {
    const float a = x[0] > x[2] ? x[0] : x[2], b = x[1] > x[3] ? x[1] : x[3];
    return a > b ? a : b;
  }
  /// x = 4 codes of an 8-bit cache widened to fp32 (dequantize, core/quant.hpp).
  template <class S>
  static void load_codes_to(type& x, const S* p) {
    float f[4];
    for (int l = 0; l < 4; ++l) f[l] = dequantize(p[l]);
    std::memcpy(&x, f, sizeof(x));
  }
  /// The lane sum, pairwise as the wider variants.
  static float reduce_add(type x) {
    return (x[0] + x[2]) + (x[1] + x[3]);
  }
  BLOCKATTN_SIMD_REFERENCE_OPS()
  /// x = 4 bf16 values (raw bits) at p, widened exactly (bits << 16).
  static void load_bf16_to(type& x, const std::uint16_t* p) {
    std::uint32_t b[4];
    for (int l = 0; l < 4; ++l) b[l] = std::uint32_t(p[l]) << 16;
    std::memcpy(&x, b, sizeof(x));
  }
  static void reduce_max_to(float& out, const type& x) {
    out = reduce_max(x);
  }
  static void reduce_add_to(float& out, const type& x) {
    out = reduce_add(x);
  }
  /// out[j] = the sum of x[j]'s lanes for j < 4.
  static void lane_sums_to(float* out, const type (&x)[4]) {
    for (int j = 0; j < 4; ++j) out[j] = reduce_add(x[j]);
  }
};
#endif

/// The vector class of a host ISA's kernels here (void: none in this
/// translation unit).
template <HostIsa Isa>
struct SimdFor {
  using type = void;
};
#if defined(BLOCKATTN_SIMD_512)
template <>
struct SimdFor<HostIsa::avx512> {
  using type = SimdVec512;
};
#endif
#if defined(BLOCKATTN_SIMD_256)
template <>
struct SimdFor<HostIsa::avx2> {
  using type = SimdVec256;
};
#endif
#if defined(BLOCKATTN_SIMD_128)
template <>
struct SimdFor<host_isa> {
  using type = SimdVec128;
};
#endif
template <HostIsa Isa>
using simd_for_t = typename SimdFor<Isa>::type;

}  // namespace blockattn::impl
#endif  // BLOCKATTN_SIMD_KERNELS
