// SPDX-License-Identifier: Apache-2.0
// Split-KV decode over a paged KV cache: keys and values in fixed-size pages
// of a pool, each sequence's pages listed in a block table (vLLM's
// PagedAttention layout; the pages read in place by attention_decode's
// kernel, portable/decode_pages.hpp).
#pragma once

#include <blockattn/kernel/decode.hpp>

#include <cstdint>
#include <limits>

namespace blockattn {

namespace impl {
/// Whether n is a power of two in [8, 2^20] (a page size the decode kernel
/// takes: its tiles and the bf16 products' key pairs start at even keys).
inline bool decode_page_size_ok(std::size_t n) {
  return n >= 8 && n <= (std::size_t(1) << 20) && (n & (n - 1)) == 0;
}

/// log2 of a page size (a power of two).
inline int page_shift(std::size_t page_size) {
  int shift = 0;
  while ((std::size_t(1) << shift) < page_size) ++shift;
  return shift;
}

/// The first (sequence, page) of `table` whose entry, among the pages that
/// hold keys (page p of sequence b with p * page_size < lengths(b)), is
/// outside [0, pages): its flat index b * table.extent(1) + p, or -1. Waits
/// for exec.
template <class ExecSpace, class TableV, class LenV>
std::int64_t first_bad_page(const ExecSpace& exec, const TableV& table, const LenV& lengths,
                            int page_size, int pages) {
  const std::int64_t per = std::int64_t(table.extent(1));
  const std::int64_t n = std::int64_t(table.extent(0)) * per;
  constexpr std::int64_t none = std::numeric_limits<std::int64_t>::max();
  std::int64_t first = none;
  if (n == 0) return -1;
  Kokkos::parallel_reduce(
      "blockattn::decode_page_check",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
      KOKKOS_LAMBDA(const std::int64_t i, std::int64_t& f) {
        const int b = int(i / per), p = int(i % per);
        if (std::int64_t(p) * page_size >= std::int64_t(lengths(b))) return;
        const int e = table(b, p);
        if ((e < 0 || e >= pages) && i < f) f = i;
      },
      Kokkos::Min<std::int64_t>(first));
  return first == none ? -1 : first;
}

/// attention_decode_paged; check_table: check the block table's entries
/// (PagedKVCache's own tables are right by construction).
template <class ExecSpace, class QV, class KV, class VV, class TableV, class LenV, class PosV,
          class OV, class LV, class Mask, class KPos>
void decode_paged(const ExecSpace& exec, const QV& q, const KV& k_pages, const VV& v_pages,
                  const TableV& block_table, const LenV& lengths, const PosV& q_positions,
                  const OV& o, const LV& lse, const Mask& mask, const KPos& kpos,
                  const DecodeOptions& opts, bool check_table) {
  check_decode_view_types<QV, KV, VV, OV, LV>();
  check_mask_policy<Mask>();
  check_position_map<KPos>();
  static_assert(Kokkos::is_view<TableV>::value && TableV::rank == 2 &&
                    std::is_same<typename TableV::non_const_value_type, int>::value,
                "BlockAttn: attention_decode_paged's block_table must be a rank-2 View of int "
                "(batch, pages per sequence)");
  static_assert(Kokkos::is_view<LenV>::value && LenV::rank == 1 &&
                    std::is_same<typename LenV::non_const_value_type, int>::value,
                "BlockAttn: attention_decode_paged's lengths must be a rank-1 View of int (batch)");
  static_assert(Kokkos::is_view<PosV>::value && PosV::rank == 1 &&
                    std::is_same<typename PosV::non_const_value_type, index_type>::value,
                "BlockAttn: attention_decode_paged's q_positions must be a rank-1 View of "
                "blockattn::index_type (batch)");
  if constexpr (decode_views_ok<QV, KV, VV, OV, LV>() && is_mask_policy_v<Mask>) {
    using S = typename QV::non_const_value_type;
    using mem = typename ExecSpace::memory_space;
    const char* fn = "attention_decode_paged";
    require_accessible<ExecSpace, typename KV::memory_space>(fn, "k_pages");
    require_accessible<ExecSpace, typename VV::memory_space>(fn, "v_pages");
    require_accessible<ExecSpace, typename TableV::memory_space>(fn, "block_table");
    const char* names[4] = {"pages", "page_size", "kv_heads", "head_dim"};
    for (int d = 0; d < 4; ++d)
      require_extent(fn, "v_pages", v_pages, d, names[d], k_pages.extent(d),
                     "the same extent of k_pages");
    for (int d = 2; d < 4; ++d) require_positive_extent(fn, "k_pages", k_pages, d, names[d]);
    require_extent(fn, "k_pages", k_pages, 3, "head_dim", q.extent(3), "the head_dim of q");
    const std::size_t ps = k_pages.extent(1);
    if (!decode_page_size_ok(ps))
      fail(fn, "argument 'k_pages' has extent(1) (page_size) = ", ps,
           ", expected a power of two from 8 to ", std::size_t(1) << 20);
    if (k_pages.extent(0) > std::size_t(std::numeric_limits<int>::max()))
      fail(fn, "argument 'k_pages' has extent(0) (pages) = ", k_pages.extent(0),
           ", expected at most ", std::numeric_limits<int>::max());
    require_extent(fn, "block_table", block_table, 0, "batch", q.extent(0), "the batch of q");
    const std::size_t capacity = block_table.extent(1) * ps;
    if (capacity > std::size_t(std::numeric_limits<int>::max() / 2))
      fail(fn, "argument 'block_table' has extent(1) = ", block_table.extent(1), " pages of ", ps,
           " slots per sequence, expected at most ", std::numeric_limits<int>::max() / 2, " slots");
    // q, o, lse and the scale by attention_decode's rules, against the
    // sequences' slots seen as one (batch, capacity, kv_heads, head_dim)
    // cache (never read through this view).
    using Logical = Kokkos::View<const S****, Kokkos::LayoutStride, mem,
                                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
    const Logical logical(k_pages.data(),
                          Kokkos::LayoutStride(q.extent(0), 1, capacity, 1, k_pages.extent(2), 1,
                                               k_pages.extent(3), 1));
    const BlockExtents e =
        validate_forward<ExecSpace>(fn, q, logical, logical, o, lse, opts.scale, true);
    const DecodeChecked checked =
        decode_checks(exec, fn, e, q, lengths, q_positions, mask, opts,
                      "block_table.extent(1) * page_size", index_type(capacity));
    const int shift = page_shift(ps);
    const Kokkos::View<const int**, Kokkos::LayoutStride, mem,
                       Kokkos::MemoryTraits<Kokkos::Unmanaged>>
        table(block_table);
    const Kokkos::View<const int*, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> len(lengths);
    const std::int64_t bad =
        check_table ? first_bad_page(exec, table, len, int(ps), int(k_pages.extent(0))) : -1;
    if (bad >= 0) {
      const std::int64_t per = std::int64_t(block_table.extent(1));
      int entry = 0;
      Kokkos::deep_copy(
          Kokkos::View<int, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(&entry),
          Kokkos::subview(table, int(bad / per), int(bad % per)));
      fail(fn, "argument 'block_table' holds page ", entry, " at (", bad / per, ", ", bad % per,
           "), expected a page of the pool: 0 .. ", k_pages.extent(0) - 1);
    }
    DecodePages<mem> pages;
    pages.table = table;
    pages.paged = true;
    pages.shift = shift;
    if (opts.invariant)
      return invariant_decode(fn, exec, e, q, k_pages, v_pages, lengths, q_positions, o, lse, mask,
                              kpos, opts, pages);
    decode_launch(exec, e, checked, q, k_pages, v_pages, lengths, q_positions, o, lse, mask, kpos,
                  opts, pages);
  }
}
}  // namespace impl

/// Attention of a few query rows per sequence against a paged key cache:
///
///   q            (batch, rows, heads, head_dim)
///   k_pages,     (pages, page_size, kv_heads, head_dim), any layout: the
///   v_pages      pool; page_size a power of two from 8 to 2^20
///   block_table  View<int**> (batch, pages per sequence): key j of sequence
///                b is slot j mod page_size of page block_table(b, j /
///                page_size); the entries of the pages that hold keys must
///                be in [0, pages) (checked; the others are not read)
///   lengths, q_positions, o, lse, mask, kpos, opts: as attention_decode
///                (kpos: key j's global position)
///
/// The same kernel and the same bits as attention_decode over the same keys
/// stored contiguously: the pages are read in place, a key tile cut into
/// its pages' runs of adjacent slots. Checks wait for `exec` (the block
/// table's entries and, unless opts.max_length is given, the lengths).
template <class ExecSpace, class QV, class KV, class VV, class TableV, class LenV, class PosV,
          class OV, class LV, class Mask = FullMask, class KPos = OffsetPositions,
          class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
void attention_decode_paged(const ExecSpace& exec, const QV& q, const KV& k_pages,
                            const VV& v_pages, const TableV& block_table, const LenV& lengths,
                            const PosV& q_positions, const OV& o, const LV& lse,
                            const Mask& mask = {}, const KPos& kpos = {},
                            const DecodeOptions& opts = {}) {
  impl::decode_paged(exec, q, k_pages, v_pages, block_table, lengths, q_positions, o, lse, mask,
                     kpos, opts, true);
}

/// Same, on a default-constructed instance of the Views' execution space.
template <class QV, class KV, class VV, class TableV, class LenV, class PosV, class OV, class LV,
          class Mask = FullMask, class KPos = OffsetPositions,
          class = std::enable_if_t<Kokkos::is_view<QV>::value>>
void attention_decode_paged(const QV& q, const KV& k_pages, const VV& v_pages,
                            const TableV& block_table, const LenV& lengths, const PosV& q_positions,
                            const OV& o, const LV& lse, const Mask& mask = {},
                            const KPos& kpos = {}, const DecodeOptions& opts = {}) {
  attention_decode_paged(typename OV::execution_space{}, q, k_pages, v_pages, block_table, lengths,
                         q_positions, o, lse, mask, kpos, opts);
}

}  // namespace blockattn
