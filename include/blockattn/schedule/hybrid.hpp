// SPDX-License-Identifier: Apache-2.0
// The description of the 2D hybrid schedule (head-parallel all-to-all inside
// groups x context-parallel ring across them: USP, arXiv:2405.07719;
// LoongTrain's 2D attention, arXiv:2406.18485): which rank sits where in the
// P = P_a x P_r grid, which tokens each rank holds, and how to copy a global
// sequence to and from that layout. The driver is HybridAttention
// (blockattn/distributed/hybrid.hpp); the planner reads the same description.
//
// Grid: rank r is member a = r mod P_a of group g = r / P_a. The P_a members
// of a group are consecutive ranks (place them on one node: the all-to-all
// runs on the fast links); the ring joins the P_r ranks of equal a.
//
// Layout: the partition splits the sequence over the P_r groups (as it splits
// it over P_r ranks for DistributedAttention); member a holds the a-th of P_a
// consecutive pieces of its group's tokens, in the partition's local order
// (equal pieces when P_a divides them, else the first pieces hold one token
// more). Any N >= 1 for a partition with length(); otherwise N must be split
// by the partition over P_r ranks into equal parts that P_a divides.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/policy/partition.hpp>
#include <blockattn/policy/positions.hpp>

#include <string>

namespace blockattn {

/// The shape of the P = P_a x P_r grid of HybridAttention.
struct HybridGrid {
  int P = 1;        // ranks
  int ulysses = 1;  // P_a: ranks per group (all-to-all over heads)
  int ring = 1;     // P_r: groups (the ring)
  int group(int rank) const { return rank / ulysses; }
  int member(int rank) const { return rank % ulysses; }
  int rank_of(int group, int member) const { return group * ulysses + member; }
  /// Empty when P ranks form groups of `ulysses`, else why not.
  static std::string why_not(int P, int ulysses) {
    if (ulysses < 1 || P < 1 || P % ulysses != 0)
      return "the all-to-all group size (ulysses) = " + std::to_string(ulysses) +
             " does not divide the number of ranks P = " + std::to_string(P) +
             " (expected P = ulysses x ring groups)";
    return {};
  }
  static HybridGrid make(int P, int ulysses) {
    HybridGrid g;
    g.P = P;
    g.ulysses = ulysses;
    g.ring = P / ulysses;
    return g;
  }
};

/// Position map of a hybrid rank: its group's map from the partition over the
/// P_r groups, starting at the member's piece.
template <class GroupMap>
struct HybridPositions {
  GroupMap group;
  index_type offset = 0;  // member x (tokens per rank)
  KOKKOS_INLINE_FUNCTION constexpr index_type operator()(index_type i) const {
    return group(offset + i);
  }
};

/// The tokens of ring group `group` (the partition's share over P_r groups).
template <class Partition>
index_type hybrid_group_length(index_type N, const HybridGrid& g, int group) {
  return local_length<Partition>(N, g.ring, group);
}

/// The tokens `rank` holds under the hybrid layout.
template <class Partition>
index_type hybrid_length(index_type N, const HybridGrid& g, int rank) {
  return impl::EvenCut{hybrid_group_length<Partition>(N, g, g.group(rank)), g.ulysses}.length(
      g.member(rank));
}

/// Empty when N can be laid out on the grid by Partition, else why not.
template <class Partition>
std::string hybrid_length_why_not(index_type N, const HybridGrid& g) {
  if constexpr (splits_any_length_v<Partition>) {
    if (N < 1)
      return "global sequence length N = " + std::to_string(N) + ", expected at least 1 token";
    return {};
  }
  const index_type m = Partition::multiple_of(g.ring);
  if (N <= 0 || N % m != 0)
    return "global sequence length N = " + std::to_string(N) + " cannot be split by the " +
           Partition::name() + " partition over the " + std::to_string(g.ring) +
           " ring groups: N must be a positive multiple of " + std::to_string(m);
  if ((N / g.ring) % g.ulysses != 0)
    return "global sequence length N = " + std::to_string(N) + ": a ring group's " +
           std::to_string(N / g.ring) + " tokens do not split into " + std::to_string(g.ulysses) +
           " equal pieces (expected N / ring a multiple of ulysses = " + std::to_string(g.ulysses) +
           ")";
  return {};
}

/// The global position of each local token of `rank` under the hybrid layout.
template <class Partition>
HybridPositions<typename Partition::position_map> hybrid_position_map(index_type N,
                                                                      const HybridGrid& g,
                                                                      int rank) {
  const impl::EvenCut piece{hybrid_group_length<Partition>(N, g, g.group(rank)), g.ulysses};
  return {Partition::positions(N, g.ring, g.group(rank)), piece.start(g.member(rank))};
}

namespace impl {
template <class Partition>
void require_hybrid_layout(const char* fn, index_type N, const HybridGrid& g, int rank) {
  if (const std::string why = HybridGrid::why_not(g.P, g.ulysses); !why.empty()) fail(fn, why);
  if (const std::string why = hybrid_length_why_not<Partition>(N, g); !why.empty()) fail(fn, why);
  if (rank < 0 || rank >= g.P) fail(fn, "rank = ", rank, ", expected 0 <= rank < ", g.P);
  check_partition_contract<Partition>(fn, N, g.ring);
}

template <bool ToLocal, class Partition, class ExecSpace, class GV, class LV>
void hybrid_permute(const char* fn, const ExecSpace& exec, const HybridGrid& g, int rank,
                    const GV& global, const LV& local) {
  static_assert(GV::rank == LV::rank && GV::rank >= 1 && GV::rank <= 4,
                "BlockAttn: the global and local Views must have the same rank (1 to 4)");
  constexpr int sd = seq_dim<GV>();
  const index_type N = static_cast<index_type>(global.extent(sd));
  require_hybrid_layout<Partition>(fn, N, g, rank);
  const index_type n_local = hybrid_length<Partition>(N, g, rank);
  check_local_extents(fn, global, local, sd, n_local, "hybrid_length<Partition>(N, grid, rank)");
  const auto map = hybrid_position_map<Partition>(N, g, rank);
  const index_type outer = sd == 0 ? 1 : index_type(global.extent(0));
  if (n_local == 0) return;
  Kokkos::parallel_for(
      "blockattn::hybrid_permute",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<index_type>>(exec, 0, outer * n_local),
      PermuteFunctor<ToLocal, GV, LV, std::decay_t<decltype(map)>>{global, local, map, n_local});
}
}  // namespace impl

/// Global positions of the local tokens of `rank` under HybridAttention's
/// layout (e.g. position ids for RoPE).
template <class Partition, class MemorySpace = Kokkos::HostSpace>
Kokkos::View<index_type*, MemorySpace> hybrid_local_positions(index_type N, const HybridGrid& g,
                                                              int rank) {
  impl::require_hybrid_layout<Partition>("hybrid_local_positions", N, g, rank);
  const index_type n = hybrid_length<Partition>(N, g, rank);
  Kokkos::View<index_type*, MemorySpace> ids("blockattn::position_ids", n);
  auto h = Kokkos::create_mirror_view(ids);
  const auto map = hybrid_position_map<Partition>(N, g, rank);
  for (index_type i = 0; i < n; ++i) h(i) = map(i);
  Kokkos::deep_copy(ids, h);
  return ids;
}

/// Copies this rank's tokens of a global sequence into its local View
/// (HybridAttention's layout; the Views as for to_local()).
template <class Partition, class ExecSpace, class GV, class LV>
void hybrid_to_local(const ExecSpace& exec, const HybridGrid& g, int rank, const GV& global,
                     const LV& local) {
  impl::hybrid_permute<true, Partition>("hybrid_to_local", exec, g, rank, global, local);
}

/// Writes this rank's local tokens back to their places in a global View.
template <class Partition, class ExecSpace, class GV, class LV>
void hybrid_from_local(const ExecSpace& exec, const HybridGrid& g, int rank, const LV& local,
                       const GV& global) {
  impl::hybrid_permute<false, Partition>("hybrid_from_local", exec, g, rank, global, local);
}

}  // namespace blockattn
