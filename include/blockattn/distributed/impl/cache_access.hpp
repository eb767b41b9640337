// SPDX-License-Identifier: Apache-2.0
// How the serving calls (distributed/decode.hpp) read a rank's shard of a
// KVCache or a PagedKVCache: the split-KV decode of sequences [s0, s1)
// (attention_decode on the contiguous storage, the paged kernel on the
// pages, both in place), and one sequence's cached keys and values as
// (1, slots, kv_heads, head_dim) Views for the forward's kernels (a subview
// of the contiguous storage; the pages gathered into one buffer, a copy of
// the shard that a prefill chunk of many rows amortises over its products).
#pragma once

#include <blockattn/distributed/kv_cache.hpp>
#include <blockattn/distributed/paged_kv_cache.hpp>
#include <blockattn/kernel/decode.hpp>
#include <blockattn/kernel/decode_paged.hpp>

#include <string>
#include <type_traits>
#include <utility>

namespace blockattn {
namespace impl {

template <class C>
struct is_serving_cache : std::false_type {};
template <class T, class E, class P, class S>
struct is_serving_cache<KVCache<T, E, P, S>> : std::true_type {};
template <class T, class E, class P, class S>
struct is_serving_cache<PagedKVCache<T, E, P, S>> : std::true_type {};

template <class C>
struct is_paged_cache : std::false_type {};
template <class T, class E, class P, class S>
struct is_paged_cache<PagedKVCache<T, E, P, S>> : std::true_type {};

/// Slots per page of the cache (0: contiguous), for the ranks' fingerprint.
template <class T, class E, class P, class S>
int cache_page_size(const KVCache<T, E, P, S>&) {
  return 0;
}
template <class T, class E, class P, class S>
int cache_page_size(const PagedKVCache<T, E, P, S>& c) {
  return c.page_size();
}
/// What a slot stores, by name.
template <class Cache>
std::string cache_storage_name() {
  using S = typename Cache::stored_type;
  if constexpr (is_kv_quant_v<S>)
    return quant_type_name<S>();
  else
    return type_name<S>();
}

/// The paged kernel's view of a paged cache's sequences [s0, s1).
template <class ExecSpace, class T, class P, class S>
DecodePages<typename ExecSpace::memory_space> cache_pages(
    const PagedKVCache<T, ExecSpace, P, S>& cache, int s0, int s1) {
  DecodePages<typename ExecSpace::memory_space> pages;
  pages.table = Kokkos::subview(cache.block_table(), Kokkos::make_pair(s0, s1), Kokkos::ALL);
  pages.paged = true;
  pages.shift = cache.page_shift();
  return pages;
}

/// attention_decode of sequences [s0, s1) of the shard: q (s1 - s0, rows,
/// heads, head_dim), len and qpos their local lengths and first query
/// positions; 8-bit caches through the dequantizing kernel.
template <class ExecSpace, class T, class P, class S, class QV, class LenV, class PosV, class OV,
          class LV, class Mask>
void cache_decode(const ExecSpace& exec, const KVCache<T, ExecSpace, P, S>& cache, int s0, int s1,
                  const QV& q, const LenV& len, const PosV& qpos, const OV& o, const LV& lse,
                  const Mask& mask, const DecodeOptions& opts) {
  const auto range = Kokkos::make_pair(s0, s1);
  const auto k = Kokkos::subview(cache.keys(), range, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL);
  const auto v = Kokkos::subview(cache.values(), range, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL);
  if constexpr (is_kv_quant_v<S>) {
    const auto ks = Kokkos::subview(cache.k_scales(), range, Kokkos::ALL, Kokkos::ALL);
    const auto vs = Kokkos::subview(cache.v_scales(), range, Kokkos::ALL, Kokkos::ALL);
    decode_quantized(exec, "decode_attention", q, k, v, ks, vs, len, qpos, o, lse, mask,
                     cache.positions(), opts, DecodePages<typename ExecSpace::memory_space>{},
                     cache.capacity());
  } else {
    attention_decode(exec, q, k, v, len, qpos, o, lse, mask, cache.positions(), opts);
  }
}
template <class ExecSpace, class T, class P, class S, class QV, class LenV, class PosV, class OV,
          class LV, class Mask>
void cache_decode(const ExecSpace& exec, const PagedKVCache<T, ExecSpace, P, S>& cache, int s0,
                  int s1, const QV& q, const LenV& len, const PosV& qpos, const OV& o,
                  const LV& lse, const Mask& mask, const DecodeOptions& opts) {
  if constexpr (is_kv_quant_v<S>) {
    decode_quantized(exec, "decode_attention", q, cache.keys(), cache.values(), cache.k_scales(),
                     cache.v_scales(), len, qpos, o, lse, mask, cache.positions(), opts,
                     cache_pages(cache, s0, s1), cache.capacity());
  } else {
    const auto table = Kokkos::subview(cache.block_table(), Kokkos::make_pair(s0, s1), Kokkos::ALL);
    decode_paged(exec, q, cache.keys(), cache.values(), table, len, qpos, o, lse, mask,
                 cache.positions(), opts, false);
  }
}

/// The key splits cache_decode takes for B sequences of N rows of H query
/// heads whose longest shard holds max_len keys (decode_grid's choice, or
/// `requested` > 0).
template <class ExecSpace, class Cache>
int cache_decode_splits(const ExecSpace& exec, const Cache& cache, int B, int N, int H,
                        index_type max_len, int requested) {
  BlockExtents e;
  e.batch = B;
  e.heads = H;
  e.kv_heads = cache.kv_heads();
  e.queries = N;
  e.dim = cache.dim();
  const bool cross = decode_cross_heads<ExecSpace>(cache.keys(), cache.values(), e.kv_heads, e.dim);
  return decode_grid<compute_t<typename Cache::value_type>>(exec, e, max_len, requested, cross)
      .splits;
}

/// A stored value in the value type T: an 8-bit code times its row's scale
/// s, or the value itself.
template <class T, class S>
KOKKOS_INLINE_FUNCTION T stored_value(const S& x, float s) {
  if constexpr (is_kv_quant_v<S>) {
    return T(dequantize(x) * s);
  } else {
    (void)s;
    return T(x);
  }
}

/// The gather of shard_rows: k(0, j, g, d) = the value of slot j, kv head g
/// of sequence s (dequantized for 8-bit storage), j < L (a function of its
/// own: nvcc takes no extended lambda in a function with a deduced return
/// type).
template <class ExecSpace, class Cache, class Out>
void gather_shard(const ExecSpace& exec, const Cache& cache,
                  const DecodePages<typename ExecSpace::memory_space>& pages, int s, index_type L,
                  const Out& k, const Out& v) {
  using T = typename Out::value_type;
  using S = typename Cache::stored_type;
  const int H = cache.kv_heads(), D = cache.dim();
  const auto kp = cache.keys(), vp = cache.values();
  const auto ks = cache.k_scales(), vs = cache.v_scales();
  const int b = pages.paged ? 0 : s;  // a paged cache's table rows start at s
  const std::int64_t n = std::int64_t(L) * H;
  Kokkos::parallel_for(
      "blockattn::gather_shard",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const int j = int(i / H), g = int(i % H);
        const auto* kr = pages.row(kp, b, j, g);
        const auto* vr = pages.row(vp, b, j, g);
        // No `if constexpr` here: nvcc takes no extended lambda that first
        // captures inside one (the scales of an unquantized cache: unread).
        const float sk = is_kv_quant_v<S> ? pages.scale(ks, b, j, g) : 1.0f;
        const float sv = is_kv_quant_v<S> ? pages.scale(vs, b, j, g) : 1.0f;
        for (int d = 0; d < D; ++d) {
          k(0, j, g, d) = stored_value<T>(kr[d * kp.stride(3)], sk);
          v(0, j, g, d) = stored_value<T>(vr[d * vp.stride(3)], sv);
        }
      });
}

/// Sequence s's first L local slots as (1, L, kv_heads, head_dim) K and V of
/// the cache's value type: a subview of a contiguous cache that stores its
/// values, a gathered copy of pages or of dequantized 8-bit rows.
template <class ExecSpace, class T, class P>
auto shard_rows(const ExecSpace&, const KVCache<T, ExecSpace, P, T>& cache, int s, index_type L) {
  const auto range = Kokkos::make_pair(s, s + 1);
  const auto slots = Kokkos::make_pair(index_type(0), L);
  return std::make_pair(Kokkos::subview(cache.keys(), range, slots, Kokkos::ALL, Kokkos::ALL),
                        Kokkos::subview(cache.values(), range, slots, Kokkos::ALL, Kokkos::ALL));
}
template <class ExecSpace, class Cache>
std::pair<Kokkos::View<typename Cache::value_type****, Kokkos::LayoutRight,
                       typename ExecSpace::memory_space>,
          Kokkos::View<typename Cache::value_type****, Kokkos::LayoutRight,
                       typename ExecSpace::memory_space>>
shard_rows(const ExecSpace& exec, const Cache& cache, int s, index_type L) {
  using Out = Kokkos::View<typename Cache::value_type****, Kokkos::LayoutRight,
                           typename ExecSpace::memory_space>;
  Out k(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::shard_k"), 1, std::size_t(L),
        cache.kv_heads(), cache.dim());
  Out v(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::shard_v"), 1, std::size_t(L),
        cache.kv_heads(), cache.dim());
  DecodePages<typename ExecSpace::memory_space> pages;
  if constexpr (is_paged_cache<Cache>::value) pages = cache_pages(cache, s, s + 1);
  gather_shard(exec, cache, pages, s, L, k, v);
  return {k, v};
}

}  // namespace impl
}  // namespace blockattn
