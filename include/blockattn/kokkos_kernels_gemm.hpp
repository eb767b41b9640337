// SPDX-License-Identifier: Apache-2.0
// Opt-in tile-product policy backed by KokkosBatched::SerialGemm (Kokkos
// Kernels). Needs Kokkos Kernels at build time; the rest of BlockAttn does not.
// The benchmark compares it with the default register-tile product (DefaultTileShape::tile_gemm).
#pragma once

#include <KokkosBatched_Gemm_Decl.hpp>
#include <KokkosBatched_Gemm_Serial_Impl.hpp>

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/tile_shape.hpp>

namespace blockattn {

struct KokkosBatchedTileGemm {
  static constexpr const char* name() { return "KokkosBatched::SerialGemm"; }

  template <int MR, int NR, int KD, class T>
  KOKKOS_FORCEINLINE_FUNCTION static void apply(int kdim, const T* a, int lda, const T* b, int ldb,
                                                T* c, int ldc, const T* row_scale) {
    using Unmanaged = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
    using In = Kokkos::View<const T**, Kokkos::LayoutStride, Kokkos::AnonymousSpace, Unmanaged>;
    using Out = Kokkos::View<T**, Kokkos::LayoutStride, Kokkos::AnonymousSpace, Unmanaged>;
    const int kd = KD > 0 ? KD : kdim;
    In av(a, Kokkos::LayoutStride(MR, lda, kd, 1));
    In bv(b, Kokkos::LayoutStride(kd, ldb, NR, 1));
    Out cv(c, Kokkos::LayoutStride(MR, ldc, NR, 1));
    if (row_scale != nullptr)
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NR; ++j) c[r * ldc + j] *= row_scale[r];
    KokkosBatched::SerialGemm<KokkosBatched::Trans::NoTranspose, KokkosBatched::Trans::NoTranspose,
                              KokkosBatched::Algo::Gemm::Blocked>::invoke(T(1), av, bv,
                                                                          row_scale ? T(1) : T(0),
                                                                          cv);
  }
};

/// DefaultTileShape with the KokkosBatched tile product.
template <class T, bool HostSpace, int HeadDim = 0>
struct KokkosBatchedTileShape : DefaultTileShape<T, HostSpace, HeadDim> {
  using tile_gemm = KokkosBatchedTileGemm;
  template <int D>
  using for_head_dim = KokkosBatchedTileShape<T, HostSpace, D>;
};

}  // namespace blockattn
