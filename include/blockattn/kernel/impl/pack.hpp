// SPDX-License-Identifier: Apache-2.0
// Packing of a key/value block into the layout the tile kernel streams.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/buffer_cache.hpp>
#include <blockattn/kernel/impl/half_rows.hpp>
#include <blockattn/kernel/impl/prefetch.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace blockattn::impl {

/// K and V of one block in kernel layout, zero padded:
///   kt (batch, kv_head, key_tile, head_dim_padded, block_k)  K^T, one contiguous
///                                                            (dim x block_k) span per tile
///   v  (batch, kv_head, keys_padded, head_dim_padded)        V, one contiguous
///                                                            (block_k x dim) span per tile
/// Inside a tile's span, K^T is stored in panels of `panel` keys: panel p
/// holds keys [p panel, (p + 1) panel) as a row-major (dim x panel) matrix
/// (kt_tile_offset); V in panels of `v_panel` head-dim columns: panel p holds
/// columns [p v_panel, (p + 1) v_panel) as a row-major (block_k x v_panel)
/// matrix (v_tile_offset). The forward kernel's widths are ForwardPanels: on
/// host spaces the micro tile's width, so that one micro tile streams its B
/// operand from consecutive memory; on devices the whole tile (one panel).
/// (A K^T with the whole sequence as leading dimension put rows 16 KiB apart
/// and halved the micro kernel's rate through cache-set conflicts; rows of
/// one tile, 512 B apart, still mapped a micro tile's dim x 64 B onto an
/// eighth of L1's sets.) keys_padded is a multiple of block_k and
/// head_dim_padded of the micro tile width, so the micro kernels never test
/// bounds and padded rows and columns add 0.
template <class T, class MemorySpace>
struct PackedKV {
  using kt_view = Kokkos::View<T*****, Kokkos::LayoutRight, MemorySpace>;
  using v_view = Kokkos::View<T****, Kokkos::LayoutRight, MemorySpace>;
  kt_view kt;
  v_view v;
  int keys = 0;     // valid keys (the rest is padding)
  int panel = 1;    // keys per K^T panel (kt_tile_offset)
  int v_panel = 1;  // head-dim columns per V panel (v_tile_offset)
};

/// Offset of K^T element (d, c) (head dim d, key c of the tile) from the start
/// of its tile's span: panels of `panel` keys, each (dim_padded x panel).
KOKKOS_INLINE_FUNCTION int kt_tile_offset(int d, int c, int dim_padded, int panel) {
  return (c / panel) * dim_padded * panel + d * panel + c % panel;
}

/// Offset of V element (c, d) (key c of the tile, head dim d) from the start
/// of its tile's span: panels of `v_panel` columns, each (block_k x v_panel).
KOKKOS_INLINE_FUNCTION int v_tile_offset(int c, int d, int block_k, int v_panel) {
  return (d / v_panel) * block_k * v_panel + c * v_panel + d % v_panel;
}

/// Buffers: CallBuffers to carve the block from (a single-device call), or
/// NoCallBuffers (blocks that outlive a call: the distributed drivers').
template <class T, class MemorySpace, class Buffers = NoCallBuffers>
PackedKV<T, MemorySpace> allocate_packed_kv(int batch, int kv_heads, int keys, int dim_padded,
                                            int block_k, int panel, int v_panel,
                                            Buffers* buffers = nullptr) {
  using P = PackedKV<T, MemorySpace>;
  const int tiles = (keys + block_k - 1) / block_k;
  P p;
  p.kt = allocate_view<typename P::kt_view>(buffers, "blockattn::packed_kt", batch, kv_heads, tiles,
                                            dim_padded, block_k);
  p.v = allocate_view<typename P::v_view>(buffers, "blockattn::packed_v", batch, kv_heads,
                                          tiles * block_k, dim_padded);
  p.keys = keys;
  p.panel = panel;
  p.v_panel = v_panel;
  return p;
}

/// The extents and strides both pack_kv paths read (copied into their kernels).
struct PackDims {
  int batch, heads, dim_padded, block_k, keys_padded, dim, keys, panel, v_panel;
  std::ptrdiff_t ks, vs;  // head-dim strides of k and v
};

template <class T, class MemorySpace, class KView, class VView>
PackDims pack_dims(const KView& k, const VView& v, const PackedKV<T, MemorySpace>& p) {
  return {static_cast<int>(p.kt.extent(0)),
          static_cast<int>(p.kt.extent(1)),
          static_cast<int>(p.kt.extent(3)),
          static_cast<int>(p.kt.extent(4)),
          static_cast<int>(p.v.extent(2)),
          static_cast<int>(k.extent(3)),
          p.keys,
          p.panel,
          p.v_panel,
          static_cast<std::ptrdiff_t>(k.stride(3)),
          static_cast<std::ptrdiff_t>(v.stride(3))};
}

/// Row c of a V tile (v_row = its start in panel 0): the first `live` values
/// from vrow (stride vs), zeros up to dim_padded. V panel d0 / v_panel starts
/// d0 * block_k into the tile (v_tile_offset).
template <class T, class S>
KOKKOS_FORCEINLINE_FUNCTION void pack_v_row(T* v_row, const S* vrow, std::ptrdiff_t vs, int live,
                                            const PackDims& s) {
  for (int d0 = 0; d0 < live; d0 += s.v_panel) {
    T* const dst = v_row + std::ptrdiff_t(d0) * s.block_k;
    const int w = live - d0 < s.v_panel ? live - d0 : s.v_panel;
    load_row(dst, vrow + d0 * vs, vs, w);  // fp16 rows in vectors: half_rows.hpp
  }
  for (int d = live; d < s.dim_padded; ++d)
    v_row[std::ptrdiff_t(d / s.v_panel) * s.block_k * s.v_panel + d % s.v_panel] = T(0);
}

/// pack_kv on a device: one key row per thread (adjacent threads write
/// adjacent K^T columns: coalesced).
template <class ExecSpace, class T, class MemorySpace, class KView, class VView>
void pack_kv_rows(const ExecSpace& exec, const KView& k, const VView& v,
                  const PackedKV<T, MemorySpace>& p) {
  const PackDims s = pack_dims(k, v, p);
  auto kt = p.kt;
  auto vp = p.v;
  const std::int64_t rows = std::int64_t(s.batch) * s.heads * s.keys_padded;
  // One key row per iteration, the panel offsets taken once per row (no
  // division per element) and the source row read through its stride: any
  // layout of k and v, contiguous rows the common case.
  Kokkos::parallel_for(
      "blockattn::pack_kv",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, rows),
      KOKKOS_LAMBDA(const std::int64_t row) {
        const int n = static_cast<int>(row % s.keys_padded);
        const int h = static_cast<int>((row / s.keys_padded) % s.heads);
        const int b = static_cast<int>(row / (std::int64_t(s.keys_padded) * s.heads));
        const int c = n % s.block_k;
        // Column c of the K^T tile (stride `panel` over d), row c of the V tile.
        T* const kt_col =
            &kt(b, h, n / s.block_k, 0, 0) + (c / s.panel) * s.dim_padded * s.panel + c % s.panel;
        const int live = n < s.keys ? s.dim : 0;  // padding rows: all zero
        if (live > 0) {
          const auto* const krow = &k(b, n, h, 0);
          for (int d = 0; d < live; ++d) kt_col[d * s.panel] = T(krow[d * s.ks]);
        }
        for (int d = live; d < s.dim_padded; ++d) kt_col[d * s.panel] = T(0);
        pack_v_row(&vp(b, h, n - c, 0) + c * s.v_panel, live > 0 ? &v(b, n, h, 0) : nullptr, s.vs,
                   live, s);
      });
}

/// pack_kv on the host: G consecutive keys of one panel per iteration, K^T
/// written one head-dim row of G keys at a time (G values, contiguous). One
/// key per iteration wrote its dim values dim_padded cache lines apart, each
/// to a line the other keys of the panel share: on Emerald Rapids the pack
/// was 4.0 % of a 2-thread N = 1024, D = 128 forward, 3.1 % this way (perf),
/// and the 1-thread forward gained up to 4 % at N = 512 (AVX-512 build).
template <int G, class ExecSpace, class T, class MemorySpace, class KView, class VView>
void pack_kv_groups(const ExecSpace& exec, const KView& k, const VView& v,
                    const PackedKV<T, MemorySpace>& p) {
  const PackDims s = pack_dims(k, v, p);
  const int groups = s.keys_padded / G;  // G divides panel, panel divides block_k
  auto kt = p.kt;
  auto vp = p.v;
  Kokkos::parallel_for(
      "blockattn::pack_kv",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(
          exec, 0, std::int64_t(s.batch) * s.heads * groups),
      KOKKOS_LAMBDA(const std::int64_t gi) {
        const int n0 = static_cast<int>(gi % groups) * G;
        const int h = static_cast<int>((gi / groups) % s.heads);
        const int b = static_cast<int>(gi / (std::int64_t(groups) * s.heads));
        const int c0 = n0 % s.block_k;
        T* const kt_cols = &kt(b, h, n0 / s.block_k, 0, 0) +
                           (c0 / s.panel) * s.dim_padded * s.panel + c0 % s.panel;
        const int live = s.keys - n0 < G ? (s.keys > n0 ? s.keys - n0 : 0) : G;
        using S = std::remove_cv_t<std::remove_reference_t<decltype(k(0, 0, 0, 0))>>;
        const S* krow[G];
        for (int j = 0; j < live; ++j) krow[j] = &k(b, n0 + j, h, 0);
        // The next group's K and V rows (one head's rows are heads * dim
        // apart, each on its own page: prefetch.hpp), asked for now.
        if (s.ks == 1 && s.vs == 1 && n0 + G < s.keys) {
          const int next = s.keys - (n0 + G) < G ? s.keys - (n0 + G) : G;
          for (int j = 0; j < next; ++j) {
            prefetch_span(&k(b, n0 + G + j, h, 0), sizeof(S) * s.dim);
            prefetch_span(&v(b, n0 + G + j, h, 0), sizeof(v(b, n0 + G + j, h, 0)) * s.dim);
          }
        }
        int widened = 0;  // head-dim rows of K^T already written
        if constexpr (vector_half_rows_v<T, S>) {
          // fp16: each key row widened in vectors (half_rows.hpp), 64 values
          // at a time, then written transposed.
          if (s.ks == 1 && live == G) {
            float wide[G][64];
            for (; widened < s.dim; widened += 64) {
              const int w = s.dim - widened < 64 ? s.dim - widened : 64;
              for (int j = 0; j < G; ++j) widen_fp16_row(wide[j], krow[j] + widened, w);
              for (int d = 0; d < w; ++d) {
                T* const dst = kt_cols + std::ptrdiff_t(widened + d) * s.panel;
                for (int j = 0; j < G; ++j) dst[j] = wide[j][d];
              }
            }
            widened = s.dim;
          }
        }
        for (int d = widened; d < s.dim_padded; ++d) {
          T* const dst = kt_cols + std::ptrdiff_t(d) * s.panel;
          if (d < s.dim && live == G) {
            for (int j = 0; j < G; ++j) dst[j] = T(krow[j][d * s.ks]);
          } else {
            for (int j = 0; j < G; ++j)
              dst[j] = d < s.dim && j < live ? T(krow[j][d * s.ks]) : T(0);
          }
        }
        // Rows c0 .. c0 + G - 1 of the V tile.
        T* const v_tile = &vp(b, h, n0 - c0, 0);
        for (int j = 0; j < G; ++j)
          pack_v_row(v_tile + (c0 + j) * s.v_panel, j < live ? &v(b, n0 + j, h, 0) : nullptr, s.vs,
                     j < live ? s.dim : 0, s);
      });
}

/// Fills `p` from user views k, v of shape (batch, keys, kv_heads, dim), any layout.
template <class ExecSpace, class T, class MemorySpace, class KView, class VView>
void pack_kv(const ExecSpace& exec, const KView& k, const VView& v,
             const PackedKV<T, MemorySpace>& p) {
  if constexpr (is_host_space_v<ExecSpace>) {
    if (p.panel % 16 == 0)
      return pack_kv_groups<16>(exec, k, v, p);
    else if (p.panel % 8 == 0)
      return pack_kv_groups<8>(exec, k, v, p);
  }
  pack_kv_rows(exec, k, v, p);
}

/// The kernels' packed block (compute type T) from a packed block in storage
/// type S (bf16 / fp16: what travels on a ring), widened exactly; same tiles,
/// and the same panels or others (a block in rows, panel 1 and v_panel =
/// dim_padded, as a fused provider reads it: relaid into the kernels' panels).
template <class ExecSpace, class T, class S, class MemorySpace>
void widen_kv(const ExecSpace& exec, const PackedKV<S, MemorySpace>& from,
              const PackedKV<T, MemorySpace>& to) {
  if (from.panel != to.panel || from.v_panel != to.v_panel) {
    const auto fk = from.kt;
    const auto fv = from.v;
    const auto tk = to.kt;
    const auto tv = to.v;
    const int batch = int(fk.extent(0)), heads = int(fk.extent(1)), tiles = int(fk.extent(2));
    const int dp = int(fk.extent(3)), bk = int(fk.extent(4));
    const int fp = from.panel, tp = to.panel, fvp = from.v_panel, tvp = to.v_panel;
    const std::int64_t rows = std::int64_t(batch) * heads * tiles * bk;
    Kokkos::parallel_for(
        "blockattn::widen_kv_relayout",
        Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, rows),
        KOKKOS_LAMBDA(const std::int64_t row) {
          const int c = int(row % bk);
          const int t = int((row / bk) % tiles);
          const int h = int((row / (std::int64_t(bk) * tiles)) % heads);
          const int b = int(row / (std::int64_t(bk) * tiles * heads));
          const S* const ks = &fk(b, h, t, 0, 0);
          T* const kd = &tk(b, h, t, 0, 0);
          const S* const vs = &fv(b, h, t * bk, 0);
          T* const vd = &tv(b, h, t * bk, 0);
          for (int d = 0; d < dp; ++d) {
            kd[kt_tile_offset(d, c, dp, tp)] = T(ks[kt_tile_offset(d, c, dp, fp)]);
            vd[v_tile_offset(c, d, bk, tvp)] = T(vs[v_tile_offset(c, d, bk, fvp)]);
          }
        });
    return;
  }
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
