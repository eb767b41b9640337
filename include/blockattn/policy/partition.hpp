// SPDX-License-Identifier: Apache-2.0
// Partition policies: which tokens of a global sequence of length N each of P
// ranks holds, in which local order.
//
// A partition policy is a struct with
//   static constexpr const char* name();
//   index_type multiple_of(int P) const;             // N a multiple of this: every rank
//                                                    // holds N / P tokens
//   using position_map = ...;                        // see positions.hpp (strictly increasing)
//   position_map positions(index_type N, int P, int rank) const;  // local i -> global position
//   Owner owner(index_type N, int P, index_type t) const;         // global t -> (rank, local i)
// and optionally
//   index_type length(index_type N, int P, int rank) const;       // tokens of `rank`
//   std::string why_not(index_type N, int P) const;  // non-empty: (N, P) is not this layout's
//   parameters() const;                              // numbers the ranks must agree on
// The members may be static (the built-ins are stateless: every function of
// this header also takes the type alone, e.g. local_length<Partition>(N, P, r))
// or members of an object the drivers hold (TablePartition: a table of
// positions computed at run time). With length(), any N >= 1 can be split
// over any P >= 1 and ranks may hold different numbers of tokens, none at all
// included (N < P); without it N must be a multiple of multiple_of(P) and
// every rank holds N / P tokens. The built-in partitions have length(). Local
// order follows global order (the map is strictly increasing), so a mask's
// tile classification stays meaningful.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/policy/positions.hpp>

#include <array>
#include <cstddef>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace blockattn {

/// Where a global token lives.
struct Owner {
  int rank = 0;
  index_type local = 0;
};

namespace impl {
/// N tokens cut into `parts` consecutive pieces whose lengths differ by at
/// most one (the first N mod parts pieces hold one more): where piece j
/// starts, how long it is, and which piece holds token t.
struct EvenCut {
  index_type N = 0, parts = 1;
  constexpr index_type base() const { return N / parts; }
  constexpr index_type extra() const { return N % parts; }
  constexpr index_type start(index_type j) const {
    return j * base() + (j < extra() ? j : extra());
  }
  constexpr index_type length(index_type j) const { return base() + (j < extra() ? 1 : 0); }
  constexpr index_type piece(index_type t) const {
    const index_type long_end = extra() * (base() + 1);  // tokens of the longer pieces
    return t < long_end ? t / (base() + 1) : extra() + (t - long_end) / base();
  }
};
}  // namespace impl

/// Ring Attention: rank r owns one contiguous chunk, [r N/P, (r+1) N/P) when P
/// divides N; otherwise the first N mod P ranks hold one token more.
struct ContiguousPartition {
  static constexpr const char* name() { return "contiguous"; }
  static index_type multiple_of(int P) { return P; }
  using position_map = OffsetPositions;
  static index_type length(index_type N, int P, int rank) {
    return impl::EvenCut{N, P}.length(rank);
  }
  static position_map positions(index_type N, int P, int rank) {
    return OffsetPositions{impl::EvenCut{N, P}.start(rank)};
  }
  static Owner owner(index_type N, int P, index_type t) {
    const impl::EvenCut c{N, P};
    const index_type j = c.piece(t);
    return Owner{static_cast<int>(j), t - c.start(j)};
  }
};

/// Striped Attention: token t lives on rank t mod P (arXiv:2311.09431, Figure 1).
struct StripedPartition {
  static constexpr const char* name() { return "striped"; }
  static index_type multiple_of(int P) { return P; }
  using position_map = StridedPositions;
  static index_type length(index_type N, int P, int rank) {
    return N > rank ? (N - 1 - rank) / P + 1 : 0;
  }
  static position_map positions(index_type, int P, int rank) { return StridedPositions{rank, P}; }
  static Owner owner(index_type, int P, index_type t) {
    return Owner{static_cast<int>(t % P), t / P};
  }
};

/// Position map of the zigzag partition: chunk `rank` then chunk `2P - 1 - rank`,
/// each of `chunk` tokens.
struct ZigzagPositions {
  index_type chunk = 1;
  index_type first = 0;   // global start of the first chunk
  index_type second = 0;  // global start of the second chunk
  KOKKOS_INLINE_FUNCTION constexpr index_type operator()(index_type i) const {
    return i < chunk ? first + i : second + (i - chunk);
  }
};

/// The zigzag map as the kernels run it (policy/positions.hpp).
constexpr AffinePositions canonical_positions(const ZigzagPositions& p) {
  return AffinePositions{p.chunk, p.first, p.second, 1};
}

/// Zigzag / head-tail: 2P chunks (equal when 2P divides N; otherwise the
/// first N mod 2P hold one token more); rank r owns chunks r and 2P - 1 - r,
/// so every rank holds one early and one late piece of a causal sequence.
struct ZigzagPartition {
  static constexpr const char* name() { return "zigzag"; }
  static index_type multiple_of(int P) { return 2 * index_type(P); }
  using position_map = ZigzagPositions;
  static index_type length(index_type N, int P, int rank) {
    const impl::EvenCut c{N, 2 * index_type(P)};
    return c.length(rank) + c.length(2 * index_type(P) - 1 - rank);
  }
  static position_map positions(index_type N, int P, int rank) {
    const impl::EvenCut c{N, 2 * index_type(P)};
    return ZigzagPositions{c.length(rank), c.start(rank), c.start(2 * index_type(P) - 1 - rank)};
  }
  static Owner owner(index_type N, int P, index_type t) {
    const impl::EvenCut c{N, 2 * index_type(P)};
    const index_type j = c.piece(t);
    if (j < P) return Owner{static_cast<int>(j), t - c.start(j)};
    const index_type r = 2 * index_type(P) - 1 - j;
    return Owner{static_cast<int>(r), c.length(r) + t - c.start(j)};
  }
};

namespace impl {
template <class P, class = void>
struct has_partition_members : std::false_type {};
template <class P>
struct has_partition_members<
    P, std::void_t<decltype(P::name()), decltype(std::declval<const P&>().multiple_of(1)),
                   typename P::position_map,
                   decltype(std::declval<const P&>().positions(index_type{}, 1, 0)),
                   decltype(std::declval<const P&>().owner(index_type{}, 1, index_type{}))>>
    : std::bool_constant<
          std::is_same<decltype(std::declval<const P&>().positions(index_type{}, 1, 0)),
                       typename P::position_map>::value &&
          std::is_same<decltype(std::declval<const P&>().owner(index_type{}, 1, index_type{})),
                       Owner>::value> {};

/// True when the partition's members are static (a stateless policy: the
/// type alone describes the layout).
template <class P, class = void>
struct is_stateless_partition : std::false_type {};
template <class P>
struct is_stateless_partition<P, std::void_t<decltype(P::positions(index_type{}, 1, 0)),
                                             decltype(P::owner(index_type{}, 1, index_type{}))>>
    : std::is_default_constructible<P> {};

/// Optional members: why_not(N, P) and parameters().
template <class P, class = void>
struct has_partition_why_not : std::false_type {};
template <class P>
struct has_partition_why_not<
    P, std::void_t<decltype(std::string(std::declval<const P&>().why_not(index_type{}, 1)))>>
    : std::true_type {};
}  // namespace impl

namespace impl {
template <class P, bool = has_partition_members<P>::value>
struct is_partition_policy : std::false_type {};
template <class P>
struct is_partition_policy<P, true> : is_position_map<typename P::position_map> {};
}  // namespace impl

/// True when P models the partition-policy concept described at the top of this file.
template <class P>
inline constexpr bool is_partition_policy_v = impl::is_partition_policy<P>::value;

namespace impl {
template <class P>
constexpr void check_partition_policy() {
  static_assert(has_partition_members<P>::value,
                "BlockAttn: a partition policy must have a static member name() and (static or "
                "const) members multiple_of(int P), positions(index_type N, int P, int rank) "
                "returning its `position_map`, and owner(index_type N, int P, index_type t) "
                "returning blockattn::Owner (see blockattn/policy/partition.hpp)");
}
}  // namespace impl

namespace impl {
template <class P, class = void>
struct has_partition_length : std::false_type {};
template <class P>
struct has_partition_length<
    P, std::void_t<decltype(std::declval<const P&>().length(index_type{}, 1, 0))>>
    : std::is_convertible<decltype(std::declval<const P&>().length(index_type{}, 1, 0)),
                          index_type> {};
}  // namespace impl

/// True when Partition splits any N >= 1 over any P >= 1 (it has length()).
template <class Partition>
inline constexpr bool splits_any_length_v = impl::has_partition_length<Partition>::value;

/// The number of tokens `rank` holds: partition.length(N, P, rank), or N / P
/// for a partition without length().
template <class Partition>
index_type local_length(const Partition& partition, index_type N, int P, int rank) {
  if constexpr (splits_any_length_v<Partition>)
    return index_type(partition.length(N, P, rank));
  else
    return N / P;
}
/// The same for a stateless partition (the type alone).
template <class Partition>
index_type local_length(index_type N, int P, int rank) {
  return local_length(Partition{}, N, P, rank);
}

/// The most tokens any rank holds.
template <class Partition>
index_type max_local_length(const Partition& partition, index_type N, int P) {
  index_type m = 0;
  for (int r = 0; r < P; ++r) {
    const index_type n = local_length(partition, N, P, r);
    m = n > m ? n : m;
  }
  return m;
}
template <class Partition>
index_type max_local_length(index_type N, int P) {
  return max_local_length(Partition{}, N, P);
}

/// Throws unless Partition gives every one of P ranks N / P tokens (for
/// code of your own that needs equal pieces; the drivers take any N).
template <class Partition>
void require_even_partition(const char* function, index_type N, int P) {
  impl::check_partition_policy<Partition>();
  if (P < 1) impl::fail(function, "communicator size is ", P, ", expected at least 1");
  const index_type m = Partition{}.multiple_of(P);
  if (N <= 0 || N % m != 0)
    impl::fail(function, "global sequence length N = ", N, " cannot be split by the ",
               Partition::name(), " partition over P = ", P,
               " ranks into equal parts: N must be a positive multiple of ", m);
}

/// Throws unless N can be split by the partition over P ranks: any N >= 1
/// for a partition with length(), a positive multiple of multiple_of(P)
/// otherwise; and not when its why_not(N, P) says why (a table of one N, P).
template <class Partition>
void require_partitionable(const Partition& partition, const char* function, index_type N, int P) {
  impl::check_partition_policy<Partition>();
  if (P < 1) impl::fail(function, "communicator size is ", P, ", expected at least 1");
  if constexpr (splits_any_length_v<Partition>) {
    if (N < 1)
      impl::fail(function, "global sequence length N = ", N, ", expected at least 1 token");
  } else {
    const index_type m = partition.multiple_of(P);
    if (N <= 0 || N % m != 0)
      impl::fail(function, "global sequence length N = ", N, " cannot be split by the ",
                 Partition::name(), " partition over P = ", P,
                 " ranks: N must be a positive multiple of ", m,
                 " (give the partition a static length(N, P, rank) to allow any N)");
  }
  if constexpr (impl::has_partition_why_not<Partition>::value) {
    if (const std::string why = partition.why_not(N, P); !why.empty()) impl::fail(function, why);
  }
}
template <class Partition>
void require_partitionable(const char* function, index_type N, int P) {
  require_partitionable(Partition{}, function, N, P);
}

/// Checks the partition contract for (N, P) on the host: every rank's
/// position map is strictly increasing (the kernels bound the positions of a
/// tile by those of its first and last row), stays in [0, N), and owner()
/// inverts positions(), so that the ranks together hold every token of
/// 0 .. N-1 exactly once. O(N) host work, done once per (Partition, N, P)
/// and process for a stateless partition, on every call for an object;
/// throws naming the partition and the first offending token.
template <class Partition>
void check_partition_contract(const Partition& partition, const char* function, index_type N,
                              int P) {
  constexpr bool stateless = impl::is_stateless_partition<Partition>::value;
  static std::mutex mutex;
  static std::set<std::pair<index_type, int>> checked;
  if constexpr (stateless) {
    std::lock_guard<std::mutex> lock(mutex);
    if (checked.count({N, P})) return;
  }
  std::vector<int> holder(std::size_t(N), -1);
  index_type total = 0;
  for (int r = 0; r < P; ++r) {
    const index_type n = local_length(partition, N, P, r);
    if (n < 0 || n > N)
      impl::fail(function, "the ", Partition::name(), " partition (N = ", N, ", P = ", P,
                 "): length(N, P, ", r, ") = ", n, ", expected 0 <= length <= N");
    total += n;
    const auto map = partition.positions(N, P, r);
    index_type prev = 0;
    for (index_type i = 0; i < n; ++i) {
      const index_type t = map(i);
      const auto where = [&] {
        std::ostringstream s;
        s << "the " << Partition::name() << " partition (N = " << N << ", P = " << P
          << "): positions(N, P, " << r << ")(" << i << ") = " << t;
        return s.str();
      };
      if (t < 0 || t >= N) impl::fail(function, where(), ", expected 0 <= position < N");
      if (i > 0 && t <= prev)
        impl::fail(function, where(), " after ", prev, " for local index ", i - 1,
                   "; expected strictly increasing positions on every rank (the kernels bound "
                   "a tile by the positions of its first and last row; reorder the rank's "
                   "tokens by global position)");
      if (holder[std::size_t(t)] >= 0)
        impl::fail(function, where(), ", a position rank ", holder[std::size_t(t)],
                   " holds too; expected every global position on exactly one rank");
      holder[std::size_t(t)] = r;
      const Owner o = partition.owner(N, P, t);
      if (o.rank != r || o.local != i)
        impl::fail(function, where(), " but owner(N, P, ", t, ") = {rank ", o.rank, ", local ",
                   o.local, "}, expected {rank ", r, ", local ", i,
                   "}: owner() must invert positions()");
      prev = t;
    }
  }
  if (total != N)
    impl::fail(function, "the ", Partition::name(), " partition (N = ", N, ", P = ", P,
               "): the ranks hold ", total,
               " tokens together, expected N (every global "
               "position on exactly one rank)");
  if constexpr (stateless) {
    std::lock_guard<std::mutex> lock(mutex);
    checked.insert({N, P});
  }
}
template <class Partition>
void check_partition_contract(const char* function, index_type N, int P) {
  check_partition_contract(Partition{}, function, N, P);
}

/// Global positions of the local tokens of `rank` (e.g. position ids for RoPE).
template <class MemorySpace = Kokkos::HostSpace, class Partition>
Kokkos::View<index_type*, MemorySpace> local_positions(const Partition& partition, index_type N,
                                                       int P, int rank) {
  require_partitionable(partition, "local_positions", N, P);
  check_partition_contract(partition, "local_positions", N, P);
  if (rank < 0 || rank >= P)
    impl::fail("local_positions", "rank = ", rank, ", expected 0 <= rank < ", P);
  const index_type n = local_length(partition, N, P, rank);
  Kokkos::View<index_type*, MemorySpace> ids("blockattn::position_ids", n);
  auto h = Kokkos::create_mirror_view(ids);
  const auto map = partition.positions(N, P, rank);
  for (index_type i = 0; i < n; ++i) h(i) = map(i);
  Kokkos::deep_copy(ids, h);
  return ids;
}
template <class Partition, class MemorySpace = Kokkos::HostSpace>
Kokkos::View<index_type*, MemorySpace> local_positions(index_type N, int P, int rank) {
  return local_positions<MemorySpace>(Partition{}, N, P, rank);
}

namespace impl {
/// The sequence dimension of the Views the permutation helpers take.
template <class View>
constexpr int seq_dim() {
  // rank 1: (seq); rank 2: (batch, seq); rank 3: (batch, heads, seq) like LSE;
  // rank 4: (batch, seq, heads, dim) like q, k, v, o.
  return View::rank == 3 ? 2 : (View::rank == 1 ? 0 : 1);
}

/// One work item per (outer index, local row); inner dimensions looped. A
/// functor rather than a lambda: nvcc's extended lambdas cannot first-capture
/// inside `if constexpr`.
template <bool ToLocal, class GV, class LV, class Map>
struct PermuteFunctor {
  GV global;
  LV local;
  Map map;
  index_type n_local;

  KOKKOS_INLINE_FUNCTION void operator()(const index_type w) const {
    const index_type i = w % n_local, a = w / n_local, g = map(i);
    if constexpr (GV::rank == 1) {
      if constexpr (ToLocal)
        local(i) = global(g);
      else
        global(g) = local(i);
    } else if constexpr (GV::rank == 2) {
      if constexpr (ToLocal)
        local(a, i) = global(a, g);
      else
        global(a, g) = local(a, i);
    } else if constexpr (GV::rank == 3) {
      for (std::size_t h = 0; h < global.extent(1); ++h) {
        if constexpr (ToLocal)
          local(a, h, i) = global(a, h, g);
        else
          global(a, h, g) = local(a, h, i);
      }
    } else {
      for (std::size_t h = 0; h < global.extent(2); ++h)
        for (std::size_t d = 0; d < global.extent(3); ++d) {
          if constexpr (ToLocal)
            local(a, i, h, d) = global(a, g, h, d);
          else
            global(a, g, h, d) = local(a, i, h, d);
        }
    }
  }
};

/// A View's extents as an array, read at compile-time indices (a run-time
/// index loop over extent(d) trips GCC 12's -Warray-bounds inside Kokkos 4's
/// mdspan extents when nvcc hands GCC its preprocessed host code, where
/// Kokkos' headers are no longer system headers).
template <class V, std::size_t... I>
std::array<std::size_t, sizeof...(I)> extents_of(const V& v, std::index_sequence<I...>) {
  return {{static_cast<std::size_t>(v.extent(I))...}};
}

/// The permutations' shape check: `local` has n_local tokens along the
/// sequence dimension sd and the extents of `global` elsewhere; `holds` names
/// how the expected token count is computed.
template <class GV, class LV>
void check_local_extents(const char* fn, const GV& global, const LV& local, int sd,
                         index_type n_local, const char* holds) {
  constexpr std::size_t rank_v = std::size_t(GV::rank);
  const auto global_ext = extents_of(global, std::make_index_sequence<rank_v>());
  const auto local_ext = extents_of(local, std::make_index_sequence<rank_v>());
  for (int d = 0; d < int(rank_v); ++d) {
    const std::size_t want = d == sd ? std::size_t(n_local) : global_ext[d];
    if (local_ext[d] != want)
      fail(fn, "argument 'local' has extent(", d, ") = ", local_ext[d], ", expected ", want,
           d == sd ? " (the tokens this rank holds: " : " (the same extent of 'global'",
           d == sd ? holds : "", ")");
  }
}

template <bool ToLocal, class Partition, class ExecSpace, class GV, class LV>
void permute(const char* fn, const Partition& partition, const ExecSpace& exec, int P, int rank,
             const GV& global, const LV& local) {
  static_assert(GV::rank == LV::rank && GV::rank >= 1 && GV::rank <= 4,
                "BlockAttn: the global and local Views must have the same rank (1 to 4)");
  constexpr int sd = seq_dim<GV>();
  const index_type N = static_cast<index_type>(global.extent(sd));
  require_partitionable(partition, fn, N, P);
  if (rank < 0 || rank >= P) fail(fn, "rank = ", rank, ", expected 0 <= rank < ", P);
  check_partition_contract(partition, fn, N, P);
  const index_type n_local = local_length(partition, N, P, rank);
  check_local_extents(fn, global, local, sd, n_local, "local_length<Partition>(N, P, rank)");
  const auto map = partition.positions(N, P, rank);
  const index_type outer = sd == 0 ? 1 : index_type(global.extent(0));
  if (n_local == 0) return;
  Kokkos::parallel_for(
      "blockattn::permute",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<index_type>>(exec, 0, outer * n_local),
      PermuteFunctor<ToLocal, GV, LV, std::decay_t<decltype(map)>>{global, local, map, n_local});
}
}  // namespace impl

/// Copies this rank's tokens of a global sequence into its local View.
/// Sequence dimension by rank: (seq), (batch, seq), (batch, heads, seq) as for
/// LSE, (batch, seq, heads, dim) as for q, k, v, o.
template <class Partition, class ExecSpace, class GV, class LV>
void to_local(const Partition& partition, const ExecSpace& exec, int P, int rank, const GV& global,
              const LV& local) {
  impl::permute<true>("to_local", partition, exec, P, rank, global, local);
}
template <class Partition, class ExecSpace, class GV, class LV>
void to_local(const ExecSpace& exec, int P, int rank, const GV& global, const LV& local) {
  impl::permute<true>("to_local", Partition{}, exec, P, rank, global, local);
}

/// Writes this rank's local tokens back to their places in a global View.
template <class Partition, class ExecSpace, class GV, class LV>
void from_local(const Partition& partition, const ExecSpace& exec, int P, int rank, const LV& local,
                const GV& global) {
  impl::permute<false>("from_local", partition, exec, P, rank, global, local);
}
template <class Partition, class ExecSpace, class GV, class LV>
void from_local(const ExecSpace& exec, int P, int rank, const LV& local, const GV& global) {
  impl::permute<false>("from_local", Partition{}, exec, P, rank, global, local);
}

}  // namespace blockattn
