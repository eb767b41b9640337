// SPDX-License-Identifier: Apache-2.0
// AVX2 + FMA register micro kernels (x86-64-v3): the host tile products of
// micro_gemm.hpp with explicit 256-bit intrinsics, fp32, for CPUs with 16 vector
// registers (Haswell .. Zen 4 without AVX-512, or any x86-64-v3 build).
//
// The portable loops of micro_gemm.hpp leave register allocation to the
// compiler; on AVX2 GCC 12 spills the BLIS-style 6x16 fp32 tile (12
// accumulators) and runs 10-20x slower. Here the accumulators are explicit
// __m256 values in fully unrolled loops, so they stay in registers.
// Same operation order as the portable loops (acc = fma(a, b, acc) over k),
// so results are those of the portable kernel compiled with FMA contraction.
#pragma once

#include <cstddef>
#include <type_traits>

#if !defined(__CUDA_ARCH__) && !defined(__HIP_DEVICE_COMPILE__) &&             \
    !defined(__SYCL_DEVICE_ONLY__) && defined(__AVX2__) && defined(__FMA__) && \
    !defined(__AVX512F__)
#define BLOCKATTN_AVX2_KERNELS 1
#else
#define BLOCKATTN_AVX2_KERNELS 0
#endif

#if BLOCKATTN_AVX2_KERNELS
#include <immintrin.h>

#if defined(__clang__)
#define BLOCKATTN_HOST_UNROLL _Pragma("unroll")
#else
#define BLOCKATTN_HOST_UNROLL _Pragma("GCC unroll 16")
#endif

namespace blockattn::impl {

/// One 256-bit vector of T and its operations.
template <class T>
struct Avx2Vec;
template <>
struct Avx2Vec<float> {
  using type = __m256;
  static constexpr int width = 8;
  static type zero() { return _mm256_setzero_ps(); }
  static type load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, type x) { _mm256_storeu_ps(p, x); }
  static type broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static type mul(type a, type b) { return _mm256_mul_ps(a, b); }
  static type fma(type a, type b, type c) { return _mm256_fmadd_ps(a, b, c); }
};

/// Whether an MR x NR tile of T has an AVX2 kernel: fp32 (fp64 keeps the
/// portable kernel, see tile_shape.hpp), NR whole vectors and at most 14
/// accumulators, so that the B row and the broadcast A value fit in the 16
/// registers too.
template <class T, int MR, int NR>
inline constexpr bool avx2_tile = std::is_same<T, float>::value && (NR % 8 == 0) &&
                                  (MR * (NR / 8) <= 14);

/// C (MR x NR) <- [row_scale ? diag(row_scale) C : 0] + A (MR x kdim, lda) B (kdim x NR, ldb).
template <int MR, int NR, int KD, class T>
inline void avx2_micro_gemm(int kdim, const T* __restrict__ a, int lda, const T* __restrict__ b,
                            int ldb, T* __restrict__ c, int ldc, const T* __restrict__ row_scale) {
  using V = Avx2Vec<T>;
  constexpr int NV = NR / V::width;
  typename V::type acc[MR][NV];
  if (row_scale != nullptr) {
    BLOCKATTN_HOST_UNROLL
    for (int r = 0; r < MR; ++r) {
      const typename V::type s = V::broadcast(row_scale + r);
      BLOCKATTN_HOST_UNROLL
      for (int j = 0; j < NV; ++j) acc[r][j] = V::mul(s, V::load(c + r * ldc + j * V::width));
    }
  } else {
    BLOCKATTN_HOST_UNROLL
    for (int r = 0; r < MR; ++r) {
      BLOCKATTN_HOST_UNROLL
      for (int j = 0; j < NV; ++j) acc[r][j] = V::zero();
    }
  }
  const int kend = KD > 0 ? KD : kdim;
  for (int k = 0; k < kend; ++k) {
    const T* __restrict__ brow = b + static_cast<std::ptrdiff_t>(k) * ldb;
    typename V::type bv[NV];
    BLOCKATTN_HOST_UNROLL
    for (int j = 0; j < NV; ++j) bv[j] = V::load(brow + j * V::width);
    BLOCKATTN_HOST_UNROLL
    for (int r = 0; r < MR; ++r) {
      const typename V::type ar = V::broadcast(a + r * lda + k);
      BLOCKATTN_HOST_UNROLL
      for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(ar, bv[j], acc[r][j]);
    }
  }
  BLOCKATTN_HOST_UNROLL
  for (int r = 0; r < MR; ++r) {
    BLOCKATTN_HOST_UNROLL
    for (int j = 0; j < NV; ++j) V::store(c + r * ldc + j * V::width, acc[r][j]);
  }
}

/// C (MR x NR) += A^T B with A stored (kdim x MR, lda): see micro_gemm_at.
template <int MR, int NR, int KD, class T>
inline void avx2_micro_gemm_at(int kdim, const T* __restrict__ a, int lda, const T* __restrict__ b,
                               int ldb, T* __restrict__ c, int ldc) {
  using V = Avx2Vec<T>;
  constexpr int NV = NR / V::width;
  typename V::type acc[MR][NV];
  BLOCKATTN_HOST_UNROLL
  for (int r = 0; r < MR; ++r) {
    BLOCKATTN_HOST_UNROLL
    for (int j = 0; j < NV; ++j) acc[r][j] = V::load(c + r * ldc + j * V::width);
  }
  const int kend = KD > 0 ? KD : kdim;
  for (int k = 0; k < kend; ++k) {
    const T* __restrict__ brow = b + static_cast<std::ptrdiff_t>(k) * ldb;
    const T* __restrict__ acol = a + static_cast<std::ptrdiff_t>(k) * lda;
    typename V::type bv[NV];
    BLOCKATTN_HOST_UNROLL
    for (int j = 0; j < NV; ++j) bv[j] = V::load(brow + j * V::width);
    BLOCKATTN_HOST_UNROLL
    for (int r = 0; r < MR; ++r) {
      const typename V::type ar = V::broadcast(acol + r);
      BLOCKATTN_HOST_UNROLL
      for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(ar, bv[j], acc[r][j]);
    }
  }
  BLOCKATTN_HOST_UNROLL
  for (int r = 0; r < MR; ++r) {
    BLOCKATTN_HOST_UNROLL
    for (int j = 0; j < NV; ++j) V::store(c + r * ldc + j * V::width, acc[r][j]);
  }
}

}  // namespace blockattn::impl

#undef BLOCKATTN_HOST_UNROLL
#endif  // BLOCKATTN_AVX2_KERNELS
