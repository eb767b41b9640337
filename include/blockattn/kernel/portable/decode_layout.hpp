// SPDX-License-Identifier: Apache-2.0
// How split-KV decode (decode_kernel.hpp) cuts its work and its team
// scratch: the grid of teams over (sequence, kv head, row tile, split), and
// the cache-line aligned scratch pieces of one team (impl/scratch.hpp).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/host/decode_amx.hpp>
#include <blockattn/kernel/impl/scratch.hpp>

#include <cstddef>
#include <cstdint>

namespace blockattn {
namespace impl {

/// The most key ranges one (sequence, kv head) is cut into.
inline constexpr int max_decode_splits = 64;

/// How one decode launch cuts its work (host side).
/// A team's rows are consecutive in the sequence's rows ordered (kv head,
/// head of its group, query): row f is head f / rows, query f % rows, kv head
/// f / (group * rows). Without cross_heads a team's rows share one kv head;
/// with it (host spaces, sequence-major caches) they run on over the kv
/// heads, and the team reads the adjacent rows of its kv heads key by key.
struct DecodeGrid {
  int batch = 0, heads = 0, kv_heads = 0, rows = 0, dim = 0;
  int group = 1;             // heads / kv_heads
  int row_tile = 1;          // team rows
  int row_tiles = 1;         // ceil(span_rows() / row_tile)
  int key_tile = 32;         // keys per scratch tile
  int splits = 1;            // key ranges per (sequence, kv head)
  int team_size = 1;         // threads per team (1 on host spaces)
  bool cross_heads = false;  // a team's rows may span kv heads
  bool amx = false;          // host: the tile products on AMX tiles (decode_amx.hpp)
  /// The rows the row tiles cut: one kv head's group, or the sequence's.
  KOKKOS_INLINE_FUNCTION int span_rows() const {
    return group * rows * (cross_heads ? kv_heads : 1);
  }
  KOKKOS_INLINE_FUNCTION std::int64_t league() const {
    return std::int64_t(batch) * (cross_heads ? 1 : kv_heads) * row_tiles * splits;
  }
  KOKKOS_INLINE_FUNCTION std::int64_t state_rows() const {
    return std::int64_t(batch) * heads * rows;
  }
};

/// A decode team's scratch, in cache-line aligned pieces (compute type T).
template <class T>
struct DecodeScratch {
  T* qs = nullptr;               // R x D: q * scale * log2(e)
  T* os = nullptr;               // R x D: unnormalised O
  T* ss = nullptr;               // R x KT: scores, then P
  T* ms = nullptr;               // R: running max (base 2); then R each: ls, as, ones
  T* kvw = nullptr;              // KT x D: a widened K or V tile (widened)
  std::uint16_t* q16 = nullptr;  // R x D: q as stored (the dot products, the tiles)
  std::uint16_t* p16 = nullptr;  // R x p16_stride: P in bf16 (the dot products)
  float* amx = nullptr;          // DecodeAmxScratch (the tiles)

  /// The pieces for g taken from `from` (ScratchLines, or ScratchCount: the
  /// size): widened K/V tiles, the bf16 dot products' q and P, the AMX tiles'.
  template <class From>
  KOKKOS_INLINE_FUNCTION static DecodeScratch carve(From& from, const DecodeGrid& g, bool widened,
                                                    bool dot, bool amx_tiles, int p16_stride) {
    const std::size_t R = std::size_t(g.row_tile), D = std::size_t(g.dim);
    const std::size_t KT = std::size_t(g.key_tile);
    DecodeScratch sc;
    sc.qs = from.template take<T>(R * D);
    sc.os = from.template take<T>(R * D);
    sc.ss = from.template take<T>(R * KT);
    sc.ms = from.template take<T>(4 * R);
    if (widened) sc.kvw = from.template take<T>(KT * D);
    if (dot || amx_tiles) sc.q16 = from.template take<std::uint16_t>(R * D);
    if (dot) sc.p16 = from.template take<std::uint16_t>(R * std::size_t(p16_stride));
#if BLOCKATTN_DECODE_AMX
    if (amx_tiles)
      sc.amx = from.template take<float>(std::size_t(DecodeAmxScratch::total(g.dim, g.key_tile)));
#else
    (void)amx_tiles;
#endif
    return sc;
  }
};

}  // namespace impl
}  // namespace blockattn
