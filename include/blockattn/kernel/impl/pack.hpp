// SPDX-License-Identifier: Apache-2.0
// Packing of a key/value block into the layout the tile kernel streams.
#pragma once

#include <blockattn/core/config.hpp>

namespace blockattn::impl {

/// K and V of one block in kernel layout, zero padded:
///   kt (batch, kv_head, key_tile, head_dim_padded, block_k)  K^T, one contiguous
///                                                            (dim x block_k) panel per tile
///   v  (batch, kv_head, keys_padded, head_dim_padded)        V, head dim contiguous
/// so that the micro kernels stream each tile's panel from consecutive memory
/// (a K^T with the whole sequence as leading dimension put rows 16 KiB apart
/// and halved the micro kernel's rate through cache-set conflicts). keys_padded
/// is a multiple of block_k and head_dim_padded of the micro tile width, so the
/// micro kernels never test bounds and padded rows and columns add 0.
template <class T, class MemorySpace>
struct PackedKV {
  using kt_view = Kokkos::View<T*****, Kokkos::LayoutRight, MemorySpace>;
  using v_view = Kokkos::View<T****, Kokkos::LayoutRight, MemorySpace>;
  kt_view kt;
  v_view v;
  int keys = 0;  // valid keys (the rest is padding)
};

template <class T, class MemorySpace>
PackedKV<T, MemorySpace> allocate_packed_kv(int batch, int kv_heads, int keys, int dim_padded,
                                            int block_k) {
  using P = PackedKV<T, MemorySpace>;
  const int tiles = (keys + block_k - 1) / block_k;
  P p;
  p.kt =
      typename P::kt_view(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::packed_kt"),
                          batch, kv_heads, tiles, dim_padded, block_k);
  p.v = typename P::v_view(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::packed_v"),
                           batch, kv_heads, tiles * block_k, dim_padded);
  p.keys = keys;
  return p;
}

/// Fills `p` from user views k, v of shape (batch, keys, kv_heads, dim), any layout.
template <class ExecSpace, class T, class MemorySpace, class KView, class VView>
void pack_kv(const ExecSpace& exec, const KView& k, const VView& v,
             const PackedKV<T, MemorySpace>& p) {
  const int batch = static_cast<int>(p.kt.extent(0));
  const int heads = static_cast<int>(p.kt.extent(1));
  const int dim_padded = static_cast<int>(p.kt.extent(3));
  const int block_k = static_cast<int>(p.kt.extent(4));
  const int keys_padded = static_cast<int>(p.v.extent(2));
  const int dim = static_cast<int>(k.extent(3));
  const int keys = p.keys;
  auto kt = p.kt;
  auto vp = p.v;
  const std::int64_t rows = std::int64_t(batch) * heads * keys_padded;
  Kokkos::parallel_for(
      "blockattn::pack_kv",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, rows),

      KOKKOS_LAMBDA(const std::int64_t row) {
        const int n = static_cast<int>(row % keys_padded);
        const int h = static_cast<int>((row / keys_padded) % heads);
        const int b = static_cast<int>(row / (std::int64_t(keys_padded) * heads));
        for (int d = 0; d < dim_padded; ++d) {
          const bool inside = n < keys && d < dim;
          kt(b, h, n / block_k, d, n % block_k) = inside ? T(k(b, n, h, d)) : T(0);
          vp(b, h, n, d) = inside ? T(v(b, n, h, d)) : T(0);
        }
      });
}

/// The kernels' packed block (compute type T) from a packed block in storage
/// type S (bf16 / fp16: what travels on a ring), widened exactly; same layout.
template <class ExecSpace, class T, class S, class MemorySpace>
void widen_kv(const ExecSpace& exec, const PackedKV<S, MemorySpace>& from,
              const PackedKV<T, MemorySpace>& to) {
  const std::int64_t nk = std::int64_t(from.kt.span()), nv = std::int64_t(from.v.span());
  const S *fk = from.kt.data(), *fv = from.v.data();
  T *tk = to.kt.data(), *tv = to.v.data();
  Kokkos::parallel_for(
      "blockattn::widen_kv",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, nk > nv ? nk : nv),
      KOKKOS_LAMBDA(const std::int64_t i) {
        if (i < nk) tk[i] = T(fk[i]);
        if (i < nv) tv[i] = T(fv[i]);
      });
}

}  // namespace blockattn::impl
