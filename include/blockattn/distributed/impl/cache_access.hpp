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

#include <type_traits>
#include <utility>

namespace blockattn {
namespace impl {

template <class C>
struct is_serving_cache : std::false_type {};
template <class T, class E, class P>
struct is_serving_cache<KVCache<T, E, P>> : std::true_type {};
template <class T, class E, class P>
struct is_serving_cache<PagedKVCache<T, E, P>> : std::true_type {};

/// Slots per page of the cache (0: contiguous), for the ranks' fingerprint.
template <class T, class E, class P>
int cache_page_size(const KVCache<T, E, P>&) {
  return 0;
}
template <class T, class E, class P>
int cache_page_size(const PagedKVCache<T, E, P>& c) {
  return c.page_size();
}

/// attention_decode of sequences [s0, s1) of the shard: q (s1 - s0, rows,
/// heads, head_dim), len and qpos their local lengths and first query
/// positions.
template <class ExecSpace, class T, class P, class QV, class LenV, class PosV, class OV, class LV,
          class Mask>
void cache_decode(const ExecSpace& exec, const KVCache<T, ExecSpace, P>& cache, int s0, int s1,
                  const QV& q, const LenV& len, const PosV& qpos, const OV& o, const LV& lse,
                  const Mask& mask, const DecodeOptions& opts) {
  const auto range = Kokkos::make_pair(s0, s1);
  const auto k = Kokkos::subview(cache.keys(), range, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL);
  const auto v = Kokkos::subview(cache.values(), range, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL);
  attention_decode(exec, q, k, v, len, qpos, o, lse, mask, cache.positions(), opts);
}
template <class ExecSpace, class T, class P, class QV, class LenV, class PosV, class OV, class LV,
          class Mask>
void cache_decode(const ExecSpace& exec, const PagedKVCache<T, ExecSpace, P>& cache, int s0, int s1,
                  const QV& q, const LenV& len, const PosV& qpos, const OV& o, const LV& lse,
                  const Mask& mask, const DecodeOptions& opts) {
  const auto table = Kokkos::subview(cache.block_table(), Kokkos::make_pair(s0, s1), Kokkos::ALL);
  decode_paged(exec, q, cache.keys(), cache.values(), table, len, qpos, o, lse, mask,
               cache.positions(), opts, false);
}

/// Sequence s's first L local slots as (1, L, kv_heads, head_dim) K and V.
template <class ExecSpace, class T, class P>
auto shard_rows(const ExecSpace&, const KVCache<T, ExecSpace, P>& cache, int s, index_type L) {
  const auto range = Kokkos::make_pair(s, s + 1);
  const auto slots = Kokkos::make_pair(index_type(0), L);
  return std::make_pair(Kokkos::subview(cache.keys(), range, slots, Kokkos::ALL, Kokkos::ALL),
                        Kokkos::subview(cache.values(), range, slots, Kokkos::ALL, Kokkos::ALL));
}
/// The gather of shard_rows over a paged cache (a function of its own: nvcc
/// takes no extended lambda in a function with a deduced return type).
template <class ExecSpace, class T, class P, class Out>
void gather_pages(const ExecSpace& exec, const PagedKVCache<T, ExecSpace, P>& cache, int s,
                  index_type L, const Out& k, const Out& v) {
  const int H = cache.kv_heads(), D = cache.dim();
  const auto kp = cache.keys(), vp = cache.values();
  const auto table = cache.block_table();
  int shift = 0;
  while ((1 << shift) < cache.page_size()) ++shift;
  const std::int64_t n = std::int64_t(L) * H;
  Kokkos::parallel_for(
      "blockattn::paged_gather",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const int j = int(i / H), g = int(i % H);
        const int page = table(s, j >> shift), slot = j & ((1 << shift) - 1);
        for (int d = 0; d < D; ++d) {
          k(0, j, g, d) = kp(page, slot, g, d);
          v(0, j, g, d) = vp(page, slot, g, d);
        }
      });
}
template <class ExecSpace, class T, class P>
std::pair<Kokkos::View<T****, Kokkos::LayoutRight, typename ExecSpace::memory_space>,
          Kokkos::View<T****, Kokkos::LayoutRight, typename ExecSpace::memory_space>>
shard_rows(const ExecSpace& exec, const PagedKVCache<T, ExecSpace, P>& cache, int s, index_type L) {
  using Out = Kokkos::View<T****, Kokkos::LayoutRight, typename ExecSpace::memory_space>;
  Out k(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::paged_gather_k"), 1,
        std::size_t(L), cache.kv_heads(), cache.dim());
  Out v(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::paged_gather_v"), 1,
        std::size_t(L), cache.kv_heads(), cache.dim());
  gather_pages(exec, cache, s, L, k, v);
  return {k, v};
}

}  // namespace impl
}  // namespace blockattn
