// SPDX-License-Identifier: Apache-2.0
// The packed operands of the backward kernels (backward_kernel.hpp): the key
// side (K^T and V^T panels, K rows) and the query side (Q and dO rows,
// LSE * log2(e), D = rowsum(dO o O)), their allocation and packing from the
// caller's Views (any layout), and the widening of a 16-bit travelling copy.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/buffer_cache.hpp>
#include <blockattn/kernel/impl/half_rows.hpp>
#include <blockattn/kernel/impl/prefetch.hpp>
#include <blockattn/kernel/isa.hpp>
#include <blockattn/kernel/tile_shape.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace blockattn::impl {

/// One key row of pack_keys: K^T and V^T columns (stride ps), the K row.
/// fp16 rows of unit stride are widened in vectors first (half_rows.hpp), 64
/// values at a time.
template <class T, class KS, class VS>
KOKKOS_INLINE_FUNCTION void pack_key_row(const KS* krow, const VS* vrow, std::ptrdiff_t ks,
                                         std::ptrdiff_t vs, int live, std::ptrdiff_t ps, T* kt_col,
                                         T* k_row, T* vt_col) {
  if constexpr (vector_half_rows_v<T, KS> && vector_half_rows_v<T, VS>) {
    if (ks == 1 && vs == 1) {
      T kb[64], vb[64];
      for (int d0 = 0; d0 < live; d0 += 64) {
        const int w = live - d0 < 64 ? live - d0 : 64;
        load_row(kb, krow + d0, 1, w);
        load_row(vb, vrow + d0, 1, w);
        for (int d = 0; d < w; ++d) {
          kt_col[(d0 + d) * ps] = kb[d];
          k_row[d0 + d] = kb[d];
          vt_col[(d0 + d) * ps] = vb[d];
        }
      }
      return;
    }
  }
  for (int d = 0; d < live; ++d) {
    const T kv = T(krow[d * ks]);
    kt_col[d * ps] = kv;
    k_row[d] = kv;
    vt_col[d * ps] = T(vrow[d * vs]);
  }
}

/// Packed key side of a backward block, zero padded like PackedKV:
///   kt, vt (batch, kv_head, key_tile, head_dim_padded, block_k)  K^T, V^T panels
///   k      (batch, kv_head, keys_padded, head_dim_padded)        K rows (for dQ)
template <class T, class MemorySpace>
struct PackedKeys {
  using panel_view = Kokkos::View<T*****, Kokkos::LayoutRight, MemorySpace>;
  using row_view = Kokkos::View<T****, Kokkos::LayoutRight, MemorySpace>;
  panel_view kt, vt;
  row_view k;
  int keys = 0;
};

template <class T, class MemorySpace, class Buffers = NoCallBuffers>
PackedKeys<T, MemorySpace> allocate_packed_keys(int batch, int kv_heads, int keys, int dim_padded,
                                                int block_k, Buffers* buffers = nullptr) {
  using P = PackedKeys<T, MemorySpace>;
  const int tiles = (keys + block_k - 1) / block_k;
  const char* label = "blockattn::packed_keys";
  P p;
  p.kt = allocate_view<typename P::panel_view>(buffers, label, batch, kv_heads, tiles, dim_padded,
                                               block_k);
  p.vt = allocate_view<typename P::panel_view>(buffers, label, batch, kv_heads, tiles, dim_padded,
                                               block_k);
  p.k = allocate_view<typename P::row_view>(buffers, label, batch, kv_heads, tiles * block_k,
                                            dim_padded);
  p.keys = keys;
  return p;
}

template <class ExecSpace, class T, class MemorySpace, class KView, class VView>
void pack_keys(const ExecSpace& exec, const KView& k, const VView& v,
               const PackedKeys<T, MemorySpace>& p) {
  const int heads = int(p.k.extent(1)), keys_padded = int(p.k.extent(2)),
            dim_padded = int(p.k.extent(3)), block_k = int(p.kt.extent(4));
  const int dim = int(k.extent(3)), keys = p.keys;
  auto kt = p.kt;
  auto vt = p.vt;
  auto kr = p.k;
  const std::int64_t rows = std::int64_t(p.k.extent(0)) * heads * keys_padded;
  // One key row per iteration through pointers (no view index per element):
  // the source rows through their stride (any layout of k and v), the row of
  // K contiguous, the columns of the K^T and V^T panels `block_k` apart.
  const std::ptrdiff_t ks = static_cast<std::ptrdiff_t>(k.stride(3));
  const std::ptrdiff_t vs = static_cast<std::ptrdiff_t>(v.stride(3));
  const std::ptrdiff_t ps = static_cast<std::ptrdiff_t>(p.kt.stride(3));
  Kokkos::parallel_for(
      "blockattn::pack_keys",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, rows),
      KOKKOS_LAMBDA(const std::int64_t row) {
        const int n = int(row % keys_padded), h = int((row / keys_padded) % heads),
                  b = int(row / (std::int64_t(keys_padded) * heads));
        T* const kt_col = &kt(b, h, n / block_k, 0, n % block_k);
        T* const vt_col = &vt(b, h, n / block_k, 0, n % block_k);
        T* const k_row = &kr(b, h, n, 0);
        // Rows prefetch_ahead on, asked for now (prefetch.hpp: one head's rows are
        // heads * dim apart, past the hardware prefetchers).
        if (ks == 1 && vs == 1 && n + prefetch_ahead < keys) {
          prefetch_span(&k(b, n + prefetch_ahead, h, 0), sizeof(k(b, n, h, 0)) * dim);
          prefetch_span(&v(b, n + prefetch_ahead, h, 0), sizeof(v(b, n, h, 0)) * dim);
        }
        const int live = n < keys ? dim : 0;  // padding rows: all zero
        if (live > 0) {
          const auto* const krow = &k(b, n, h, 0);
          const auto* const vrow = &v(b, n, h, 0);
          pack_key_row(krow, vrow, ks, vs, live, ps, kt_col, k_row, vt_col);
        }
        for (int d = live; d < dim_padded; ++d) {
          kt_col[d * ps] = T(0);
          k_row[d] = T(0);
          vt_col[d * ps] = T(0);
        }
      });
}

/// Packed query side of a backward block (the Q ring's traveling data), zero padded:
///   q, dout (batch, head, queries_padded, head_dim_padded)   rows contiguous
///   lse2, drow (batch, head, queries_padded)                  LSE * log2(e) (-inf on
///                                                              padding), rowsum(dO o O)
/// T is the compute type. S is the type of the q and dout rows: T for the
/// kernels; the 16-bit storage type for the copy that travels on the Q ring
/// (widened to T on arrival, widen_queries). lse2 and drow are always T.
template <class T, class MemorySpace, class S = T>
struct PackedQueries {
  using row_view = Kokkos::View<S****, Kokkos::LayoutRight, MemorySpace>;
  using vec_view = Kokkos::View<T***, Kokkos::LayoutRight, MemorySpace>;
  row_view q, dout;
  vec_view lse2, drow;
  int queries = 0;
};

template <class T, class MemorySpace, class S = T, class Buffers = NoCallBuffers>
PackedQueries<T, MemorySpace, S> allocate_packed_queries(int batch, int heads, int queries,
                                                         int dim_padded, int block_q,
                                                         Buffers* buffers = nullptr) {
  using P = PackedQueries<T, MemorySpace, S>;
  const int padded = (queries + block_q - 1) / block_q * block_q;
  const char* label = "blockattn::packed_queries";
  P p;
  p.q = allocate_view<typename P::row_view>(buffers, label, batch, heads, padded, dim_padded);
  p.dout = allocate_view<typename P::row_view>(buffers, label, batch, heads, padded, dim_padded);
  p.lse2 = allocate_view<typename P::vec_view>(buffers, label, batch, heads, padded);
  p.drow = allocate_view<typename P::vec_view>(buffers, label, batch, heads, padded);
  p.queries = queries;
  return p;
}

/// One query row of pack_queries: the packed Q and dO rows, and D =
/// rowsum(dO o O) returned (fused on the FMA ISAs, as the kernels' dP). fp16
/// rows of unit stride are widened in vectors first (half_rows.hpp), 64
/// values at a time; the sum runs over d = 0, 1, ... either way.
template <HostIsa Isa, class T, class S, class QS, class DS, class OS>
KOKKOS_INLINE_FUNCTION T pack_query_row(const QS* qrow, const DS* dorow, const OS* orow,
                                        std::ptrdiff_t qs, std::ptrdiff_t ds, std::ptrdiff_t os,
                                        int live, S* q_row, S* do_row) {
  T acc = T(0);
  auto add = [&](T dov, T ov) {
    if constexpr (Isa == HostIsa::avx2 || Isa == HostIsa::avx512)
      acc = std::fma(dov, ov, acc);  // fused, as the kernels' dP
    else
      acc += dov * ov;
  };
  if constexpr (vector_half_rows_v<T, QS> && vector_half_rows_v<T, DS> &&
                vector_half_rows_v<T, OS> && std::is_same<S, T>::value) {
    if (qs == 1 && ds == 1 && os == 1) {
      T ob[64];
      for (int d0 = 0; d0 < live; d0 += 64) {
        const int w = live - d0 < 64 ? live - d0 : 64;
        load_row(q_row + d0, qrow + d0, 1, w);
        load_row(do_row + d0, dorow + d0, 1, w);
        load_row(ob, orow + d0, 1, w);
        for (int d = 0; d < w; ++d) add(do_row[d0 + d], ob[d]);
      }
      return acc;
    }
  }
  for (int d = 0; d < live; ++d) {
    const T dov = T(dorow[d * ds]);
    q_row[d] = S(qrow[d * qs]);
    do_row[d] = S(dov);
    add(dov, T(orow[d * os]));
  }
  return acc;
}

/// Fills `p` from user views q, dout, o (batch, queries, heads, dim) and lse
/// (batch, heads, queries); computes D = rowsum(dO o O) on the way (in T).
/// Isa: the host ISA of the backward kernels that read it. D is computed as
/// that ISA's build computes it (fused or not), so that a row with one
/// allowed key, where dP - D is 0 in exact arithmetic, gets dS = 0 exactly
/// also under run-time dispatch. Callers pass kernel_isa_v<ExecSpace, Shape>
/// (`generic` on devices: this function's kernel is named after Isa, which
/// must be the same in a device compiler's host and device passes).
template <HostIsa Isa, class ExecSpace, class T, class MemorySpace, class S, class QV, class DOV,
          class OV, class LV>
void pack_queries(const ExecSpace& exec, const QV& q, const DOV& dout, const OV& o, const LV& lse,
                  const PackedQueries<T, MemorySpace, S>& p) {
  const int heads = int(p.q.extent(1)), padded = int(p.q.extent(2)),
            dim_padded = int(p.q.extent(3));
  const int dim = int(q.extent(3)), queries = p.queries;
  auto qp = p.q;
  auto dop = p.dout;
  auto l2 = p.lse2;
  auto dr = p.drow;
  const std::int64_t rows = std::int64_t(p.q.extent(0)) * heads * padded;
  // One query row per iteration through pointers (no view index per
  // element): the source rows through their stride (any layout), the packed
  // rows contiguous. D sums d = 0, 1, ... in order, one product at a time,
  // fused on the FMA ISAs as their kernels' dP is: left to the compiler,
  // GCC's Zen tuning (-march=znver3: "avoid FMA chains") splits this chain
  // into multiply and add, and a row with one allowed key got dS != 0.
  const std::ptrdiff_t qs = static_cast<std::ptrdiff_t>(q.stride(3));
  const std::ptrdiff_t ds = static_cast<std::ptrdiff_t>(dout.stride(3));
  const std::ptrdiff_t os = static_cast<std::ptrdiff_t>(o.stride(3));
  const auto pack_row = KOKKOS_LAMBDA(const std::int64_t row) {
    const int i = int(row % padded), h = int((row / padded) % heads),
              b = int(row / (std::int64_t(padded) * heads));
    const bool in = i < queries;
    // Rows prefetch_ahead on, asked for now (prefetch.hpp).
    if (qs == 1 && ds == 1 && os == 1 && i + prefetch_ahead < queries) {
      prefetch_span(&q(b, i + prefetch_ahead, h, 0), sizeof(q(b, i, h, 0)) * dim);
      prefetch_span(&dout(b, i + prefetch_ahead, h, 0), sizeof(dout(b, i, h, 0)) * dim);
      prefetch_span(&o(b, i + prefetch_ahead, h, 0), sizeof(o(b, i, h, 0)) * dim);
    }
    S* const q_row = &qp(b, h, i, 0);
    S* const do_row = &dop(b, h, i, 0);
    const int live = in ? dim : 0;  // padding rows: all zero
    T acc = T(0);
    if (live > 0)
      acc = pack_query_row<Isa, T>(&q(b, i, h, 0), &dout(b, i, h, 0), &o(b, i, h, 0), qs, ds, os,
                                   live, q_row, do_row);
    for (int d = live; d < dim_padded; ++d) {
      q_row[d] = S(T(0));
      do_row[d] = S(T(0));
    }
    l2(b, h, i) = in ? T(lse(b, h, i)) * log2e<T> : -infinity<T>();
    dr(b, h, i) = acc;
  };
  const Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>> policy(exec, 0, rows);
#if BLOCKATTN_HOST_DISPATCH
  if constexpr (host_isa_targeted(Isa)) {
    Kokkos::parallel_for("blockattn::pack_queries", policy, [=](const std::int64_t row) {
      HostIsaEntry<Isa>::run([&] { pack_row(row); });
    });
    return;
  }
#endif
  Kokkos::parallel_for("blockattn::pack_queries", policy, pack_row);
}

/// The kernels' packed queries from a travelling copy in storage type S: q
/// and dout widened (exactly) into `to`; lse2 and drow shared with `from`.
template <class ExecSpace, class T, class MemorySpace, class S>
void widen_queries(const ExecSpace& exec, const PackedQueries<T, MemorySpace, S>& from,
                   PackedQueries<T, MemorySpace>& to) {
  const std::int64_t n = std::int64_t(from.q.span());
  const S *fq = from.q.data(), *fd = from.dout.data();
  T *tq = to.q.data(), *td = to.dout.data();
  Kokkos::parallel_for(
      "blockattn::widen_queries",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
      KOKKOS_LAMBDA(const std::int64_t i) {
        tq[i] = T(fq[i]);
        td[i] = T(fd[i]);
      });
  to.lse2 = from.lse2;
  to.drow = from.drow;
  to.queries = from.queries;
}

}  // namespace blockattn::impl
