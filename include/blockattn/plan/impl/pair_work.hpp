// SPDX-License-Identifier: Apache-2.0
// The planner's per-pair work: the tiles of every block pair of a partition
// (once per class of pairs where the layout repeats), row totals over a
// ring, one step's compute, the forward's buffers, the links' period.
#pragma once

#include <blockattn/plan/impl/core.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/score.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace blockattn {
namespace plan {
namespace detail {

/// Masks whose classify() is exact and depends on k - q only (a band over
/// any box): the tiles of a block pair do not change when both blocks move
/// by the same number of positions.
template <class Mask>
struct shift_invariant_mask : std::false_type {};
template <>
struct shift_invariant_mask<FullMask> : std::true_type {};
template <>
struct shift_invariant_mask<CausalMask> : std::true_type {};
template <>
struct shift_invariant_mask<SlidingWindowMask> : std::true_type {};
/// A score policy changes logits, not which pairs exist: the mask's answer.
template <class M, class S>
struct shift_invariant_mask<ScoredMask<M, S>> : shift_invariant_mask<M> {};

inline std::int64_t floor_div(std::int64_t a, std::int64_t b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}
inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) {  // b > 0
  return -floor_div(-a, b);
}

/// count_tiles(mask, N, N, block_q, block_k) of the whole sequence on one
/// device; O(N / block_q) for the band masks (shift_invariant_mask) when
/// allowed pairs are not counted, the tile loop otherwise.
template <class Mask>
TileCounts whole_sequence_tiles(const Mask& mask, index_type N, int block_q, int block_k,
                                bool count_pairs) {
  if constexpr (!shift_invariant_mask<Mask>::value) {
    return count_tiles(mask, N, N, block_q, block_k, {}, {}, count_pairs);
  } else {
    if (count_pairs || N <= 0)
      return count_tiles(mask, N, N, block_q, block_k, {}, {}, count_pairs);
    const MaskBand band = impl::unscored(mask).band(0, N, 0, N);
    // Bands wider than the sequence are the same as unbounded ones.
    const std::int64_t reach = 2 * (std::int64_t(N) + block_q + block_k);
    const std::int64_t lo = std::max<std::int64_t>(band.lo, -reach),
                       hi = std::min<std::int64_t>(band.hi, reach);
    const std::int64_t bk = block_k, tiles_k = (N + bk - 1) / bk;
    // Key tiles of the full size: 0 .. last; the last tile may be shorter.
    const std::int64_t whole = N % bk == 0 ? tiles_k : tiles_k - 1;
    TileCounts c;
    const auto count_in = [](std::int64_t a, std::int64_t b, std::int64_t n) {
      a = std::max<std::int64_t>(a, 0);
      b = std::min<std::int64_t>(b, n - 1);
      return b >= a ? b - a + 1 : std::int64_t(0);
    };
    for (index_type q0 = 0; q0 < N; q0 += block_q) {
      const std::int64_t q1 = std::min<std::int64_t>(q0 + block_q, N);
      // Tile j of the full size: k - q spans [j bk - (q1 - 1), j bk + bk - 1 - q0].
      const std::int64_t some =
          count_in(ceil_div(lo - bk + 1 + q0, bk), floor_div(hi + q1 - 1, bk), whole);
      const std::int64_t all =
          count_in(ceil_div(lo + q1 - 1, bk), floor_div(hi - bk + 1 + q0, bk), whole);
      c.full += all;
      c.partial += some - all;
      c.skipped += whole - some;
      c.allowed_pairs += all * (q1 - q0) * bk;
      if (whole < tiles_k) {  // the shorter last key tile
        const index_type k0 = index_type(whole * bk);
        switch (mask.classify(q0, index_type(q1), k0, N)) {
          case TileKind::empty:
            ++c.skipped;
            break;
          case TileKind::full:
            ++c.full;
            c.allowed_pairs += (q1 - q0) * (N - k0);
            break;
          case TileKind::partial:
            ++c.partial;
            break;
        }
      }
    }
    return c;
  }
}

/// What a rank computes over the steps of a ring: its tiles, summed, and
/// how many of its block pairs have work.
struct RowTotals {
  TileCounts tiles;
  std::int64_t busy_steps = 0;
};

/// The tiles of block pairs (query rank, key rank) of a partition, per
/// (batch, head), as task_work() counts them, and the pairs' emptiness
/// (block_is_empty()), computed once per class of pairs where the layout
/// repeats. For the band masks (shift_invariant_mask):
///   - contiguous and striped, N = P x L: a pair's tiles and emptiness depend
///     on q - k only (mode shift);
///   - zigzag, N = 2P x c: a pair is four chunk pairs, each depending on its
///     chunk distance, when c is a multiple of both tile sizes (mode chunks);
///     its emptiness (the kernels classify the hull of both chunks) depends
///     on q + k only.
/// task_work() and block_is_empty() for every pair otherwise. Row totals
/// (the pairs of a ring's steps summed per rank) in O(1) per rank from
/// prefix sums of the tables.
template <class Partition, class Mask>
class PairWork {
 public:
  PairWork(const Mask& mask, index_type N, int P, int block_q, int block_k, bool count_pairs)
      : mask_(mask), N_(N), P_(P), bq_(block_q), bk_(block_k), pairs_(count_pairs) {
    if constexpr (shift_invariant_mask<Mask>::value) {
      if constexpr (std::is_same<Partition, ContiguousPartition>::value ||
                    std::is_same<Partition, StripedPartition>::value) {
        if (N % P == 0) {
          mode_ = Mode::shift;
          empty_by_ = By::difference;
          fill(2 * P - 1, [&](int i) {
            const int d = i - (P - 1);
            return d >= 0 ? BlockTask{d, 0} : BlockTask{0, -d};
          });
        }
      } else if constexpr (std::is_same<Partition, ZigzagPartition>::value) {
        if (N % (2 * index_type(P)) == 0) {
          empty_by_ = By::sum;
          empty_.resize(static_cast<std::size_t>(2 * P - 1));
          for (int sigma = 0; sigma < 2 * P - 1; ++sigma) {
            const int q = std::min(sigma, P - 1);
            empty_[std::size_t(sigma)] = block_is_empty<Partition>(mask_, N_, P_, q, sigma - q);
          }
          chunk_ = N / (2 * index_type(P));
          if (chunk_ % block_q == 0 && chunk_ % block_k == 0) {
            mode_ = Mode::chunks;
            const int E = 4 * P - 1;  // chunk distances -(2P - 1) .. 2P - 1
            table_.resize(std::size_t(E));
            for (int i = 0; i < E; ++i) {
              const index_type e = i - (2 * P - 1);
              table_[std::size_t(i)] = count_tiles(
                  mask_, chunk_, chunk_, bq_, bk_, OffsetPositions{e >= 0 ? e * chunk_ : 0},
                  OffsetPositions{e >= 0 ? 0 : -e * chunk_}, pairs_);
            }
            prefix();
            // The chunk distances with work: rows in O(1) need them in one interval.
            int lo = E, hi = -1;
            for (int i = 0; i < E; ++i)
              if (table_[std::size_t(i)].computed() > 0) lo = std::min(lo, i), hi = i;
            bool interval = true;
            for (int i = lo; i <= hi; ++i)
              interval = interval && table_[std::size_t(i)].computed() > 0;
            if (interval) {
              busy_lo_ = lo - (2 * P - 1);
              busy_hi_ = hi - (2 * P - 1);
              rows_ = true;
            }
          }
        }
      }
    }
  }

  TileCounts operator()(int q, int k) const {
    switch (mode_) {
      case Mode::shift:
        return table_[std::size_t(q - k + P_ - 1)];
      case Mode::chunks: {
        const int a = 2 * P_ - 1;
        TileCounts t = chunk(q - k);
        t += chunk(q - (a - k));
        t += chunk((a - q) - k);
        t += chunk(k - q);
        return t;
      }
      case Mode::direct:
        break;
    }
    return task_work<Partition>(mask_, N_, P_, BlockTask{q, k}, bq_, bk_, pairs_);
  }

  /// block_is_empty(q, k): the whole block pair is masked out.
  bool empty(int q, int k) const {
    switch (empty_by_) {
      case By::difference:
        return empty_[std::size_t(q - k + P_ - 1)] != 0;
      case By::sum:
        return empty_[std::size_t(q + k)] != 0;
      case By::pair:
        break;
    }
    return block_is_empty<Partition>(mask_, N_, P_, q, k);
  }
  /// Whether empty() is O(1) (a table).
  bool empty_tabled() const { return empty_by_ != By::pair; }
  /// Whether a pair's emptiness depends on q - k only.
  bool by_difference() const { return empty_by_ == By::difference; }

  /// ScheduleContext::ring_reach() of the layout (O(P) with tables): the
  /// largest d whose pairs (x, x - d mod P) are not all empty.
  int ring_reach() const {
    if (empty_by_ == By::pair) return schedule_context<Partition>(mask_, N_, P_).reach;
    if (empty_by_ == By::difference) {  // x >= d: q - k = d; x < d: d - P
      for (int d = P_ - 1; d > 0; --d)
        if (!empty(d, 0) || !empty(0, P_ - d)) return d;
      return 0;
    }
    // By sum: x >= d gives q + k = 2x - d in [d, 2P - 2 - d], x < d gives
    // 2x - d + P in [P - d, P + d - 2], in steps of 2.
    std::vector<int> busy(static_cast<std::size_t>(2 * P_ + 1),
                          0);  // busy sums < i, same parity as i
    for (int i = 2; i <= 2 * P_; ++i)
      busy[std::size_t(i)] = busy[std::size_t(i - 2)] + (empty_[std::size_t(i - 2)] ? 0 : 1);
    const auto any = [&](int lo, int hi) {  // a non-empty sum in lo, lo + 2, .., hi
      return hi >= lo && busy[std::size_t(hi + 2)] - busy[std::size_t(lo)] > 0;
    };
    for (int d = P_ - 1; d > 0; --d)
      if (any(d, 2 * P_ - 2 - d) || any(P_ - d, P_ + d - 2)) return d;
    return 0;
  }

  /// Whether rows() answers.
  bool has_rows() const { return rows_; }
  /// The pairs of rank q with ranks q - s mod P, s = 0 .. S - 1, summed.
  RowTotals rows(int q, int S) const {
    RowTotals t;
    if (mode_ == Mode::shift) {
      // q - k = s for s <= q, s - P after the ring wraps.
      add_range(t.tiles, 0, std::min(q, S - 1), P_ - 1);
      if (q + 1 <= S - 1) add_range(t.tiles, q + 1 - P_, S - 1 - P_, P_ - 1);
      t.busy_steps =
          busy_in(0, std::min(q, S - 1)) + (q + 1 <= S - 1 ? busy_in(q + 1 - P_, S - 1 - P_) : 0);
      return t;
    }
    // Chunks: k in [q - min(q, S - 1), q] and, after the wrap, [q - S + 1 + P, P - 1].
    const int a = 2 * P_ - 1;
    const auto range = [&](int k0, int k1) {
      if (k1 < k0) return;
      add_range(t.tiles, q - k1, q - k0, 2 * P_ - 1);          // chunk q vs chunk k
      add_range(t.tiles, q + k0 - a, q + k1 - a, 2 * P_ - 1);  // chunk q vs chunk a - k
      add_range(t.tiles, a - q - k1, a - q - k0, 2 * P_ - 1);  // chunk a - q vs chunk k
      add_range(t.tiles, k0 - q, k1 - q, 2 * P_ - 1);          // chunk a - q vs chunk a - k
      // Pairs with work: one of the four chunk distances in [busy_lo, busy_hi].
      std::array<std::pair<std::int64_t, std::int64_t>, 4> in{{{q - busy_hi_, q - busy_lo_},
                                                               {a - q + busy_lo_, a - q + busy_hi_},
                                                               {a - q - busy_hi_, a - q - busy_lo_},
                                                               {q + busy_lo_, q + busy_hi_}}};
      std::sort(in.begin(), in.end());
      std::int64_t covered = 0, upto = std::int64_t(k0) - 1;
      for (auto [lo, hi] : in) {
        lo = std::max<std::int64_t>({lo, k0, upto + 1});
        hi = std::min<std::int64_t>(hi, k1);
        if (hi >= lo) covered += hi - lo + 1, upto = hi;
      }
      t.busy_steps += covered;
    };
    if (busy_hi_ < busy_lo_) {  // no chunk pair has work
      range(std::max(0, q - S + 1), q);
      if (S - 1 > q) range(q - S + 1 + P_, P_ - 1);
      t.busy_steps = 0;
      return t;
    }
    range(std::max(0, q - S + 1), q);
    if (S - 1 > q) range(q - S + 1 + P_, P_ - 1);
    return t;
  }

 private:
  enum class Mode { direct, shift, chunks };
  enum class By { pair, difference, sum };
  template <class Task>
  void fill(int n, Task task) {
    table_.resize(std::size_t(n));
    empty_.resize(std::size_t(n));
    for (int i = 0; i < n; ++i) {
      const BlockTask t = task(i);
      table_[std::size_t(i)] = task_work<Partition>(mask_, N_, P_, t, bq_, bk_, pairs_);
      empty_[std::size_t(i)] = block_is_empty<Partition>(mask_, N_, P_, t.q_rank, t.k_rank);
    }
    prefix();
    rows_ = true;
  }
  void prefix() {
    sum_.assign(table_.size() + 1, TileCounts{});
    busy_.assign(table_.size() + 1, 0);
    for (std::size_t i = 0; i < table_.size(); ++i) {
      sum_[i + 1] = sum_[i];
      sum_[i + 1] += table_[i];
      busy_[i + 1] = busy_[i] + (table_[i].computed() > 0 ? 1 : 0);
    }
  }
  /// Adds the table entries of keys lo .. hi (offset: the index of key 0).
  void add_range(TileCounts& t, std::int64_t lo, std::int64_t hi, int offset) const {
    if (hi < lo) return;
    const TileCounts &b = sum_[std::size_t(hi + offset + 1)], &a = sum_[std::size_t(lo + offset)];
    t.full += b.full - a.full;
    t.partial += b.partial - a.partial;
    t.skipped += b.skipped - a.skipped;
    t.allowed_pairs += b.allowed_pairs - a.allowed_pairs;
  }
  std::int64_t busy_in(int lo, int hi) const {  // shift mode: differences lo .. hi
    return hi < lo ? 0 : busy_[std::size_t(hi + P_)] - busy_[std::size_t(lo + P_ - 1)];
  }
  TileCounts chunk(int e) const { return table_[std::size_t(e + 2 * P_ - 1)]; }
  Mask mask_;
  index_type N_;
  int P_, bq_, bk_;
  bool pairs_;
  Mode mode_ = Mode::direct;
  By empty_by_ = By::pair;
  index_type chunk_ = 0;
  std::vector<TileCounts> table_, sum_;
  std::vector<std::int64_t> busy_;
  std::vector<char> empty_;
  bool rows_ = false;
  int busy_lo_ = 0, busy_hi_ = -1;
};

/// One step's work on one rank: tiles, FLOPs and compute time.
inline StepPlan step_work(const Problem& p, const Hardware& hw, const BlockTask& task,
                          const TileCounts& tiles) {
  StepPlan st;
  st.task = task;
  st.tiles = tiles;
  st.flops = 4.0 * double(tiles.computed()) * p.block_q * p.block_k * p.dim * p.batch * p.heads;
  st.compute_s = tile_seconds(p, hw, tiles) + (st.idle() ? 0.0 : hw.step_overhead);
  return st;
}

/// The buffer sizes of schedule_plan(), for forward_workspace_bytes().
inline ForwardBufferBytes buffer_bytes(const Problem& p) {
  ForwardBufferBytes b;
  b.kv = packed_kv_bytes(p);
  b.q = payload_bytes(p, Payload::q);
  b.result = payload_bytes(p, Payload::result);
  b.state = 2 * state_bytes(p);
  if (p.widens()) {
    b.widened_kv = packed_kv_bytes(p, p.accumulator_bytes());
    b.accumulator = rows_bytes(p, p.heads, p.dim, p.accumulator_bytes());
  }
  return b;
}

/// The smallest p dividing P such that the links of rank r and of rank
/// r + p are alike (same node pattern, ranks r x stride of the machine),
/// cyclically; 0 when there is none.
inline int link_period(const Hardware& hw, int P, int stride) {
  if (hw.ranks_per_node <= 0) return 1;
  const std::int64_t R = hw.ranks_per_node;
  if (std::int64_t(P) * stride % R != 0) return 0;
  for (int p = 1; p <= P; ++p)
    if (P % p == 0 && std::int64_t(p) * stride % R == 0) return p;
  return 0;
}

/// An upper bound on the compute time of one block pair: every tile of the
/// longest rank's block computed at the dearer of a full and a partial
/// tile's cost, and the step overhead.
inline double pair_seconds_bound(const Problem& p, const Hardware& hw) {
  const double tiles = double((p.local() + p.block_q - 1) / p.block_q) *
                       double((p.local() + p.block_k - 1) / p.block_k);
  const double per_tile = 4.0 * p.block_q * p.block_k * p.dim * double(p.batch) * p.heads;
  const double t =
      hw.flops > 0 ? tiles * std::max(1.0, hw.partial_tile_cost) * per_tile / hw.flops : 0.0;
  return (t + hw.step_overhead) * (1 + 1e-9);
}

/// The fast forward model of a schedule (plan/models/): each model
/// specialises it for the schedules it predicts without a message list
/// (`available`, and run(pr, p, hw, w, rank_stride, keep_steps) filling the
/// ranks' steps, totals and workspace); predict() takes it, or else
/// predict_reference() (a schedule of your own).
template <class Schedule, class = void>
struct forward_model {
  static constexpr bool available = false;
};

}  // namespace detail
}  // namespace plan
}  // namespace blockattn
