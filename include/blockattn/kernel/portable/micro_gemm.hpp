// SPDX-License-Identifier: Apache-2.0
// The innermost layer: one register micro tile of C = alpha_r * C + A * B on
// raw pointers and leading dimensions, templated only on sizes and value type.
#pragma once

// nvcc warns on GCC's unroll pragma (its host pass hands it to GCC, which
// honours it): silenced for this header only.
#if defined(__NVCC__)
#pragma nv_diagnostic push
#pragma nv_diag_suppress 1675
#endif

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/host/micro_gemm_simd.hpp>
#include <blockattn/kernel/isa.hpp>
#include <blockattn/kernel/tile_shape.hpp>

#include <cstddef>

namespace blockattn::impl {

/// C (MR x NR, ldc) <- [row_scale ? diag(row_scale) * C : 0] + A (MR x kdim, lda) * B (kdim x NR,
/// ldb)
///
/// All loops have compile-time trip counts except the reduction (KD == 0 means
/// "kdim at run time"), so host compilers keep `acc` in vector registers and
/// device compilers in scalar registers. Isa picks the host's explicit kernel
/// (micro_gemm_simd.hpp), where it has one for the tile.
template <int MR, int NR, int KD, HostIsa Isa = host_isa, class T>
KOKKOS_FORCEINLINE_FUNCTION void micro_gemm(int kdim, const T* __restrict__ a, int lda,
                                            const T* __restrict__ b, int ldb, T* __restrict__ c,
                                            int ldc, const T* __restrict__ row_scale) {
#if BLOCKATTN_SIMD_KERNELS
  if constexpr (simd_tile<Isa, T, MR, NR>) {
    simd_micro_gemm<simd_for_t<Isa>, MR, NR, KD>(kdim, a, lda, b, ldb, c, ldc, row_scale);
    return;
  }
#endif
  T acc[MR][NR];
  if (row_scale != nullptr) {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = row_scale[r] * c[r * ldc + j];
  } else {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = T(0);
  }
  const int kend = KD > 0 ? KD : kdim;
  for (int k = 0; k < kend; ++k) {
    const T* __restrict__ brow = b + static_cast<std::ptrdiff_t>(k) * ldb;
    BLOCKATTN_UNROLL
    for (int r = 0; r < MR; ++r) {
      const T ar = a[r * lda + k];
      for (int j = 0; j < NR; ++j) acc[r][j] += ar * brow[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) c[r * ldc + j] = acc[r][j];
}

/// C (MR x NR, ldc) <- [row_scale ? diag(row_scale) C : C] + A^T (MR x kdim) * B (kdim x NR, ldb),
/// with A stored as (kdim x MR, lda): the products P^T dO and dS^T Q of the
/// backward, where P and dS sit in scratch with queries as rows. Accumulates
/// into C (beta = 1) unless row_scale is given.
template <int MR, int NR, int KD, HostIsa Isa = host_isa, class T>
KOKKOS_FORCEINLINE_FUNCTION void micro_gemm_at(int kdim, const T* __restrict__ a, int lda,
                                               const T* __restrict__ b, int ldb, T* __restrict__ c,
                                               int ldc) {
#if BLOCKATTN_SIMD_KERNELS
  if constexpr (simd_tile<Isa, T, MR, NR>) {
    simd_micro_gemm_at<simd_for_t<Isa>, MR, NR, KD>(kdim, a, lda, b, ldb, c, ldc);
    return;
  }
#endif
  T acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = c[r * ldc + j];
  const int kend = KD > 0 ? KD : kdim;
  for (int k = 0; k < kend; ++k) {
    const T* __restrict__ brow = b + static_cast<std::ptrdiff_t>(k) * ldb;
    const T* __restrict__ acol = a + static_cast<std::ptrdiff_t>(k) * lda;
    BLOCKATTN_UNROLL
    for (int r = 0; r < MR; ++r) {
      const T ar = acol[r];
      for (int j = 0; j < NR; ++j) acc[r][j] += ar * brow[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) c[r * ldc + j] = acc[r][j];
}

/// The default tile-product policy: the register micro kernel above, for the
/// host ISA Isa. A tile shape names its policy as `using tile_gemm = ...;`
/// (see tile_shape.hpp); blockattn/kokkos_kernels_gemm.hpp provides one
/// backed by KokkosBatched.
template <HostIsa Isa>
struct RegisterTileGemmFor {
  static constexpr const char* name() { return "register"; }
  template <int MR, int NR, int KD, class T>
  KOKKOS_FORCEINLINE_FUNCTION static void apply(int kdim, const T* a, int lda, const T* b, int ldb,
                                                T* c, int ldc, const T* row_scale) {
    micro_gemm<MR, NR, KD, Isa>(kdim, a, lda, b, ldb, c, ldc, row_scale);
  }
};

}  // namespace blockattn::impl

#if defined(__NVCC__)
#pragma nv_diagnostic pop
#endif
