// SPDX-License-Identifier: Apache-2.0
// A paged KV cache, sharded across ranks as KVCache is (a placement policy
// gives each token to a rank; positions stay global): each rank keeps its
// slots of every sequence in fixed-size pages of one pool, a sequence's
// pages listed in its row of a block table (vLLM's PagedAttention). Memory
// is taken a page at a time as sequences grow and returned when they are
// released; sequences can share the pages of a common prefix (fork), with
// reference counts, and the first write into a shared page copies it.
#pragma once

#include <blockattn/distributed/kv_cache.hpp>
#include <blockattn/kernel/decode_paged.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace blockattn {

namespace impl {
/// Where PagedKVCache's appends go: slot `slot` of sequence `seq` is slot
/// slot mod page_size of page table(seq, slot / page_size) of the
/// (kv_heads, pages, page_size, head_dim) pools.
template <class Pool, class Scales, class Table>
struct PagedSlots {
  Pool kp, vp;
  Scales ks, vs;  // (kv_heads, pages, page_size) for 8-bit pools; empty otherwise
  Table table;
  int shift = 0;
  template <class Member, class In>
  KOKKOS_INLINE_FUNCTION void put(const Member& m, int seq, int g, index_type slot, const In* k,
                                  std::ptrdiff_t sk, const In* v, std::ptrdiff_t sv, int D) const {
    const int page = table(seq, int(slot >> shift));
    const int at = int(slot & ((index_type(1) << shift) - 1));
    store_row(m, &kp(g, page, at, 0), ks.data() ? &ks(g, page, at) : nullptr, k, sk, D);
    store_row(m, &vp(g, page, at, 0), vs.data() ? &vs(g, page, at) : nullptr, v, sv, D);
  }
};
}  // namespace impl

/// The keys and values of `sequences` sequences on this rank, in a pool of
/// `pages` pages of `page_size` slots (a power of two from 8 to 2^20). The
/// pool is stored kv head by kv head, (kv_head, page, slot, head_dim): a kv
/// head's slots of consecutive pages are adjacent, so pages taken one after
/// another (a prefill's, a fresh pool's) stream as a contiguous cache does.
/// On a 2-core Zen 3 (65 536 keys, 8 heads, D = 128, one thread) pages of 16
/// stored (page, kv_head, slot, head_dim) decoded at 0.54-0.64x the
/// contiguous cache even in pool order, kv head outermost at 0.96-0.97x;
/// pages in random pool order run at what the memory gives scattered 4-8 KB
/// reads (a plain read of such chunks: 0.52-0.68x of a sequential one
/// there). Free pages are taken lowest first. keys() and values() show the pools as
/// (pages, page_size, kv_heads, head_dim) and block_table() the pages of
/// each sequence (sequences, pages per sequence): attention_decode_paged's
/// arguments. T: float, double, bf16 or fp16.
///
/// Host-side bookkeeping (a free-page list, reference counts) decides every
/// page; the block table is copied to the cache's memory space row by row
/// when a sequence's pages change. Every rank runs the same appends, forks
/// and releases (as with KVCache); a rank's pool serves its own shard.
template <class T, class ExecSpace = Kokkos::DefaultExecutionSpace,
          class Placement = RoundRobinPlacement, class Storage = T>
class PagedKVCache {
  static_assert(is_value_type_v<T>,
                "BlockAttn: PagedKVCache's value type must be float, double, blockattn::bf16 or "
                "blockattn::fp16");
  static_assert(std::is_same<Storage, T>::value ||
                    (is_kv_quant_v<Storage> && !std::is_same<T, double>::value),
                "BlockAttn: PagedKVCache's Storage is its value type, or (float, bf16, fp16 "
                "values) blockattn::fp8_e4m3, blockattn::fp8_e5m2 or std::int8_t with a scale per "
                "row");
  static_assert(impl::is_placement<Placement>::value,
                "BlockAttn: a placement policy needs owner(t, P), slot(t, P), position(s, rank, "
                "P), local_count(n, rank, P), local_capacity(n, P) and parameters() (see "
                "blockattn/distributed/kv_cache.hpp)");

 public:
  using value_type = T;
  using execution_space = ExecSpace;
  using memory_space = typename ExecSpace::memory_space;
  using placement_type = Placement;
  using stored_type = Storage;
  static constexpr bool quantized = is_kv_quant_v<Storage>;
  using view_type = Kokkos::View<Storage****, Kokkos::LayoutStride, memory_space>;
  using storage_type = Kokkos::View<Storage****, Kokkos::LayoutRight, memory_space>;
  using scale_view_type = Kokkos::View<float***, Kokkos::LayoutStride, memory_space>;
  using scale_storage_type = Kokkos::View<float***, Kokkos::LayoutRight, memory_space>;
  using table_type = Kokkos::View<int**, Kokkos::LayoutRight, memory_space>;

  /// The shard of rank `rank` of `size`: a pool of `pages` pages of
  /// `page_size` slots; `max_length` tokens at most per sequence (all ranks
  /// together; it sets the block table's width), 0: as many as the pool holds.
  PagedKVCache(int rank, int size, int sequences, int pages, int page_size, int kv_heads, int dim,
               const Placement& placement = {}, index_type max_length = 0)
      : m_rank(rank), m_size(size), m_placement(placement), m_page_size(page_size) {
    const char* fn = "PagedKVCache";
    if (size < 1 || rank < 0 || rank >= size)
      impl::fail(fn, "rank ", rank, " of size ", size, ", expected 0 <= rank < size");
    if (sequences < 1) impl::fail(fn, "argument 'sequences' = ", sequences, ", expected >= 1");
    if (pages < 1) impl::fail(fn, "argument 'pages' = ", pages, ", expected >= 1");
    if (!impl::decode_page_size_ok(std::size_t(page_size < 0 ? 0 : page_size)))
      impl::fail(fn, "argument 'page_size' = ", page_size, ", expected a power of two from 8 to ",
                 1 << 20);
    if (kv_heads < 1) impl::fail(fn, "argument 'kv_heads' = ", kv_heads, ", expected >= 1");
    if (dim < 1 || dim > 256)
      impl::fail(fn, "argument 'dim' = ", dim, ", expected 1 .. 256 (the largest head dim)");
    if (max_length < 0) impl::fail(fn, "argument 'max_length' = ", max_length, ", expected >= 0");
    m_shift = impl::page_shift(page_size);
    const index_type slots =
        max_length > 0 ? placement.local_capacity(max_length, size) : index_type(pages) * page_size;
    const index_type width = std::max<index_type>(1, (slots + page_size - 1) / page_size);
    if (width * page_size > index_type(std::numeric_limits<int>::max() / 2))
      impl::fail(fn, "a sequence of ", width * page_size, " slots on one rank, expected at most ",
                 std::numeric_limits<int>::max() / 2, ": give a smaller max_length");
    m_k = storage_type(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::paged_k"),
                       kv_heads, pages, page_size, dim);
    m_v = storage_type(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::paged_v"),
                       kv_heads, pages, page_size, dim);
    if (quantized) {
      m_ks = scale_storage_type("blockattn::paged_k_scales", kv_heads, pages, page_size);
      m_vs = scale_storage_type("blockattn::paged_v_scales", kv_heads, pages, page_size);
    }
    m_table = table_type("blockattn::block_table", sequences, std::size_t(width));
    m_table_host = Kokkos::create_mirror_view(m_table);
    m_local = Kokkos::View<int*, memory_space>("blockattn::paged_lengths", sequences);
    m_local_host = Kokkos::create_mirror_view(m_local);
    m_length.assign(std::size_t(sequences), 0);
    m_held.assign(std::size_t(sequences), 0);
    m_released.assign(std::size_t(sequences), false);
    m_refs.assign(std::size_t(pages), 0);
    for (int p = 0; p < pages; ++p) m_free.push_back(p);  // a min-heap: sorted
  }
  /// Move-only: a copy would share the pools but not the bookkeeping of
  /// which pages are free.
  PagedKVCache(const PagedKVCache&) = delete;
  PagedKVCache& operator=(const PagedKVCache&) = delete;
  PagedKVCache(PagedKVCache&&) = default;
  PagedKVCache& operator=(PagedKVCache&&) = default;
  /// The shard of comm's rank.
  template <class Comm, class = std::enable_if_t<is_communicator_v<Comm>>>
  PagedKVCache(const Comm& comm, int sequences, int pages, int page_size, int kv_heads, int dim,
               const Placement& placement = {}, index_type max_length = 0)
      : PagedKVCache(comm.rank(), comm.size(), sequences, pages, page_size, kv_heads, dim,
                     placement, max_length) {}

  int rank() const { return m_rank; }
  int size() const { return m_size; }
  int sequences() const { return int(m_table.extent(0)); }
  int kv_heads() const { return int(m_k.extent(0)); }
  int dim() const { return int(m_k.extent(3)); }
  int page_size() const { return m_page_size; }
  /// log2(page_size()).
  int page_shift() const { return m_shift; }
  /// Pages of this rank's pool, and of them the free ones.
  int pages() const { return int(m_k.extent(1)); }
  int free_pages() const { return int(m_free.size()); }
  /// The pages of this rank's pool an append of `tokens` tokens to sequence
  /// `seq` takes: new pages, and the copy of a shared page written into.
  int pages_to_append(int seq, index_type tokens) const {
    check_seq("PagedKVCache::pages_to_append", "seq", seq);
    return tokens > 0 ? pages_needed(seq, seq + 1, tokens) : 0;
  }
  /// Pages of sequence `seq` on this rank, and the sequences that reference page p.
  int pages_of(int seq) const { return m_held.at(std::size_t(seq)); }
  int references(int page) const { return m_refs.at(std::size_t(page)); }
  /// Slots of one sequence on this rank (the block table's width x page_size).
  index_type capacity() const { return index_type(m_table.extent(1)) * m_page_size; }
  const Placement& placement() const { return m_placement; }
  /// Bytes of this rank's K and V pools.
  std::int64_t bytes() const {
    return 2 * std::int64_t(m_k.span()) * std::int64_t(sizeof(Storage)) +
           2 * std::int64_t(m_ks.span()) * 4;
  }

  index_type length(int seq) const { return m_length.at(std::size_t(seq)); }
  int local_length(int seq) const { return m_local_host(std::size_t(seq)); }
  int max_local_length() const {
    int m = 0;
    for (int s = 0; s < sequences(); ++s) m = std::max(m, local_length(s));
    return m;
  }
  /// (pages, page_size, kv_heads, head_dim) views of the pools.
  view_type keys() const { return as_view(m_k); }
  view_type values() const { return as_view(m_v); }
  /// 8-bit pools: the (pages, page_size, kv_heads) scales of the rows.
  scale_view_type k_scales() const { return as_scales(m_ks); }
  scale_view_type v_scales() const { return as_scales(m_vs); }
  /// (sequences, pages per sequence): slot j of sequence s is slot j mod
  /// page_size of page block_table()(s, j / page_size).
  const table_type& block_table() const { return m_table; }
  const Kokkos::View<int*, memory_space>& local_lengths() const { return m_local; }
  PlacementPositions<Placement> positions() const { return {m_placement, m_rank, m_size}; }

  /// Appends k_new.extent(1) tokens to every sequence (k_new, v_new:
  /// (sequences, tokens, kv_heads, head_dim), the same on every rank).
  template <class KV, class VV>
  void append(const ExecSpace& exec, const KV& k_new, const VV& v_new) {
    append_rows(exec, "PagedKVCache::append", 0, sequences(), k_new, v_new);
  }
  /// Appends k_new.extent(1) tokens to sequence `seq` (k_new, v_new: (1,
  /// tokens, kv_heads, head_dim)).
  template <class KV, class VV>
  void append(const ExecSpace& exec, int seq, const KV& k_new, const VV& v_new) {
    check_seq("PagedKVCache::append", "seq", seq);
    append_rows(exec, "PagedKVCache::append", seq, seq + 1, k_new, v_new);
  }

  /// The checks of an append to sequences [s0, s1) without appending: the
  /// shapes, the sequences' width (the same answer on every rank) and this
  /// rank's free pages (its own pool: collective calls agree on it first).
  template <class KV, class VV>
  void check_append(const char* fn, int s0, int s1, const KV& k_new, const VV& v_new,
                    const char* k_name = "k_new", const char* v_name = "v_new") const {
    impl::check_append_shapes<ExecSpace>(fn, s1 - s0, kv_heads(), dim(), k_new, v_new, k_name,
                                         v_name);
    const index_type n = index_type(k_new.extent(1));
    if (n == 0) return;
    for (int s = s0; s < s1; ++s)
      for (int r = 0; r < m_size; ++r)
        if (m_placement.local_count(length(s) + n, r, m_size) > capacity())
          impl::fail(fn, "sequence ", s, " would hold ", length(s) + n, " tokens; rank ", r,
                     "'s block table holds ", capacity(), " slots per sequence (",
                     impl::type_name<Placement>(), ", P = ", m_size,
                     "); expected at most the tokens that fit: release() the sequence or build "
                     "the cache with a larger max_length");
    const int need = pages_needed(s0, s1, n);
    if (need > free_pages())
      impl::fail(fn, "the page pool of rank ", m_rank, " is exhausted: appending ", n,
                 " tokens to sequences ", s0, " .. ", s1 - 1, " needs ", need, " pages, ",
                 free_pages(), " of ", pages(),
                 " are free; expected an append that fits: release sequences or build the cache "
                 "with more pages");
  }

  /// Sequence `dst` (empty) shares the first `tokens` tokens of sequence
  /// `src` (-1: all of them): it references src's pages, and the first
  /// append that writes into a page both reference copies it.
  void fork(int src, int dst, index_type tokens = -1) {
    const char* fn = "PagedKVCache::fork";
    check_seq(fn, "src", src);
    check_seq(fn, "dst", dst);
    if (src == dst)
      impl::fail(fn, "arguments 'src' and 'dst' are both ", src, ", expected two sequences");
    if (length(dst) != 0)
      impl::fail(fn, "argument 'dst' = ", dst, " holds ", length(dst),
                 " tokens, expected an empty sequence: release() it first");
    if (tokens < 0) tokens = length(src);
    if (tokens > length(src))
      impl::fail(fn, "argument 'tokens' = ", tokens, ", expected at most the ", length(src),
                 " tokens of sequence ", src);
    const int local = int(m_placement.local_count(tokens, m_rank, m_size));
    const int n = (local + m_page_size - 1) / m_page_size;
    for (int p = 0; p < n; ++p) {
      const int page = m_table_host(std::size_t(src), std::size_t(p));
      m_table_host(std::size_t(dst), std::size_t(p)) = page;
      ++m_refs[std::size_t(page)];
    }
    m_held[std::size_t(dst)] = n;
    m_length[std::size_t(dst)] = tokens;
    m_released[std::size_t(dst)] = false;
    m_local_host(std::size_t(dst)) = local;
    copy_table_row(dst);
    Kokkos::deep_copy(m_local, m_local_host);
  }

  /// Returns sequence `seq`'s pages (those no other sequence references go
  /// back to the pool) and empties it. Throws when it was released already
  /// and nothing was appended or forked into it since.
  void release(int seq) {
    const char* fn = "PagedKVCache::release";
    check_seq(fn, "seq", seq);
    if (m_released[std::size_t(seq)])
      impl::fail(fn, "sequence ", seq,
                 " was released already and holds nothing since; expected a sequence that was "
                 "not released (released twice?)");
    for (int p = 0; p < m_held[std::size_t(seq)]; ++p) {
      const int page = m_table_host(std::size_t(seq), std::size_t(p));
      if (--m_refs[std::size_t(page)] == 0) give_page(page);
    }
    m_held[std::size_t(seq)] = 0;
    m_length[std::size_t(seq)] = 0;
    m_released[std::size_t(seq)] = true;
    m_local_host(std::size_t(seq)) = 0;
    Kokkos::deep_copy(m_local, m_local_host);
  }

 private:
  int m_rank = 0, m_size = 1;
  Placement m_placement;
  int m_page_size = 16, m_shift = 0;
  storage_type m_k, m_v;
  scale_storage_type m_ks, m_vs;
  table_type m_table;
  typename table_type::HostMirror m_table_host;
  Kokkos::View<int*, memory_space> m_local;
  typename Kokkos::View<int*, memory_space>::HostMirror m_local_host;
  std::vector<index_type> m_length;
  std::vector<int> m_held, m_refs, m_free;
  std::vector<bool> m_released;

  /// (kv_head, page, slot, dim) storage as (page, slot, kv_head, dim).
  static view_type as_view(const storage_type& s) {
    const Kokkos::LayoutStride l(s.extent(1), s.stride(1), s.extent(2), s.stride(2), s.extent(0),
                                 s.stride(0), s.extent(3), s.stride(3));
    return view_type(s.data(), l);
  }
  static scale_view_type as_scales(const scale_storage_type& s) {
    const Kokkos::LayoutStride l(s.extent(1), s.stride(1), s.extent(2), s.stride(2), s.extent(0),
                                 s.stride(0));
    return scale_view_type(s.data(), l);
  }
  void check_seq(const char* fn, const char* name, int seq) const {
    if (seq < 0 || seq >= sequences())
      impl::fail(fn, "argument '", name, "' = ", seq, ", expected 0 .. ", sequences() - 1);
  }
  void copy_table_row(int seq) {
    const auto row = Kokkos::subview(m_table, seq, Kokkos::ALL);
    const auto host = Kokkos::subview(m_table_host, seq, Kokkos::ALL);
    Kokkos::deep_copy(row, host);
  }
  /// The pages n more tokens of sequences [s0, s1) take from this rank's
  /// pool: new pages, and a copy of a shared page written into.
  int pages_needed(int s0, int s1, index_type n) const {
    int need = 0;
    for (int s = s0; s < s1; ++s) {
      const index_type before = local_length(s);
      const index_type after = m_placement.local_count(length(s) + n, m_rank, m_size);
      if (after == before) continue;
      need += int((after + m_page_size - 1) / m_page_size - m_held[std::size_t(s)]);
      if (before % m_page_size != 0 &&
          m_refs[std::size_t(m_table_host(std::size_t(s), std::size_t(before / m_page_size)))] > 1)
        ++need;
    }
    return need;
  }

  template <class KV, class VV>
  void append_rows(const ExecSpace& exec, const char* fn, int s0, int s1, const KV& k_new,
                   const VV& v_new) {
    static_assert(
        Kokkos::is_view<KV>::value && Kokkos::is_view<VV>::value && KV::rank == 4 && VV::rank == 4,
        "BlockAttn: PagedKVCache::append takes rank-4 Views k_new, v_new (sequences, tokens, "
        "kv_heads, head_dim)");
    static_assert(std::is_same<typename KV::non_const_value_type, T>::value &&
                      std::is_same<typename VV::non_const_value_type, T>::value,
                  "BlockAttn: PagedKVCache::append: k_new and v_new must have the cache's value "
                  "type");
    check_append(fn, s0, s1, k_new, v_new);
    const index_type n = index_type(k_new.extent(1));
    if (n == 0) return;
    // Every check passed: copy the shared pages written into, take new ones.
    for (int s = s0; s < s1; ++s) {
      const index_type before = local_length(s);
      const index_type after = m_placement.local_count(length(s) + n, m_rank, m_size);
      m_released[std::size_t(s)] = false;
      if (after == before) continue;
      bool changed = false;
      if (before % m_page_size != 0) {
        const std::size_t p = std::size_t(before / m_page_size);
        const int shared = m_table_host(std::size_t(s), p);
        if (m_refs[std::size_t(shared)] > 1) {
          const int page = take_page();
          for (int g = 0; g < kv_heads(); ++g) {  // each kv head's slots are adjacent
            const auto all = Kokkos::ALL;
            Kokkos::deep_copy(exec, Kokkos::subview(m_k, g, page, all, all),
                              Kokkos::subview(m_k, g, shared, all, all));
            Kokkos::deep_copy(exec, Kokkos::subview(m_v, g, page, all, all),
                              Kokkos::subview(m_v, g, shared, all, all));
            if (quantized) {
              Kokkos::deep_copy(exec, Kokkos::subview(m_ks, g, page, all),
                                Kokkos::subview(m_ks, g, shared, all));
              Kokkos::deep_copy(exec, Kokkos::subview(m_vs, g, page, all),
                                Kokkos::subview(m_vs, g, shared, all));
            }
          }
          --m_refs[std::size_t(shared)];
          m_table_host(std::size_t(s), p) = page;
          changed = true;
        }
      }
      const int want = int((after + m_page_size - 1) / m_page_size);
      for (int& held = m_held[std::size_t(s)]; held < want; ++held) {
        m_table_host(std::size_t(s), std::size_t(held)) = take_page();
        changed = true;
      }
      if (changed) copy_table_row(s);
    }
    using mem = memory_space;
    const Kokkos::View<const T****, Kokkos::LayoutStride, mem,
                       Kokkos::MemoryTraits<Kokkos::Unmanaged>>
        kn(k_new), vn(v_new);
    Kokkos::View<index_type*, Kokkos::HostSpace> start_h("blockattn::paged_start", s1 - s0);
    for (int s = s0; s < s1; ++s) start_h(s - s0) = m_length[std::size_t(s)];
    const auto start = Kokkos::create_mirror_view_and_copy(mem(), start_h);
    impl::PagedSlots<storage_type, scale_storage_type, table_type> dest{m_k,  m_v,     m_ks,
                                                                        m_vs, m_table, m_shift};
    impl::kv_cache_append(exec, dest, kn, vn, start, m_placement, m_rank, m_size, s0, n);
    exec.fence();  // start_h / start are freed here
    for (int s = s0; s < s1; ++s) {
      m_length[std::size_t(s)] += n;
      m_local_host(std::size_t(s)) =
          int(m_placement.local_count(m_length[std::size_t(s)], m_rank, m_size));
    }
    Kokkos::deep_copy(m_local, m_local_host);
  }
  /// The lowest free page (m_free is a min-heap).
  int take_page() {
    std::pop_heap(m_free.begin(), m_free.end(), std::greater<int>());
    const int p = m_free.back();
    m_free.pop_back();
    m_refs[std::size_t(p)] = 1;
    return p;
  }
  void give_page(int p) {
    m_free.push_back(p);
    std::push_heap(m_free.begin(), m_free.end(), std::greater<int>());
  }
};

}  // namespace blockattn
