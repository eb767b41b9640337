// SPDX-License-Identifier: Apache-2.0
// A KV cache sharded across ranks, for serving: each rank stores the keys and
// values of the tokens a placement policy gives it, for a batch of sequences;
// positions stay global, so every mask applies unchanged.
//
// A placement policy is a small, trivially copyable struct (as partitions
// are) with
//   KOKKOS_FUNCTION int owner(index_type t, int P) const;        rank of token t
//   KOKKOS_FUNCTION index_type slot(index_type t, int P) const;  its slot there
//   KOKKOS_FUNCTION index_type position(index_type s, int rank, int P) const;
//                                       the token in slot s of rank (increasing in s)
//   index_type local_count(index_type n, int rank, int P) const; tokens of [0, n) on rank
//   index_type local_capacity(index_type n, int P) const;        slots rank needs for n tokens
//   std::array<std::int64_t, 2> parameters() const;              compared across ranks
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/core/quant.hpp>
#include <blockattn/distributed/impl/consensus.hpp>
#include <blockattn/kernel/tile_shape.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace blockattn {

/// Tokens dealt to the ranks in blocks of `interleave` (vLLM's decode context
/// parallelism with interleave 1: token t on rank t mod P). Every rank's
/// share grows as the sequence grows: decode work stays balanced.
struct RoundRobinPlacement {
  index_type interleave = 1;

  KOKKOS_INLINE_FUNCTION int owner(index_type t, int P) const { return int((t / interleave) % P); }
  KOKKOS_INLINE_FUNCTION index_type slot(index_type t, int P) const {
    return (t / (interleave * P)) * interleave + t % interleave;
  }
  KOKKOS_INLINE_FUNCTION index_type position(index_type s, int rank, int P) const {
    return (s / interleave) * interleave * P + index_type(rank) * interleave + s % interleave;
  }
  index_type local_count(index_type n, int rank, int P) const {
    const index_type round = interleave * P;
    const index_type rest = n % round - index_type(rank) * interleave;
    return n / round * interleave + std::min(interleave, std::max<index_type>(0, rest));
  }
  index_type local_capacity(index_type n, int P) const { return local_count(n, 0, P); }
  std::array<std::int64_t, 2> parameters() const { return {{1, interleave}}; }
};

/// Rank r holds tokens [r * tokens_per_rank, (r + 1) * tokens_per_rank): the
/// sequence fills rank 0 first (a prefill that lands where it is computed;
/// decode work sits on the last filled rank).
struct ContiguousPlacement {
  index_type tokens_per_rank = 1;

  KOKKOS_INLINE_FUNCTION int owner(index_type t, int) const { return int(t / tokens_per_rank); }
  KOKKOS_INLINE_FUNCTION index_type slot(index_type t, int) const { return t % tokens_per_rank; }
  KOKKOS_INLINE_FUNCTION index_type position(index_type s, int rank, int) const {
    return index_type(rank) * tokens_per_rank + s;
  }
  index_type local_count(index_type n, int rank, int) const {
    return std::min(tokens_per_rank,
                    std::max<index_type>(0, n - index_type(rank) * tokens_per_rank));
  }
  index_type local_capacity(index_type n, int) const { return std::min(tokens_per_rank, n); }
  std::array<std::int64_t, 2> parameters() const { return {{2, tokens_per_rank}}; }
};

/// Slot -> global position on one rank: the key position map of its shard.
template <class Placement>
struct PlacementPositions {
  Placement placement;
  int rank = 0, size = 1;
  KOKKOS_INLINE_FUNCTION index_type operator()(index_type s) const {
    return placement.position(s, rank, size);
  }
};

namespace impl {
template <class P, class = void>
struct is_placement : std::false_type {};
template <class P>
struct is_placement<P,
                    std::void_t<decltype(std::declval<const P&>().owner(index_type{}, 1)),
                                decltype(std::declval<const P&>().slot(index_type{}, 1)),
                                decltype(std::declval<const P&>().position(index_type{}, 0, 1)),
                                decltype(std::declval<const P&>().local_count(index_type{}, 0, 1)),
                                decltype(std::declval<const P&>().local_capacity(index_type{}, 1)),
                                decltype(std::declval<const P&>().parameters())>>
    : std::is_trivially_copyable<P> {};

/// The append kernel (a free function: nvcc takes no extended lambda in a
/// private member): token t of batch row b goes to sequence s0 + b at
/// position start(b) + t, on the rank that owns that position. One (b, t,
/// kv head) row at a time (its position, owner and slot computed once), its
/// head_dim elements by the vector lanes: the first version decoded the
/// indices per element (three 64-bit divisions and the placement's per
/// element) and appended 131 072 bf16 tokens (2 kv heads, D = 128) at 0.42
/// GB/s on a 2-core Zen 4.
/// `dest` says where slot `slot` of sequence `seq`, kv head g goes:
/// dest.k(seq, g, slot), dest.v(seq, g, slot) (pointers to head_dim values).
template <class ExecSpace, class Dest, class New, class Start, class Placement>
void kv_cache_append(const ExecSpace& exec, const Dest& dest, const New& kn, const New& vn,
                     const Start& start, const Placement& pl, int rank, int P, int s0,
                     index_type n) {
  const int H = int(kn.extent(2)), D = int(kn.extent(3));
  const std::int64_t rows = std::int64_t(kn.extent(0)) * n * H;
  if (rows == 0) return;
  constexpr int per_team = 16;  // rows of one team
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  using member = typename Policy::member_type;
  const int leagues = int((rows + per_team - 1) / per_team);
  const Policy policy = is_host_space_v<ExecSpace> ? Policy(exec, leagues, 1)
                                                   : Policy(exec, leagues, Kokkos::AUTO, 32);
  Kokkos::parallel_for(
      "blockattn::kv_cache_append", policy, KOKKOS_LAMBDA(const member& m) {
        const std::int64_t r0 = std::int64_t(m.league_rank()) * per_team;
        const int nr = int(rows - r0 < per_team ? rows - r0 : per_team);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(m, nr), [&](const int i) {
          const std::int64_t r = r0 + i;
          const int g = int(r % H);
          const index_type t = (r / H) % n;
          const int b = int(r / (std::int64_t(H) * n));
          const index_type pos = start(b) + t;
          if (pl.owner(pos, P) != rank) return;
          const index_type slot = pl.slot(pos, P);
          // The row's addresses once, then plain pointers: the vector
          // lambda over views did the views' index arithmetic per element
          // and GCC -O2 did not inline it (a call per element: 8x slower
          // than -O3).
          const auto* const ks = &kn(b, int(t), g, 0);
          const auto* const vs = &vn(b, int(t), g, 0);
          const std::ptrdiff_t sk = std::ptrdiff_t(kn.stride(3)), sv = std::ptrdiff_t(vn.stride(3));
          dest.put(m, s0 + b, g, slot, ks, sk, vs, sv, D);
        });
      });
}
/// One row of D values x(d * st) into the cache: copied, or (8-bit
/// storage) its scale (quant_scale of the finite values' max) into *scale
/// and its codes into out.
template <class Member, class S, class In>
KOKKOS_INLINE_FUNCTION void store_row(const Member& m, S* out, float* scale, const In* x,
                                      std::ptrdiff_t st, int D) {
  if constexpr (!is_kv_quant_v<S>) {
    (void)scale;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(m, D), [&](const int d) { out[d] = x[d * st]; });
  } else {
    float amax = 0.0f;
    int bad = 0;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(m, D),
        [&](const int d, float& mx) {
          const float a = float(x[d * st]) < 0.0f ? -float(x[d * st]) : float(x[d * st]);
          if (a <= 3.402823466e38f && a > mx) mx = a;  // finite values only
        },
        Kokkos::Max<float>(amax));
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(m, D),
        [&](const int d, int& n) {
          const float a = float(x[d * st]);
          n += (a - a) != 0.0f ? 1 : 0;  // NaN for NaN and +-inf
        },
        bad);
    const float s = quant_scale<S>(amax, bad > 0);
    Kokkos::single(Kokkos::PerThread(m), [&] { *scale = s; });
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(m, D),
                         [&](const int d) { out[d] = quantize<S>(float(x[d * st]) / s); });
  }
}

/// The shape checks of an append of k_new, v_new (sequences, tokens,
/// kv_heads, head_dim) to `sequences` sequences of a cache with `kv_heads`
/// kv heads of head dim `dim` (KVCache's and PagedKVCache's check_append).
template <class ExecSpace, class KV, class VV>
void check_append_shapes(const char* fn, int sequences, int kv_heads, int dim, const KV& k_new,
                         const VV& v_new, const char* k_name, const char* v_name) {
  require_accessible<ExecSpace, typename KV::memory_space>(fn, k_name);
  require_accessible<ExecSpace, typename VV::memory_space>(fn, v_name);
  const char* names[4] = {"sequences", "tokens", "kv_heads", "head_dim"};
  const std::size_t want[4] = {std::size_t(sequences), k_new.extent(1), std::size_t(kv_heads),
                               std::size_t(dim)};
  for (int d = 0; d < 4; ++d) {
    require_extent(fn, k_name, k_new, d, names[d], want[d],
                   d == 0 ? "the sequences appended to" : "the cache's");
    require_extent(fn, v_name, v_new, d, names[d], want[d],
                   d == 0 ? "the sequences appended to" : "the cache's");
  }
}

/// The destination of KVCache's appends: slot `slot` of (seq, g) in its
/// (sequence, kv_head, slot, head_dim) storage (and (sequence, kv_head, slot)
/// scales of 8-bit storage).
template <class Storage, class Scales>
struct ContiguousSlots {
  Storage kc, vc;
  Scales ks, vs;
  template <class Member, class In>
  KOKKOS_INLINE_FUNCTION void put(const Member& m, int seq, int g, index_type slot, const In* k,
                                  std::ptrdiff_t sk, const In* v, std::ptrdiff_t sv, int D) const {
    float* const ksp = ks.data() ? &ks(seq, g, slot) : nullptr;
    float* const vsp = vs.data() ? &vs(seq, g, slot) : nullptr;
    store_row(m, &kc(seq, g, slot, 0), ksp, k, sk, D);
    store_row(m, &vc(seq, g, slot, 0), vsp, v, sv, D);
  }
};
}  // namespace impl

/// The keys and values of `sequences` sequences on this rank: the tokens the
/// placement gives it, `capacity` slots per sequence, stored heads-major
/// (sequence, kv_head, slot, head_dim) so that decode streams each head's
/// keys; keys() and values() show them as (sequence, slot, kv_head,
/// head_dim), the library's order. T: float, double, bf16 or fp16 (16 bits
/// halve the cache; decode computes in fp32).
template <class T, class ExecSpace = Kokkos::DefaultExecutionSpace,
          class Placement = RoundRobinPlacement, class Storage = T>
class KVCache {
  static_assert(is_value_type_v<T>,
                "BlockAttn: KVCache's value type must be float, double, blockattn::bf16 or "
                "blockattn::fp16");
  static_assert(std::is_same<Storage, T>::value ||
                    (is_kv_quant_v<Storage> && !std::is_same<T, double>::value),
                "BlockAttn: KVCache's Storage is its value type, or (float, bf16, fp16 values) "
                "blockattn::fp8_e4m3, blockattn::fp8_e5m2 or std::int8_t with a scale per row");
  static_assert(impl::is_placement<Placement>::value,
                "BlockAttn: a placement policy needs owner(t, P), slot(t, P), position(s, rank, "
                "P), local_count(n, rank, P), local_capacity(n, P) and parameters() (see "
                "blockattn/distributed/kv_cache.hpp)");

 public:
  using value_type = T;
  using execution_space = ExecSpace;
  using memory_space = typename ExecSpace::memory_space;
  using placement_type = Placement;
  /// What a slot holds: T, or 8-bit codes with a scale per (slot, kv head).
  using stored_type = Storage;
  static constexpr bool quantized = is_kv_quant_v<Storage>;
  using view_type = Kokkos::View<Storage****, Kokkos::LayoutStride, memory_space>;
  using storage_type = Kokkos::View<Storage****, Kokkos::LayoutRight, memory_space>;
  using scale_view_type = Kokkos::View<float***, Kokkos::LayoutStride, memory_space>;
  using scale_storage_type = Kokkos::View<float***, Kokkos::LayoutRight, memory_space>;

  /// The shard of rank `rank` of `size`: `capacity` slots per sequence (for a
  /// longest sequence of n tokens: placement.local_capacity(n, size)).
  KVCache(int rank, int size, int sequences, index_type capacity, int kv_heads, int dim,
          const Placement& placement = {})
      : m_rank(rank), m_size(size), m_placement(placement) {
    const char* fn = "KVCache";
    if (size < 1 || rank < 0 || rank >= size)
      impl::fail(fn, "rank ", rank, " of size ", size, ", expected 0 <= rank < size");
    if (sequences < 1) impl::fail(fn, "argument 'sequences' = ", sequences, ", expected >= 1");
    if (kv_heads < 1) impl::fail(fn, "argument 'kv_heads' = ", kv_heads, ", expected >= 1");
    if (dim < 1 || dim > 256)
      impl::fail(fn, "argument 'dim' = ", dim, ", expected 1 .. 256 (the largest head dim)");
    if (capacity < 1 || capacity > index_type(std::numeric_limits<int>::max() / 2))
      impl::fail(fn, "argument 'capacity' = ", capacity, ", expected 1 .. ",
                 std::numeric_limits<int>::max() / 2, " slots per sequence");
    check_placement(fn);
    m_k = storage_type(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::kv_cache_k"),
                       sequences, kv_heads, capacity, dim);
    m_v = storage_type(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::kv_cache_v"),
                       sequences, kv_heads, capacity, dim);
    if (quantized) {
      m_ks = scale_storage_type("blockattn::kv_cache_k_scales", sequences, kv_heads, capacity);
      m_vs = scale_storage_type("blockattn::kv_cache_v_scales", sequences, kv_heads, capacity);
    }
    m_local = Kokkos::View<int*, memory_space>("blockattn::kv_cache_lengths", sequences);
    m_local_host = Kokkos::create_mirror_view(m_local);
    m_length.assign(std::size_t(sequences), 0);
  }
  /// The shard of comm's rank.
  template <class Comm, class = std::enable_if_t<is_communicator_v<Comm>>>
  KVCache(const Comm& comm, int sequences, index_type capacity, int kv_heads, int dim,
          const Placement& placement = {})
      : KVCache(comm.rank(), comm.size(), sequences, capacity, kv_heads, dim, placement) {}

  int rank() const { return m_rank; }
  int size() const { return m_size; }
  int sequences() const { return int(m_k.extent(0)); }
  int kv_heads() const { return int(m_k.extent(1)); }
  index_type capacity() const { return index_type(m_k.extent(2)); }
  int dim() const { return int(m_k.extent(3)); }
  const Placement& placement() const { return m_placement; }
  /// Bytes of this rank's K and V storage (and scales).
  std::int64_t bytes() const {
    return 2 * std::int64_t(m_k.span()) * std::int64_t(sizeof(Storage)) +
           2 * std::int64_t(m_ks.span()) * 4;
  }

  /// Tokens of sequence `seq` (all ranks together).
  index_type length(int seq) const { return m_length.at(std::size_t(seq)); }
  /// Of them, the ones in this rank's shard (slots 0 .. local_length - 1).
  int local_length(int seq) const { return m_local_host(std::size_t(seq)); }
  /// The longest shard of this rank's sequences.
  int max_local_length() const {
    int m = 0;
    for (int s = 0; s < sequences(); ++s) m = std::max(m, local_length(s));
    return m;
  }
  /// (sequence, slot, kv_head, head_dim) views of the shard's keys and values.
  view_type keys() const { return as_view(m_k); }
  view_type values() const { return as_view(m_v); }
  /// 8-bit storage: the (sequence, slot, kv_head) scales of the keys' and
  /// values' rows (empty otherwise).
  scale_view_type k_scales() const { return as_scales(m_ks); }
  scale_view_type v_scales() const { return as_scales(m_vs); }
  /// Local lengths per sequence, in the cache's memory space.
  const Kokkos::View<int*, memory_space>& local_lengths() const { return m_local; }
  /// Slot -> global position of this rank's shard.
  PlacementPositions<Placement> positions() const { return {m_placement, m_rank, m_size}; }

  /// Appends `k_new.extent(1)` tokens to every sequence: k_new, v_new are
  /// (sequences, tokens, kv_heads, head_dim), the same on every rank (each
  /// rank keeps the tokens it owns). Throws, on every rank alike, when a
  /// shard would overflow.
  template <class KV, class VV>
  void append(const ExecSpace& exec, const KV& k_new, const VV& v_new) {
    append_rows(exec, "KVCache::append", 0, sequences(), k_new, v_new);
  }
  /// Appends `k_new.extent(1)` tokens to sequence `seq` (k_new, v_new:
  /// (1, tokens, kv_heads, head_dim)).
  template <class KV, class VV>
  void append(const ExecSpace& exec, int seq, const KV& k_new, const VV& v_new) {
    if (seq < 0 || seq >= sequences())
      impl::fail("KVCache::append", "argument 'seq' = ", seq, ", expected 0 .. ", sequences() - 1);
    append_rows(exec, "KVCache::append", seq, seq + 1, k_new, v_new);
  }
  /// Why `n` more tokens of sequence `seq` do not fit, or "" when they do
  /// (the same answer on every rank: lengths and capacities are global).
  std::string overflow(int seq, index_type n) const {
    const index_type after = m_length.at(std::size_t(seq)) + n;
    for (int r = 0; r < m_size; ++r) {
      const int last = m_placement.owner(after - 1, m_size);
      if (m_placement.local_count(after, r, m_size) > capacity() || last < 0 || last >= m_size) {
        std::ostringstream m;
        m << "sequence " << seq << " would hold " << after << " tokens; rank " << r
          << "'s shard holds at most " << capacity() << " slots per sequence ("
          << impl::type_name<Placement>() << ", P = " << m_size
          << "); expected at most the tokens that fit: clear() the sequence or build the cache "
             "with a larger capacity";
        return m.str();
      }
    }
    return "";
  }

  /// The checks of an append of k_new, v_new to sequences [s0, s1), without
  /// appending: their shapes (this rank's) and the capacity (the same on every
  /// rank). Throws invalid_argument naming `fn` and the arguments `k_name`,
  /// `v_name`.
  template <class KV, class VV>
  void check_append(const char* fn, int s0, int s1, const KV& k_new, const VV& v_new,
                    const char* k_name = "k_new", const char* v_name = "v_new") const {
    impl::check_append_shapes<ExecSpace>(fn, s1 - s0, kv_heads(), dim(), k_new, v_new, k_name,
                                         v_name);
    // The same check on every rank (lengths are global): every shard must fit.
    for (int s = s0; s < s1 && k_new.extent(1) > 0; ++s) {
      const std::string full = overflow(s, index_type(k_new.extent(1)));
      if (!full.empty()) impl::fail(fn, full);
    }
  }

  /// Forgets sequence `seq`'s tokens (its slots are reused).
  void clear(int seq) {
    if (seq < 0 || seq >= sequences())
      impl::fail("KVCache::clear", "argument 'seq' = ", seq, ", expected 0 .. ", sequences() - 1);
    m_length[std::size_t(seq)] = 0;
    m_local_host(std::size_t(seq)) = 0;
    Kokkos::deep_copy(m_local, m_local_host);
  }
  void clear() {
    for (int s = 0; s < sequences(); ++s) clear(s);
  }

 private:
  int m_rank = 0, m_size = 1;
  Placement m_placement;
  storage_type m_k, m_v;
  scale_storage_type m_ks, m_vs;
  Kokkos::View<int*, memory_space> m_local;
  typename Kokkos::View<int*, memory_space>::HostMirror m_local_host;
  std::vector<index_type> m_length;

  static view_type as_view(const storage_type& s) {
    const Kokkos::LayoutStride l(s.extent(0), s.stride(0), s.extent(2), s.stride(2), s.extent(1),
                                 s.stride(1), s.extent(3), s.stride(3));
    return view_type(s.data(), l);
  }
  static scale_view_type as_scales(const scale_storage_type& s) {
    const Kokkos::LayoutStride l(s.extent(0), s.stride(0), s.extent(2), s.stride(2), s.extent(1),
                                 s.stride(1));
    return scale_view_type(s.data(), l);
  }

  void check_placement(const char* fn) const {
    // The map's contract on the first slots (cheap, catches a wrong policy early).
    for (index_type t = 0; t < 4 * m_size; ++t) {
      const int r = m_placement.owner(t, m_size);
      if (r < 0 || r >= m_size) continue;  // beyond a contiguous placement's reach
      if (m_placement.position(m_placement.slot(t, m_size), r, m_size) != t)
        impl::fail(fn, "placement ", impl::type_name<Placement>(),
                   ": position(slot(t), owner(t)) != t for t = ", t,
                   "; expected a placement whose position() inverts slot()");
    }
  }

  template <class KV, class VV>
  void append_rows(const ExecSpace& exec, const char* fn, int s0, int s1, const KV& k_new,
                   const VV& v_new) {
    static_assert(
        Kokkos::is_view<KV>::value && Kokkos::is_view<VV>::value && KV::rank == 4 && VV::rank == 4,
        "BlockAttn: KVCache::append takes rank-4 Views k_new, v_new (sequences, "
        "tokens, kv_heads, head_dim)");
    static_assert(std::is_same<typename KV::non_const_value_type, T>::value &&
                      std::is_same<typename VV::non_const_value_type, T>::value,
                  "BlockAttn: KVCache::append: k_new and v_new must have the cache's value type");
    check_append(fn, s0, s1, k_new, v_new);
    const index_type n = index_type(k_new.extent(1));
    if (n == 0) return;
    using mem = memory_space;
    const Kokkos::View<const T****, Kokkos::LayoutStride, mem,
                       Kokkos::MemoryTraits<Kokkos::Unmanaged>>
        kn(k_new), vn(v_new);
    const Placement pl = m_placement;
    const int rank = m_rank, P = m_size;
    Kokkos::View<index_type*, Kokkos::HostSpace> start_h("blockattn::kv_cache_start", s1 - s0);
    for (int s = s0; s < s1; ++s) start_h(s - s0) = m_length[std::size_t(s)];
    const auto start = Kokkos::create_mirror_view_and_copy(mem(), start_h);
    impl::kv_cache_append(
        exec, impl::ContiguousSlots<storage_type, scale_storage_type>{m_k, m_v, m_ks, m_vs}, kn, vn,
        start, pl, rank, P, s0, n);
    exec.fence();  // start_h / start are freed here
    for (int s = s0; s < s1; ++s) {
      m_length[std::size_t(s)] += n;
      m_local_host(std::size_t(s)) =
          int(m_placement.local_count(m_length[std::size_t(s)], m_rank, m_size));
    }
    Kokkos::deep_copy(m_local, m_local_host);
  }
};

}  // namespace blockattn
