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

#include <blockattn/kernel/host/simd_vec.hpp>

#if BLOCKATTN_SIMD_KERNELS
namespace blockattn::impl {

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
#undef BLOCKATTN_TARGET_WIDEN8

#if defined(__NVCC__)
#pragma nv_diagnostic pop
#endif
