// SPDX-License-Identifier: Apache-2.0
// Work balance of token layouts under a mask: which global positions each
// rank holds (a Layout: any lengths), and what its queries cost against all
// N keys in the kernels' tiles (the kernels' own classifier, as in the
// planner). Under every schedule that moves K/V to the queries (ring,
// all-gather) a rank computes exactly its queries' tiles, so the slowest
// rank's cost over the mean (makespan / ideal) is the layout's compute
// imbalance.
//
// Layouts: the built-in partitions (layout_of<Partition>), per-document
// head-tail (PyTorch's _PerDocumentHeadTailLoadBalancer: every document cut
// into 2P pieces, rank r takes pieces r and 2P - 1 - r) and a mask-aware
// layout (mask_balanced: chunks of tokens weighed by the classifier and
// assigned largest first to the least loaded rank with room, every rank the
// same number of chunks). Plus a long-tailed document mix to compare them on.
//
//   const auto offsets = plan::long_tailed_documents(65536, seed);
//   const DocumentMask mask = plan::host_document_mask(offsets);
//   plan::Balance b = plan::balance_of(plan::mask_balanced(mask, 65536, 8, 512, 64, 64), mask,
//                                      64, 64);
//   b.makespan_over_ideal();
//
// Host only. A layout runs as a partition through TablePartition(layout.ranks)
// (blockattn/policy/table_partition.hpp): per-document head-tail gives ranks
// different lengths, and the mask-aware layout is computed at run time.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/kernel/work.hpp>
#include <blockattn/policy/document_mask.hpp>
#include <blockattn/policy/partition.hpp>
#include <blockattn/policy/positions.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace blockattn {
namespace plan {

/// Global positions per rank (each strictly increasing; together 0 .. N-1 once).
struct Layout {
  std::string name;
  index_type N = 0;
  std::vector<std::vector<index_type>> ranks;
  int P() const { return int(ranks.size()); }
};

/// The layout of a built-in (or any) partition policy.
template <class Partition>
Layout layout_of(index_type N, int P) {
  require_partitionable<Partition>("plan::layout_of", N, P);
  Layout l;
  l.name = Partition::name();
  l.N = N;
  l.ranks.resize(std::size_t(P));
  for (int r = 0; r < P; ++r) {
    const auto map = Partition::positions(N, P, r);
    const index_type n = local_length<Partition>(N, P, r);
    for (index_type i = 0; i < n; ++i) l.ranks[std::size_t(r)].push_back(map(i));
  }
  return l;
}

/// Per-document head-tail: document [a, b) is cut into 2P pieces of
/// floor / ceil (b - a) / 2P tokens; rank r takes pieces r and 2P - 1 - r of
/// every document (PyTorch's _PerDocumentHeadTailLoadBalancer). Ranks get
/// different lengths unless every document length is a multiple of 2P.
inline Layout per_document_zigzag(const std::vector<index_type>& offsets, int P) {
  if (P < 1) impl::fail("plan::per_document_zigzag", "P = ", P, ", expected at least 1");
  if (offsets.size() < 2 || offsets.front() != 0)
    impl::fail("plan::per_document_zigzag",
               "argument 'offsets' must start at 0 and hold documents + 1 entries");
  Layout l;
  l.name = "per-doc zigzag";
  l.N = offsets.back();
  l.ranks.resize(std::size_t(P));
  const index_type pieces = 2 * index_type(P);
  for (std::size_t d = 0; d + 1 < offsets.size(); ++d) {
    const index_type a = offsets[d], len = offsets[d + 1] - a;
    const auto piece = [&](index_type k) {  // [begin, end) of piece k
      return std::make_pair(a + len * k / pieces, a + len * (k + 1) / pieces);
    };
    for (int r = 0; r < P; ++r)
      for (index_type k : {index_type(r), pieces - 1 - r}) {
        const auto [b, e] = piece(k);
        for (index_type t = b; t < e; ++t) l.ranks[std::size_t(r)].push_back(t);
      }
  }
  for (auto& r : l.ranks) std::sort(r.begin(), r.end());
  return l;
}

/// A causal document mask over host offsets (cu_seqlens), for the analyses
/// here; it points into `offsets`, which must outlive it. (Documents owns
/// its offsets in an execution space's memory, for the kernels.)
inline DocumentMask host_document_mask(const std::vector<index_type>& offsets) {
  DocumentMask m;
  m.host_offsets = m.device_offsets = offsets.data();
  m.documents = int(offsets.size()) - 1;
  return m;
}

/// A rank's compute in full-tile units: full + partial_tile_cost x partial
/// (the planner's compute model).
inline double tile_cost(const TileCounts& t, double partial_tile_cost) {
  return double(t.full) + partial_tile_cost * double(t.partial);
}

namespace detail {
/// A host position map over one rank's list.
struct ListPositions {
  const index_type* p = nullptr;
  index_type operator()(index_type i) const { return p[i]; }
};
}  // namespace detail

/// The tiles rank `r`'s queries compute against every rank's keys, each list
/// cut into tiles of block_q (queries) and block_k (keys) in local order,
/// bounded by their first and last positions as the kernels do.
template <class Mask>
TileCounts rank_tiles(const Layout& l, int r, const Mask& mask, int block_q, int block_k,
                      bool count_pairs = true) {
  TileCounts t;
  const auto& q = l.ranks[std::size_t(r)];
  if (q.empty()) return t;
  for (const auto& k : l.ranks) {
    if (k.empty()) continue;
    t += count_tiles(mask, index_type(q.size()), index_type(k.size()), block_q, block_k,
                     detail::ListPositions{q.data()}, detail::ListPositions{k.data()}, count_pairs);
  }
  return t;
}

/// Per-rank work of a layout: tiles, allowed pairs, and cost = full tiles +
/// partial_tile_cost x partial tiles (the planner's compute model).
struct Balance {
  std::string name;
  std::vector<TileCounts> ranks;
  std::vector<double> cost;
  std::vector<index_type> tokens;
  double max_cost() const {
    return cost.empty() ? 0.0 : *std::max_element(cost.begin(), cost.end());
  }
  double total_cost() const { return std::accumulate(cost.begin(), cost.end(), 0.0); }
  double mean_cost() const { return cost.empty() ? 0.0 : total_cost() / double(cost.size()); }
  /// The slowest rank over the mean: 1 is perfect balance of this layout's
  /// own work.
  double makespan_over_ideal() const { return mean_cost() > 0 ? max_cost() / mean_cost() : 1.0; }
  /// The slowest rank over `ideal` (e.g. the least total work of several
  /// layouts / P: layouts whose tiles straddle more mask edges compute more).
  double makespan_over(double ideal) const { return ideal > 0 ? max_cost() / ideal : 1.0; }
  std::int64_t max_pairs() const {
    std::int64_t m = 0;
    for (const auto& t : ranks) m = std::max(m, t.allowed_pairs);
    return m;
  }
  std::int64_t total_pairs() const {
    std::int64_t s = 0;
    for (const auto& t : ranks) s += t.allowed_pairs;
    return s;
  }
  /// The rank with the most allowed pairs over the mean (pairs, not tiles).
  double pairs_over_ideal() const {
    const double mean = double(total_pairs()) / double(ranks.size());
    return mean > 0 ? double(max_pairs()) / mean : 1.0;
  }
};

template <class Mask>
Balance balance_of(const Layout& l, const Mask& mask, int block_q, int block_k,
                   double partial_tile_cost = 1.0, bool count_pairs = true) {
  Balance b;
  b.name = l.name;
  for (int r = 0; r < l.P(); ++r) {
    const TileCounts t = rank_tiles(l, r, mask, block_q, block_k, count_pairs);
    b.ranks.push_back(t);
    b.cost.push_back(tile_cost(t, partial_tile_cost));
    b.tokens.push_back(index_type(l.ranks[std::size_t(r)].size()));
  }
  return b;
}

/// Mask-aware layout: the sequence cut into chunks of `chunk` tokens (a
/// multiple of block_q and block_k, so that every rank's tiles are the
/// global tiles and a rank's cost is the sum of its chunks'; the last chunk
/// holds the rest of N), each chunk weighed by the cost of its query tiles
/// against all N keys (the classifier), assigned heaviest first (ties:
/// earlier chunk) to the least loaded rank (ties: lower rank) that holds
/// fewer than ceil(chunks / P) chunks, so that no rank holds more than
/// ceil(chunks / P) x chunk tokens (what every block that travels is sized
/// for). Any N >= 1; with N a multiple of chunk x P every rank gets N / P
/// tokens. Run it with TablePartition(layout.ranks).
template <class Mask>
Layout mask_balanced(const Mask& mask, index_type N, int P, index_type chunk, int block_q,
                     int block_k, double partial_tile_cost = 1.0) {
  const char* fn = "plan::mask_balanced";
  if (P < 1) impl::fail(fn, "P = ", P, ", expected at least 1");
  if (chunk < 1 || chunk % block_q != 0 || chunk % block_k != 0)
    impl::fail(fn, "chunk = ", chunk, ", expected a positive multiple of block_q = ", block_q,
               " and block_k = ", block_k);
  if (N < 1) impl::fail(fn, "N = ", N, ", expected at least 1 token");
  const index_type chunks = (N + chunk - 1) / chunk, per_rank = (chunks + P - 1) / P;
  std::vector<std::pair<double, index_type>> weight;  // (cost, chunk)
  for (index_type c = 0; c < chunks; ++c) {
    const index_type rows = std::min(chunk, N - c * chunk);
    const TileCounts t = count_tiles(mask, rows, N, block_q, block_k, OffsetPositions{c * chunk},
                                     OffsetPositions{}, false);
    weight.push_back({tile_cost(t, partial_tile_cost), c});
  }
  std::stable_sort(weight.begin(), weight.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<double> load(std::size_t(P), 0.0);
  std::vector<index_type> held(std::size_t(P), 0);
  std::vector<std::vector<index_type>> own(static_cast<std::size_t>(P));
  for (const auto& [w, c] : weight) {
    int best = -1;
    for (int r = 0; r < P; ++r)
      if (held[std::size_t(r)] < per_rank &&
          (best < 0 || load[std::size_t(r)] < load[std::size_t(best)]))
        best = r;
    load[std::size_t(best)] += w;
    ++held[std::size_t(best)];
    own[std::size_t(best)].push_back(c);
  }
  Layout l;
  l.name = "mask-aware";
  l.N = N;
  l.ranks.resize(std::size_t(P));
  for (int r = 0; r < P; ++r) {
    auto& cs = own[std::size_t(r)];
    std::sort(cs.begin(), cs.end());
    for (index_type c : cs)
      for (index_type t = c * chunk; t < std::min(N, (c + 1) * chunk); ++t)
        l.ranks[std::size_t(r)].push_back(t);
  }
  return l;
}

/// A long-tailed mix of document lengths filling N tokens exactly (cu_seqlens
/// offsets, starting at 0): Pareto lengths min_length x U^(-1/alpha) (U
/// uniform in (0, 1], from a 64-bit linear congruential generator, so the mix
/// is the same on every platform), capped at N; the last document is cut to
/// fit. alpha = 1.1: most documents short, a few as long as a large part of N.
inline std::vector<index_type> long_tailed_documents(index_type N, std::uint64_t seed,
                                                     double alpha = 1.1,
                                                     index_type min_length = 64) {
  if (N < 1 || min_length < 1 || !(alpha > 0))
    impl::fail("plan::long_tailed_documents", "N = ", N, ", min_length = ", min_length,
               ", alpha = ", alpha, "; expected N >= 1, min_length >= 1, alpha > 0");
  std::uint64_t x = seed * 6364136223846793005ull + 1442695040888963407ull;
  std::vector<index_type> off{0};
  while (off.back() < N) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const double u = (double(x >> 11) + 1.0) / 9007199254740992.0;  // (0, 1]
    const double len = double(min_length) * std::pow(u, -1.0 / alpha);
    const index_type l = len >= double(N) ? N : std::max<index_type>(1, index_type(len));
    off.push_back(std::min(N, off.back() + l));
  }
  return off;
}

}  // namespace plan
}  // namespace blockattn
