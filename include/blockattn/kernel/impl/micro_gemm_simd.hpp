// SPDX-License-Identifier: Apache-2.0
// Explicit-register host micro kernels, fp32: the tile products of
// micro_gemm.hpp with the accumulators held as vector values in fully
// unrolled loops, so that they stay in registers.
//   AVX-512F (x86-64-v4): 512-bit intrinsics, 32 registers (SimdVec512);
//   AVX2 + FMA (x86-64-v3, no AVX-512): 256-bit intrinsics, 16 registers
//   (SimdVec256);
//   SSE2 (x86-64 baseline, AVX without AVX2) and AArch64 NEON: 128-bit GNU
//   vectors (GCC, Clang), 16 / 32 registers (SimdVec128).
// The kernels are templates on the vector class (SimdFor<Isa>): the
// compile-time ISA's, and under run-time dispatch (isa.hpp) the 256- and
// 512-bit ones compiled under target attributes.
//
// The portable loops of micro_gemm.hpp leave register allocation to the
// compiler; GCC 12 spills the BLIS-style 6x16 fp32 tile on AVX2 (12
// accumulators) and runs it 10-20x slower, and the default 4x64 tile is 64
// 128-bit accumulators. Same operation order as the portable loops
// (acc = a * b + acc over k, fused where the target has FMA).
#pragma once

// nvcc warns on GCC's unroll pragma (its host pass hands it to GCC, which
// honours it): silenced for this header only.
#if defined(__NVCC__)
#pragma nv_diagnostic push
#pragma nv_diag_suppress 1675
#endif

#include <blockattn/kernel/impl/exp2.hpp>
#include <blockattn/kernel/isa.hpp>

#include <cstddef>
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
  }

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
  /// acc = acc + x
  BLOCKATTN_TARGET_512 static void add_to(type& acc, const type& x) { acc = add(acc, x); }
  /// p = exp2_nonpositive(s[0 .. width) * s2 - l2) (one rounding for the
  /// product and difference), ds = p * (dp[0 .. width) - d): the backward's
  /// P and dS of a row (see simd_p_ds_row).
  BLOCKATTN_TARGET_512 static void p_ds_to(type& p, type& ds, const float* s, const float* dp,
                                           const type& s2, const type& l2, const type& d) {
    p = exp2_nonpositive(_mm512_fmsub_ps(load(s), s2, l2));
    ds = mul(p, sub(load(dp), d));
  }
  BLOCKATTN_TARGET_512 static void reduce_max_to(float& out, const type& x) { out = reduce_max(x); }
  BLOCKATTN_TARGET_512 static void reduce_add_to(float& out, const type& x) { out = reduce_add(x); }
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
  BLOCKATTN_TARGET_256 static void add_to(type& acc, const type& x) { acc = add(acc, x); }
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
  /// The largest lane (NaN-free x), pairwise as the wider variants.
  static float reduce_max(type x) {
    const float a = x[0] > x[2] ? x[0] : x[2], b = x[1] > x[3] ? x[1] : x[3];
    return a > b ? a : b;
  }
  BLOCKATTN_SIMD_REFERENCE_OPS()
  static void reduce_max_to(float& out, const type& x) {
    out = reduce_max(x);
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

template <class V, class T, int MR, int NR>
constexpr bool simd_tile_fits() {
  if constexpr (std::is_void<V>::value) {
    return false;
  } else {
    return std::is_same<T, float>::value && (NR % V::width == 0) &&
           (MR * (NR / V::width) + NR / V::width + 1 <= V::registers);
  }
}

/// Whether an MR x NR tile of T has an explicit kernel for Isa: fp32 (fp64
/// keeps the portable kernel, see tile_shape.hpp), NR whole vectors, and the
/// accumulators, one B row and the broadcast A value fit in the registers.
template <HostIsa Isa, class T, int MR, int NR>
inline constexpr bool simd_tile = simd_tile_fits<simd_for_t<Isa>, T, MR, NR>();

/// Whether Isa's row passes (simd_lane_max, and simd_exp2_row where the vector
/// class has an exp2) run in explicit vectors of `lanes` floats.
template <HostIsa Isa, class T, int Lanes>
constexpr bool simd_rows() {
  using V = simd_for_t<Isa>;
  if constexpr (std::is_void<V>::value) {
    return false;
  } else {
    return std::is_same<T, float>::value && Lanes % V::width == 0;
  }
}
template <HostIsa Isa, class T, int Lanes>
constexpr bool simd_exp2_rows() {
  if constexpr (simd_rows<Isa, T, Lanes>()) {
    return simd_for_t<Isa>::has_exp2;
  } else {
    return false;
  }
}

/// The one kernel: C (MR x NR) <- init + A B with A(r, k) = a[r * a_row + k * a_k],
/// init = C (LoadC), diag(row_scale) C (row_scale), or 0.
template <class V, int MR, int NR, int KD, bool LoadC>
inline void simd_tile_product(int kdim, const float* __restrict__ a, int a_row, int a_k,
                              const float* __restrict__ b, int ldb, float* __restrict__ c, int ldc,
                              const float* __restrict__ row_scale) {
  constexpr int NV = NR / V::width;
  typename V::type acc[MR][NV];
  if (LoadC) {
    BLOCKATTN_HOST_UNROLL
    for (int r = 0; r < MR; ++r) {
      BLOCKATTN_HOST_UNROLL
      for (int j = 0; j < NV; ++j) V::load_to(acc[r][j], c + r * ldc + j * V::width);
    }
  } else if (row_scale != nullptr) {
    BLOCKATTN_HOST_UNROLL
    for (int r = 0; r < MR; ++r) {
      typename V::type sr;
      V::broadcast_to(sr, row_scale + r);
      BLOCKATTN_HOST_UNROLL
      for (int j = 0; j < NV; ++j) {
        typename V::type cv;
        V::load_to(cv, c + r * ldc + j * V::width);
        V::mul_to(acc[r][j], sr, cv);
      }
    }
  } else {
    BLOCKATTN_HOST_UNROLL
    for (int r = 0; r < MR; ++r) {
      BLOCKATTN_HOST_UNROLL
      for (int j = 0; j < NV; ++j) V::set_zero(acc[r][j]);
    }
  }
  const int kend = KD > 0 ? KD : kdim;
  for (int k = 0; k < kend; ++k) {
    const float* __restrict__ brow = b + static_cast<std::ptrdiff_t>(k) * ldb;
    const float* __restrict__ ak = a + static_cast<std::ptrdiff_t>(k) * a_k;
    // B's row is loaded once per k into registers: left alone, GCC 12 folds
    // the loads into the FMAs as memory operands, once per row of the tile
    // (MR * NV loads per k instead of NV), which made the backward's 4x64
    // AVX-512 tiles load-bound (pinned: backward +19-29 % on Zen 4). A no-op
    // for the 128-bit vectors (SSE2 cannot fold unaligned loads, NEON has no
    // memory operands).
    typename V::type bv[NV];
    BLOCKATTN_HOST_UNROLL
    for (int j = 0; j < NV; ++j) V::load_pinned(bv[j], brow + j * V::width);
    BLOCKATTN_HOST_UNROLL
    for (int r = 0; r < MR; ++r) {
      typename V::type ar;
      V::broadcast_to(ar, ak + r * a_row);
      BLOCKATTN_HOST_UNROLL
      for (int j = 0; j < NV; ++j) V::fma_to(acc[r][j], ar, bv[j]);
    }
  }
  BLOCKATTN_HOST_UNROLL
  for (int r = 0; r < MR; ++r) {
    BLOCKATTN_HOST_UNROLL
    for (int j = 0; j < NV; ++j) V::store_from(c + r * ldc + j * V::width, acc[r][j]);
  }
}

/// C (MR x NR) <- [row_scale ? diag(row_scale) C : 0] + A (MR x kdim, lda) B (kdim x NR, ldb).
template <class V, int MR, int NR, int KD>
inline void simd_micro_gemm(int kdim, const float* a, int lda, const float* b, int ldb, float* c,
                            int ldc, const float* row_scale) {
  simd_tile_product<V, MR, NR, KD, false>(kdim, a, lda, 1, b, ldb, c, ldc, row_scale);
}

/// C (MR x NR) += A^T B with A stored (kdim x MR, lda): see micro_gemm_at.
template <class V, int MR, int NR, int KD>
inline void simd_micro_gemm_at(int kdim, const float* a, int lda, const float* b, int ldb, float* c,
                               int ldc) {
  simd_tile_product<V, MR, NR, KD, true>(kdim, a, 1, lda, b, ldb, c, ldc, nullptr);
}

/// max(m, max_c s[c]) over c < n, a NaN s[c] skipped (each step
/// `s[c] > acc ? s[c] : acc`, as the scalar loop; m is never NaN): the row-max
/// pass of the forward softmax, which GCC 12 leaves scalar. Lanes independent
/// maxima, then one in-register reduction (reduce_max): the order does not
/// matter for a maximum of NaN-free values.
///
/// R rows at a time (row r at s + r * ld, its start value m[r], its maximum
/// into out[r]): each row's arithmetic is the one-row pass's, the R rows'
/// dependent max chains interleaved (with 16-float lanes, one AVX-512 vector
/// per row and step: one row alone is a chain of n / 16 dependent maxima).
template <class V, int Lanes, int R>
inline void simd_row_max_group(const float* __restrict__ s, int ld, int n,
                               const float* __restrict__ m, float* __restrict__ out) {
  static_assert(Lanes % V::width == 0, "simd_row_max: Lanes must be whole vectors");
  constexpr int NV = Lanes / V::width;
  typename V::type acc[R][NV];
  BLOCKATTN_HOST_UNROLL
  for (int r = 0; r < R; ++r) {
    BLOCKATTN_HOST_UNROLL
    for (int j = 0; j < NV; ++j) V::broadcast_to(acc[r][j], m + r);
  }
  for (int c = 0; c < n; c += Lanes) {
    BLOCKATTN_HOST_UNROLL
    for (int r = 0; r < R; ++r) {
      BLOCKATTN_HOST_UNROLL
      for (int j = 0; j < NV; ++j) {
        typename V::type x;
        V::load_to(x, s + static_cast<std::ptrdiff_t>(r) * ld + c + j * V::width);
        V::max_to(acc[r][j], x);
      }
    }
  }
  BLOCKATTN_HOST_UNROLL
  for (int r = 0; r < R; ++r) {
    BLOCKATTN_HOST_UNROLL
    for (int j = 1; j < NV; ++j) V::max_to(acc[r][0], acc[r][j]);
    V::reduce_max_to(out[r], acc[r][0]);
  }
}

/// One row of simd_row_max_group.
template <class V, int Lanes>
inline float simd_row_max(const float* __restrict__ s, int n, float m) {
  float row_max;
  simd_row_max_group<V, Lanes, 1>(s, 0, n, &m, &row_max);
  return row_max;
}

/// The forward softmax's exponent pass in explicit vectors: for c < n,
///   s[c] <- exp2_nonpositive(s[c] - m),
/// returning the sum of the new s[c]: Lanes partial sums (element c into
/// c % Lanes), then added in registers (reduce_add's pairwise order) instead
/// of one dependent scalar add per lane. NaN when any s[c] is NaN.
/// GCC vectorises the scalar loop too, but at 256 bits on Intel AVX-512 CPUs
/// (-mprefer-vector-width=256), where this pass was its largest loop (+10-12 %
/// forward on Sapphire Rapids); on AVX2 it runs as fast as GCC's loop and
/// keeps the pass vectorised whatever the compiler decides.
///
/// R rows at a time (row r at s + r * ld, its max m[r], its sum into
/// sum[r]), as simd_row_max_group: each row's values and sum bitwise the
/// one-row pass's, the rows' sum chains interleaved.
template <class V, int Lanes, int R>
inline void simd_exp2_row_group(float* __restrict__ s, int ld, int n, const float* __restrict__ m,
                                float* __restrict__ sum) {
  static_assert(Lanes % V::width == 0, "simd_exp2_row: Lanes must be whole vectors");
  constexpr int NV = Lanes / V::width;
  typename V::type mv[R];
  typename V::type acc[R][NV];
  BLOCKATTN_HOST_UNROLL
  for (int r = 0; r < R; ++r) {
    V::broadcast_to(mv[r], m + r);
    BLOCKATTN_HOST_UNROLL
    for (int j = 0; j < NV; ++j) V::set_zero(acc[r][j]);
  }
  for (int c = 0; c < n; c += Lanes) {
    BLOCKATTN_HOST_UNROLL
    for (int r = 0; r < R; ++r) {
      float* const sr = s + static_cast<std::ptrdiff_t>(r) * ld + c;
      BLOCKATTN_HOST_UNROLL
      for (int j = 0; j < NV; ++j) {
        typename V::type p;
        V::exp2_sub_to(p, sr + j * V::width, mv[r]);
        V::store_from(sr + j * V::width, p);
        V::add_to(acc[r][j], p);
      }
    }
  }
  BLOCKATTN_HOST_UNROLL
  for (int r = 0; r < R; ++r) {
    BLOCKATTN_HOST_UNROLL
    for (int j = 1; j < NV; ++j) V::add_to(acc[r][0], acc[r][j]);
    V::reduce_add_to(sum[r], acc[r][0]);
  }
}

/// One row of simd_exp2_row_group.
template <class V, int Lanes>
inline float simd_exp2_row(float* __restrict__ s, int n, float m) {
  float sum;
  simd_exp2_row_group<V, Lanes, 1>(s, 0, n, &m, &sum);
  return sum;
}

/// The backward's P and dS of one query row whose n keys (a multiple of
/// V::width) are all allowed, in explicit vectors:
///   s[c] <- p = exp2_nonpositive(s[c] * s2 - l2),  dp[c] <- p * (dp[c] - d).
/// GCC vectorises the scalar loop (the same arithmetic, the product and
/// difference contracted into one FMA), but at 256 bits on Intel AVX-512
/// CPUs (-mprefer-vector-width=256), as it did the forward's exponent pass
/// (simd_exp2_row).
template <class V>
inline void simd_p_ds_row(float* __restrict__ s, float* __restrict__ dp, int n, float s2, float l2,
                          float d) {
  typename V::type s2v, l2v, dv;
  V::broadcast_to(s2v, &s2);
  V::broadcast_to(l2v, &l2);
  V::broadcast_to(dv, &d);
  for (int c = 0; c < n; c += V::width) {
    typename V::type p, ds;
    V::p_ds_to(p, ds, s + c, dp + c, s2v, l2v, dv);
    V::store_from(s + c, p);
    V::store_from(dp + c, ds);
  }
}

}  // namespace blockattn::impl

#undef BLOCKATTN_HOST_UNROLL
#undef BLOCKATTN_SIMD_REFERENCE_OPS
#endif  // BLOCKATTN_SIMD_KERNELS
#undef BLOCKATTN_SIMD_128
#undef BLOCKATTN_SIMD_256
#undef BLOCKATTN_SIMD_512
#undef BLOCKATTN_TARGET_256
#undef BLOCKATTN_TARGET_512

#if defined(__NVCC__)
#pragma nv_diagnostic pop
#endif
