// SPDX-License-Identifier: Apache-2.0
// Where the decode kernel finds key j of sequence b: slot j of the caller's
// (batch, capacity, kv_heads, head_dim) K and V, or, for a paged cache
// (vLLM's PagedAttention block tables), slot j mod page_size of pool page
// table(b, j / page_size) of (pages, page_size, kv_heads, head_dim) pools.
// The kernel cuts its key tiles into runs of adjacent slots (run_end: the
// end of a page) and gives each run to the same tile products, so a tile's
// arithmetic is that of the contiguous cache: paged and contiguous caches
// give the same bits for the same keys (every key's score is its own dot
// product; P V accumulates key after key; later runs of a tile rescale by 1,
// exactly; the bf16 dot products pair keys from even positions, and tiles
// and pages start at even ones).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/quant.hpp>

#include <cstdint>

namespace blockattn {
namespace impl {

template <class Mem>
struct DecodePages {
  /// (batch, pages per sequence) pool page indices; unused when !paged.
  Kokkos::View<const int**, Kokkos::LayoutStride, Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>
      table;
  bool paged = false;
  int shift = 0;  // log2(page size)
  /// 8-bit caches (core/quant.hpp): one fp32 scale per (slot, kv head),
  /// indexed as k's first three extents; empty otherwise.
  Kokkos::View<const float***, Kokkos::LayoutStride, Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>
      kscale, vscale;

  /// sc(slot of key j of sequence b, kv head g).
  template <class SV>
  KOKKOS_INLINE_FUNCTION float scale(const SV& sc, int b, std::int64_t j, int g) const {
    if (!paged) return sc(b, int(j), g);
    return sc(table(b, int(j >> shift)), int(j & ((std::int64_t(1) << shift) - 1)), g);
  }

  /// &kv(slot of key j of sequence b, kv head g, 0).
  template <class KV>
  KOKKOS_INLINE_FUNCTION auto row(const KV& kv, int b, std::int64_t j, int g) const
      -> decltype(&kv(0, 0, 0, 0)) {
    if (!paged) return &kv(b, int(j), g, 0);
    return &kv(table(b, int(j >> shift)), int(j & ((std::int64_t(1) << shift) - 1)), g, 0);
  }
  /// kv(slot of key j of sequence b, kv head g, d).
  template <class KV>
  KOKKOS_INLINE_FUNCTION auto at(const KV& kv, int b, std::int64_t j, int g, int d) const
      -> decltype(kv(0, 0, 0, 0)) {
    if (!paged) return kv(b, int(j), g, d);
    return kv(table(b, int(j >> shift)), int(j & ((std::int64_t(1) << shift) - 1)), g, d);
  }
  /// One past the last key stored next to key j (keys j .. run_end(j) - 1
  /// are rows kv.stride(1) apart).
  KOKKOS_INLINE_FUNCTION std::int64_t run_end(std::int64_t j) const {
    return paged ? ((j >> shift) + 1) << shift : std::int64_t(1) << 62;
  }
};

}  // namespace impl
}  // namespace blockattn
