// SPDX-License-Identifier: Apache-2.0
// A partition computed at run time: a table of the global positions each rank
// holds (any lengths, any order between ranks), e.g. the mask-aware or
// per-document head-tail layouts of blockattn/plan/balance.hpp.
//
//   const auto layout = blockattn::plan::mask_balanced(mask, N, P, 512, 64, 64);
//   blockattn::TablePartition<> part(layout.ranks);   // every rank builds the same table
//   blockattn::DistributedAttention<blockattn::TablePartition<>, Mask, blockattn::RingSchedule,
//                                   Comm, Exec> attn(comm, part, mask);
//   blockattn::to_local(part, Exec{}, P, rank, global_q, local_q);
//
// The table lives twice: in MemorySpace (the kernels read a rank's positions
// there) and on the host (the schedules classify blocks on the host), like
// Documents. Copies share both; keep one alive while a driver or a position
// map of it is in use, and destroy it before Kokkos::finalize(). The ranks
// must build the same table: the drivers compare its parameters() (N, P and a
// 64-bit hash of the positions) in their one consensus collective, and a
// table of another N or P than the call's is an error naming both.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/policy/partition.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace blockattn {

/// Position map of a TablePartition rank: its positions in host memory and
/// in the execution space's memory (the same numbers).
struct TablePositions {
  const index_type* host = nullptr;
  const index_type* device = nullptr;
  KOKKOS_INLINE_FUNCTION index_type operator()(index_type i) const {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__) || defined(__SYCL_DEVICE_ONLY__)
    return device[i];
#else
    return host[i];
#endif
  }
};

/// Rank r holds the positions ranks[r], strictly increasing; the ranks
/// together hold 0 .. N-1 once (N = the number of entries). A rank may hold
/// none. The constructor checks this and throws naming the first offending
/// entry.
template <class MemorySpace = typename Kokkos::DefaultExecutionSpace::memory_space>
class TablePartition {
 public:
  using memory_space = MemorySpace;
  using position_map = TablePositions;
  static constexpr const char* name() { return "table"; }
  index_type multiple_of(int) const { return 1; }

  explicit TablePartition(const std::vector<std::vector<index_type>>& ranks) {
    const char* fn = "TablePartition";
    if (ranks.empty()) impl::fail(fn, "argument 'ranks' is empty, expected at least 1 rank");
    auto h = std::make_shared<Host>();
    h->P = int(ranks.size());
    h->start.push_back(0);
    for (const auto& r : ranks) h->start.push_back(h->start.back() + index_type(r.size()));
    h->N = h->start.back();
    if (h->N < 1) impl::fail(fn, "argument 'ranks' holds no position, expected at least 1 token");
    h->positions.reserve(std::size_t(h->N));
    h->owner.assign(std::size_t(h->N), Owner{-1, 0});
    for (int r = 0; r < h->P; ++r) {
      const auto& list = ranks[std::size_t(r)];
      for (std::size_t i = 0; i < list.size(); ++i) {
        const index_type t = list[i];
        if (t < 0 || t >= h->N)
          impl::fail(fn, "argument 'ranks': ranks[", r, "][", i, "] = ", t,
                     ", expected 0 <= position < N = ", h->N, " (the number of entries)");
        if (i > 0 && t <= list[i - 1])
          impl::fail(fn, "argument 'ranks': ranks[", r, "][", i, "] = ", t, " after ", list[i - 1],
                     ", expected strictly increasing positions on every rank (the kernels bound "
                     "a tile by its first and last row)");
        Owner& o = h->owner[std::size_t(t)];
        if (o.rank >= 0)
          impl::fail(fn, "argument 'ranks': ranks[", r, "][", i, "] = ", t, " is held by rank ",
                     o.rank, " too, expected every position 0 .. N-1 on exactly one rank");
        o = Owner{r, index_type(i)};
        h->positions.push_back(t);
      }
    }
    // FNV-1a over P and the positions rank by rank (the lengths follow from
    // where each list ends: a 0 ... separator is implied by P + 1 starts).
    std::uint64_t x = 14695981039346656037ull;
    const auto mix = [&](std::uint64_t v) {
      for (int b = 0; b < 8; ++b) {
        x ^= (v >> (8 * b)) & 0xffu;
        x *= 1099511628211ull;
      }
    };
    for (const index_type s : h->start) mix(std::uint64_t(s));
    for (const index_type t : h->positions) mix(std::uint64_t(t));
    h->hash = std::int64_t(x);
    m_device = Kokkos::View<index_type*, MemorySpace>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::table_partition"),
        std::size_t(h->N));
    Kokkos::deep_copy(
        m_device,
        Kokkos::View<const index_type*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(
            h->positions.data(), h->positions.size()));
    m_host = std::move(h);
  }

  /// The global length and the number of ranks of the table.
  index_type size() const { return m_host->N; }
  int ranks() const { return m_host->P; }

  /// Why a call of global length N over P ranks cannot use this table.
  std::string why_not(index_type N, int P) const {
    if (N == m_host->N && P == m_host->P) return {};
    return "the table partition holds N = " + std::to_string(m_host->N) +
           " tokens over P = " + std::to_string(m_host->P) +
           " ranks, but the call has N = " + std::to_string(N) +
           " tokens (the sum of the local lengths) over P = " + std::to_string(P) + " ranks";
  }
  index_type length(index_type, int, int rank) const {
    if (rank < 0 || rank >= m_host->P) return 0;
    return m_host->start[std::size_t(rank) + 1] - m_host->start[std::size_t(rank)];
  }
  position_map positions(index_type, int, int rank) const {
    const index_type s = rank >= 0 && rank < m_host->P ? m_host->start[std::size_t(rank)] : 0;
    return {m_host->positions.data() + s, m_device.data() + s};
  }
  Owner owner(index_type, int, index_type t) const {
    return t >= 0 && t < m_host->N ? m_host->owner[std::size_t(t)] : Owner{-1, 0};
  }
  /// What the ranks compare: N, P and a hash of the whole table.
  std::array<std::int64_t, 3> parameters() const {
    return {{m_host->N, std::int64_t(m_host->P), m_host->hash}};
  }

 private:
  struct Host {
    index_type N = 0;
    int P = 0;
    std::int64_t hash = 0;
    std::vector<index_type> positions;  // rank by rank
    std::vector<index_type> start;      // P + 1 entries: where each rank's positions begin
    std::vector<Owner> owner;           // global position -> (rank, local index)
  };
  std::shared_ptr<const Host> m_host;
  Kokkos::View<index_type*, MemorySpace> m_device;
};

}  // namespace blockattn
