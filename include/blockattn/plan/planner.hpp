// SPDX-License-Identifier: Apache-2.0
// Cost model and planner for the distributed forward, backward and training
// step (Problem::pass; predict_backward for the backward): per rank and step, the
// tiles the kernels compute (the kernels' own classifier, so the counts are
// exact), the messages the schedule sends (the same sizes the run sends), and
// a timing simulation of the double-buffered steps on given hardware (compute
// rate F, link bandwidth B and latency). It predicts makespan, idle fraction,
// bytes moved and peak memory per rank for any partition x mask x schedule,
// and recommends the fastest combination that fits in memory.
//
//   plan::Problem pb = plan::problem_for<float, Kokkos::DefaultExecutionSpace>(N, P, batch, heads,
//                                             kv_heads, dim);
//   auto all = plan::compare(pb, CausalMask{}, plan::a100_nvlink());
//   const plan::Prediction& best = all[plan::recommend(all)];
//
// Host only; no Kokkos kernels run here (calibration is the caller's: see
// tools/plan.cpp).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/work.hpp>
#include <blockattn/plan/model.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/partition.hpp>
#include <blockattn/policy/score.hpp>
#include <blockattn/schedule/allgather.hpp>
#include <blockattn/schedule/balanced.hpp>
#include <blockattn/schedule/hybrid.hpp>
#include <blockattn/schedule/ring.hpp>
#include <blockattn/schedule/schedule.hpp>
#include <blockattn/schedule/ulysses.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace blockattn {
namespace plan {

namespace detail {

struct Message {
  int src = 0, dst = 0;
  std::int64_t bytes = 0;
  int src_step = 0, dst_step = 0;  // steps at whose start both sides post it
  bool after_compute = false;      // the sender posts it after its compute of src_step
  int done_step = 0;               // both sides wait for it at the end of this step
};

/// A packed K/V block, in the storage type (bytes = 0) or another.
inline std::int64_t packed_kv_bytes(const Problem& p, int bytes = 0) {
  const std::int64_t keys_padded =
      (p.local() + p.block_k - 1) / p.block_k * std::int64_t(p.block_k);
  return 2 * std::int64_t(p.batch) * p.kv_heads * keys_padded * p.stored_dim() *
         (bytes > 0 ? bytes : p.dtype_bytes);
}
/// Local rows of `heads` heads, in the storage type (bytes = 0) or another.
inline std::int64_t rows_bytes(const Problem& p, int heads, int dim, int bytes = 0) {
  return std::int64_t(p.batch) * p.local() * heads * dim * (bytes > 0 ? bytes : p.dtype_bytes);
}
/// One value per local query row and head, in the compute type (LSE, m, l).
inline std::int64_t state_bytes(const Problem& p) {
  return std::int64_t(p.batch) * p.heads * p.local() * p.accumulator_bytes();
}

/// Of the ranks base .. base + P - 1, how many share a node with rank x
/// (x itself included).
inline int group_node_mates(const Hardware& hw, int base, int P, int x) {
  if (hw.ranks_per_node <= 0) return 1;
  const std::int64_t R = hw.ranks_per_node, node0 = std::int64_t(x) / R * R;
  const std::int64_t lo = std::max<std::int64_t>(base, node0),
                     hi = std::min<std::int64_t>(std::int64_t(base) + P, node0 + R);
  return int(hi - lo);
}

/// One all-to-all of `chunk` bytes per pair among `count` groups of P ranks
/// (ranks base .. base + P - 1, then the next P): each rank sends P - 1
/// messages one at a time; the slowest rank of the slowest group.
inline double alltoall_seconds(const Hardware& hw, int base, int P, int count, std::int64_t chunk) {
  double worst = 0;
  const double bytes = double(chunk);
  const double near = hw.transfer_seconds(0, 0, bytes);  // same node (one level: the network)
  const double far =
      hw.ranks_per_node > 0 ? hw.transfer_seconds(0, hw.ranks_per_node, bytes) : near;
  for (int g = 0; g < count; ++g) {
    const int b = base + g * P;
    // A group's ranks differ only by how many of their peers share their
    // node: ranks at the group's node boundaries, and one of each node between.
    const auto time_of = [&](int x) {
      const int mates = group_node_mates(hw, b, P, x) - 1;
      return hw.ranks_per_node > 0 ? mates * near + (P - 1 - mates) * far : (P - 1) * near;
    };
    if (hw.ranks_per_node <= 0) {
      worst = std::max(worst, P > 0 ? time_of(b) : 0.0);
      continue;
    }
    for (std::int64_t x = b; x < std::int64_t(b) + P;
         x = (x / hw.ranks_per_node + 1) * std::int64_t(hw.ranks_per_node))
      worst = std::max(worst, time_of(int(x)));
  }
  return worst;
}

/// Of the P - 1 peers of rank `base + r` in its all-to-all group (ranks
/// base .. base + P - 1), how many sit on other nodes.
inline int alltoall_remote_peers(const Hardware& hw, int base, int P, int r) {
  if (hw.ranks_per_node <= 0) return P - 1;
  return P - group_node_mates(hw, base, P, base + r);
}

inline double tile_seconds(const Problem& p, const Hardware& hw, const TileCounts& t) {
  if (hw.flops <= 0) return 0;
  const double per_tile = 4.0 * p.block_q * p.block_k * p.dim * double(p.batch) * p.heads;
  return (double(t.full) + hw.partial_tile_cost * double(t.partial)) * per_tile / hw.flops;
}

/// Bytes of one transfer's payload (the sizes DistributedAttention sends).
inline std::int64_t payload_bytes(const Problem& p, Payload what) {
  switch (what) {
    case Payload::kv:
      return packed_kv_bytes(p);
    case Payload::q:
      return rows_bytes(p, p.heads, p.dim);
    case Payload::result:  // partial O and LSE travel in the compute type
      return rows_bytes(p, p.heads, p.dim, p.accumulator_bytes()) + state_bytes(p);
    case Payload::dq:
    case Payload::dkv:
      break;  // backward payloads: the planner models the forward
  }
  return 0;
}

/// Messages and per-rank workspace, read from the schedule's own description
/// (blockattn/schedule/schedule.hpp): the transfers its step() lists and the buffers
/// forward_slots() derives from them, at the sizes the run allocates.
template <class Schedule>
void schedule_plan(const Problem& p, const ScheduleContext& c, std::vector<Message>& msgs,
                   std::vector<std::int64_t>& ws) {
  const int P = p.P;
  for (const ScheduledTransfer& t : schedule_transfers<Schedule>(c))
    msgs.push_back({t.src, t.dst, payload_bytes(p, t.payload), t.src_step, t.dst_step,
                    t.after_compute, t.done_step});
  ws.assign(std::size_t(P), 0);
  const std::int64_t q = payload_bytes(p, Payload::q), res = payload_bytes(p, Payload::result);
  for (int r = 0; r < P; ++r) {
    ForwardBufferBytes b;
    b.kv = packed_kv_bytes(p);
    b.q = q;
    b.result = res;
    b.state = 2 * state_bytes(p);
    if (p.widens()) {  // 16-bit storage: the block in use widened to fp32, and the fp32 O sum
      b.widened_kv = packed_kv_bytes(p, p.accumulator_bytes());
      b.accumulator = rows_bytes(p, p.heads, p.dim, p.accumulator_bytes());
    }
    ws[std::size_t(r)] = forward_workspace_bytes(forward_slots<Schedule>(c, r), b);
  }
}

/// Empty when Partition splits N over P ranks (any N >= 1 with length(),
/// else a positive multiple of multiple_of(P)), else why not.
template <class Partition>
std::string length_why_not(index_type N, int P) {
  if constexpr (splits_any_length_v<Partition>) {
    if (P < 1 || N < 1) return "N and P must be at least 1";
  } else if (P < 1 || N <= 0 || N % Partition::multiple_of(P) != 0) {
    return "N must be a positive multiple of " + std::to_string(Partition::multiple_of(P));
  }
  return {};
}

/// Why Partition x Schedule cannot run N tokens over P ranks with a mask of
/// this type (the length, then the schedule's compile-time support), or "".
template <class Partition, class Schedule, class Mask>
std::string layout_why_not(index_type N, int P) {
  if (std::string why = length_why_not<Partition>(N, P); !why.empty()) return why;
  if constexpr (!Schedule::template supports<Partition, Mask>)
    return std::string("the ") + Schedule::name() + " schedule does not support the " +
           Partition::name() + " partition with this mask";
  return {};
}

/// `pr` marked not possible, for `why`.
inline Prediction invalid(Prediction pr, std::string why) {
  pr.valid = false;
  pr.why_not = std::move(why);
  return pr;
}

}  // namespace detail

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

/// Sets the totals of rank r over a ring of S steps from its row totals.
template <class Partition, class Mask>
void ring_totals(RankPlan& rp, const Problem& p, const Hardware& hw,
                 const PairWork<Partition, Mask>& w, int r, int S) {
  const RowTotals t = w.rows(r, S);
  rp.step_count = S;
  rp.idle_step_count = int(S - t.busy_steps);
  rp.compute_s = tile_seconds(p, hw, t.tiles) + double(t.busy_steps) * hw.step_overhead;
}

/// ring_model() where the links bound every step (no pair computes longer
/// than the shorter of a rank's two transfers, so compute never decides an
/// end) and the links repeat with period p: the ends of the steps with
/// transfers repeat with period p too, so p ranks carry them; the last step
/// (compute only) and the totals (PairWork::rows) take O(1) per rank. The
/// same numbers as the step-by-step loop; false when it does not apply.
template <class Partition, class Mask>
bool ring_fast(Prediction& pr, const Problem& p, const Hardware& hw,
               const PairWork<Partition, Mask>& w, int S, int stride) {
  const int P = p.P, per = link_period(hw, P, stride);
  if (!w.has_rows() || per <= 0) return false;
  const std::int64_t kv = payload_bytes(p, Payload::kv);
  std::vector<double> out(static_cast<std::size_t>(per)), e(static_cast<std::size_t>(per), 0.0),
      next(static_cast<std::size_t>(per));
  for (int r = 0; r < per; ++r)
    out[std::size_t(r)] = hw.transfer_seconds(r * stride, (r + 1) % P * stride, double(kv));
  const double bound = pair_seconds_bound(p, hw);
  if (S > 1)
    for (int r = 0; r < per; ++r)
      if (bound > std::max(out[std::size_t(r)], out[std::size_t((r + per - 1) % per)]))
        return false;
  for (int s = 0; s + 1 < S; ++s) {
    for (int r = 0; r < per; ++r) {
      const std::size_t i = std::size_t(r), up = std::size_t((r + 1) % per),
                        down = std::size_t((r + per - 1) % per);
      next[i] = std::max(std::max(e[i], e[up]) + out[i], std::max(e[down], e[i]) + out[down]);
    }
    e.swap(next);
  }
  for (int r = 0; r < P; ++r) {
    const int j = ring_source(r, S - 1, P);
    const double end = e[std::size_t(r % per)] + step_work(p, hw, {r, j}, w(r, j)).compute_s;
    pr.makespan_s = std::max(pr.makespan_s, end);
    RankPlan& rp = pr.ranks[std::size_t(r)];
    ring_totals(rp, p, hw, w, r, S);
    rp.sent = std::int64_t(S - 1) * kv;
    rp.network = hw.same_node(r * stride, (r + 1) % P * stride) ? 0 : rp.sent;
  }
  return true;
}

/// The KV ring forward (RingSchedule, BurstSchedule) without a message list:
/// every step, each rank sends one K/V block to the next and receives one
/// from the previous, posted by both at the start of the step; the links
/// carry one message each per step, so a transfer starts when both ends have
/// started the step, and rank r ends step s at
///   max(start + compute, max(start, start of r + 1) + link r -> r + 1,
///       max(start of r - 1, start) + link r - 1 -> r).
/// The same numbers as predict_reference() in O(P) memory.
template <class Partition, class Mask>
void ring_model(Prediction& pr, const Problem& p, const Hardware& hw, PairWork<Partition, Mask>& w,
                int S, int stride, bool keep) {
  const int P = p.P;
  const std::int64_t kv = payload_bytes(p, Payload::kv);
  if (!keep && ring_fast(pr, p, hw, w, S, stride)) return;
  std::vector<double> e(std::size_t(P), 0.0), next(std::size_t(P), 0.0),
      out(static_cast<std::size_t>(P));
  std::vector<char> remote(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) {
    const int to = (r + 1) % P;
    out[std::size_t(r)] = hw.transfer_seconds(r * stride, to * stride, double(kv));
    remote[std::size_t(r)] = !hw.same_node(r * stride, to * stride);
  }
  for (int s = 0; s < S; ++s) {
    const bool send = s + 1 < S;
    for (int r = 0; r < P; ++r) {
      const int prev = (r + P - 1) % P, to = (r + 1) % P;
      const double start = e[std::size_t(r)];
      StepPlan st = step_work(p, hw, {r, ring_source(r, s, P)}, w(r, ring_source(r, s, P)));
      double end = start + st.compute_s;
      if (send) {
        const double dout = out[std::size_t(r)], din = out[std::size_t(prev)];
        end = std::max({end, std::max(start, e[std::size_t(to)]) + dout,
                        std::max(e[std::size_t(prev)], start) + din});
        st.bytes_sent = st.bytes_received = kv;
        st.network_bytes = remote[std::size_t(r)] ? kv : 0;
        st.comm_s = dout + din;
      }
      st.start_s = start;
      st.end_s = end;
      next[std::size_t(r)] = end;
      pr.ranks[std::size_t(r)].add(st, keep);
    }
    e.swap(next);
  }
  for (int r = 0; r < P; ++r) pr.makespan_s = std::max(pr.makespan_s, e[std::size_t(r)]);
}

/// The all-gather forward (AllGatherSchedule) without a message list: all
/// transfers are posted at step 0; the block rank r needs at step s >= 1
/// (its pair with rank r - s is not empty) comes from rank r - s and
/// completes by the end of step s - 1. At each step a rank sends at most one
/// block (to r + s) and receives at most one, so a transfer starts when both
/// links are free.
template <class Partition, class Mask>
void allgather_model(Prediction& pr, const Problem& p, const Hardware& hw,
                     PairWork<Partition, Mask>& w, int S, int stride, bool keep) {
  const int P = p.P;
  const std::int64_t kv = payload_bytes(p, Payload::kv);
  if (!keep && allgather_fast(pr, p, hw, w, S, stride)) return;
  std::vector<double> e(std::size_t(P), 0.0), next(std::size_t(P), 0.0);
  std::vector<double> out_free(std::size_t(P), 0.0), in_free(std::size_t(P), 0.0);
  std::vector<int> slots(std::size_t(P), 1);  // K/V slots: its own + the blocks it gathers
  std::vector<StepPlan> first(static_cast<std::size_t>(P)),
      now(static_cast<std::size_t>(P));  // step 0 holds every transfer
  for (int s = 0; s < S; ++s) {
    for (int r = 0; r < P; ++r) {
      const int j = ring_source(r, s, P);
      StepPlan& st = s == 0 ? first[std::size_t(r)] : now[std::size_t(r)];
      st = s == 0 || !w.empty(r, j) ? step_work(p, hw, {r, j}, w(r, j)) : step_work(p, hw, {}, {});
      st.start_s = e[std::size_t(r)];
      next[std::size_t(r)] = st.start_s + st.compute_s;
    }
    if (const int u = s + 1; u < S)  // the transfers of step u complete at step s
      for (int r = 0; r < P; ++r) {
        const int src = ring_source(r, u, P);
        if (w.empty(r, src)) continue;
        ++slots[std::size_t(r)];
        const double dt = hw.transfer_seconds(src * stride, r * stride, double(kv));
        const double fin = std::max(out_free[std::size_t(src)], in_free[std::size_t(r)]) + dt;
        out_free[std::size_t(src)] = in_free[std::size_t(r)] = fin;
        next[std::size_t(src)] = std::max(next[std::size_t(src)], fin);
        next[std::size_t(r)] = std::max(next[std::size_t(r)], fin);
        StepPlan& a = first[std::size_t(src)];
        a.bytes_sent += kv;
        if (!hw.same_node(src * stride, r * stride)) a.network_bytes += kv;
        a.comm_s += dt;
        StepPlan& b = first[std::size_t(r)];
        b.bytes_received += kv;
        b.comm_s += dt;
      }
    for (int r = 0; r < P; ++r) {
      StepPlan& st = s == 0 ? first[std::size_t(r)] : now[std::size_t(r)];
      st.end_s = next[std::size_t(r)];
      if (s > 0) pr.ranks[std::size_t(r)].add(st, keep);
    }
    e.swap(next);
  }
  const ForwardBufferBytes bytes = buffer_bytes(p);
  for (int r = 0; r < P; ++r) {
    RankPlan& rp = pr.ranks[std::size_t(r)];
    rp.add(first[std::size_t(r)], false);
    if (keep) rp.steps.insert(rp.steps.begin(), first[std::size_t(r)]);
    pr.makespan_s = std::max(pr.makespan_s, e[std::size_t(r)]);
    ForwardSlots u;
    u.kv = slots[std::size_t(r)];
    rp.workspace_bytes = forward_workspace_bytes(u, bytes);
  }
}

/// allgather_model() where every block pair within the ring's reach has
/// work to gather (each rank sends and receives one block at every step),
/// no pair computes longer than the shortest transfer (so a rank ends every
/// step with transfers when its last transfer does) and the links repeat
/// with period p: the links' free times repeat with period p, so p ranks
/// carry them. The same numbers as the step-by-step loop; false when it does
/// not apply.
template <class Partition, class Mask>
bool allgather_fast(Prediction& pr, const Problem& p, const Hardware& hw,
                    const PairWork<Partition, Mask>& w, int S, int stride) {
  const int P = p.P, per = link_period(hw, P, stride);
  if (!w.has_rows() || !w.empty_tabled() || per <= 0) return false;
  for (int s = 1; s < S; ++s)
    if (w.empty(s, 0) || w.empty(0, P - s)) return false;  // by difference
  if (!w.by_difference())
    for (int x = 0; x < P; ++x)
      for (int y : {0, P - 1})
        if (w.empty(x, y)) return false;  // by sum: every q + k in 0 .. 2P - 2
  const std::int64_t kv = payload_bytes(p, Payload::kv);
  const double shortest = hw.ranks_per_node > 0
                              ? std::min(hw.transfer_seconds(0, 0, double(kv)),
                                         hw.transfer_seconds(0, hw.ranks_per_node, double(kv)))
                              : hw.transfer_seconds(0, 0, double(kv));
  if (S > 1 && pair_seconds_bound(p, hw) > shortest) return false;
  const std::size_t n = static_cast<std::size_t>(per);
  std::vector<double> out_free(n, 0.0), in_free(n, 0.0), out_next(n), in_next(n);
  std::vector<std::int64_t> network(n, 0);
  for (int u = 1; u < S; ++u) {  // completes at step u - 1
    for (int r = 0; r < per; ++r) {
      const int src = ring_source(r, u, P);
      const double fin = std::max(out_free[std::size_t(src % per)], in_free[std::size_t(r)]) +
                         hw.transfer_seconds(src * stride, r * stride, double(kv));
      out_next[std::size_t(src % per)] = in_next[std::size_t(r)] = fin;
      if (!hw.same_node(r * stride, (r + u) % P * stride)) network[std::size_t(r)] += kv;
    }
    out_free.swap(out_next);
    in_free.swap(in_next);
  }
  const ForwardBufferBytes bytes = buffer_bytes(p);
  ForwardSlots slots;
  slots.kv = S;
  const std::int64_t ws = forward_workspace_bytes(slots, bytes);
  for (int r = 0; r < P; ++r) {
    const int j = ring_source(r, S - 1, P);
    const double c = step_work(p, hw, {r, j}, w(r, j)).compute_s;
    const std::size_t i = std::size_t(r % per);
    const double end = S > 1 ? std::max(out_free[i], in_free[i]) + c : c;
    pr.makespan_s = std::max(pr.makespan_s, end);
    RankPlan& rp = pr.ranks[std::size_t(r)];
    ring_totals(rp, p, hw, w, r, S);
    rp.sent = std::int64_t(S - 1) * kv;
    rp.network = network[i];
    rp.workspace_bytes = ws;
  }
  return true;
}

/// The buffers of `rank` in the balanced schedule (forward_slots() of
/// BalancedSchedule), in O(1): the steps at which it owns a remote pair
/// (1 .. min(rank, P / 2)), helps (rank + 1 .. (P - 1) / 2) and is helped
/// (P - rank .. (P - 1) / 2) decide its slots by their parity.
inline ForwardSlots balanced_slots(int rank, int P) {
  const int last = P / 2, help_last = (P - 1) / 2;
  const auto has_odd = [](int a, int b) { return b >= a && (a % 2 == 1 || b > a); };
  ForwardSlots u;
  if (std::min(rank, last) >= 1) u.kv = 3;  // slot 1 + t mod 2 from t = 1 on
  const int h0 = rank + 1;                  // helps at t = h0 .. help_last
  if (help_last >= h0) {
    u.q = has_odd(h0, help_last) ? 3 : 2;
    u.results_out = has_odd(h0, help_last) ? 2 : 1;
  }
  const int g0 = std::max(1, P - rank);  // helped at t = g0 .. help_last
  if (help_last >= g0) {
    u.q_copy = true;
    u.results_in = has_odd(g0, help_last) ? 2 : 1;
    u.merges = true;
  }
  return u;
}

/// balanced_model() for the totals only (no steps kept): the same
/// arithmetic on arrays, and the order on each link without sorting the
/// step's messages: a message waits for the message before it on its
/// sender's link and on its receiver's (ready time, then the reference's
/// list order), which may wait in turn.
template <class Partition, class Mask>
void balanced_totals(Prediction& pr, const Problem& p, const Hardware& hw,
                     const PairWork<Partition, Mask>& w, int stride) {
  const int P = p.P, T = balanced_steps(P);
  const std::size_t n = static_cast<std::size_t>(P);
  const std::int64_t kv = payload_bytes(p, Payload::kv), qb = payload_bytes(p, Payload::q),
                     res = payload_bytes(p, Payload::result);
  std::vector<double> start(n, 0.0), cend(n, 0.0), prev_start(n, 0.0), prev_cend(n, 0.0),
      out_free(n, 0.0), in_free(n, 0.0), done(n, 0.0), busy(n, 0.0);
  std::vector<int> idle(n, 0);
  // Per pair class (q - k, when PairWork tables them): compute time and whether it has work.
  std::vector<double> cost;
  std::vector<char> works;
  if (w.by_difference() && w.has_rows()) {
    cost.resize(2 * n - 1);
    works.resize(2 * n - 1);
    for (int d = 1 - P; d < P; ++d) {
      const TileCounts tiles = d >= 0 ? w(d, 0) : w(0, -d);
      works[std::size_t(d + P - 1)] = tiles.computed() > 0;
      cost[std::size_t(d + P - 1)] =
          tile_seconds(p, hw, tiles) + (tiles.computed() == 0 ? 0.0 : hw.step_overhead);
    }
  }
  // Links: node of each rank, and the time of each payload within and between nodes.
  std::vector<int> node(n, 0);
  if (hw.ranks_per_node > 0)
    for (int r = 0; r < P; ++r)
      node[std::size_t(r)] = int(std::int64_t(r) * stride / hw.ranks_per_node);
  const auto seconds = [&](std::int64_t bytes, bool near) {
    return hw.ranks_per_node > 0
               ? hw.transfer_seconds(0, near ? 0 : hw.ranks_per_node, double(bytes))
               : hw.transfer_seconds(0, 0, double(bytes));
  };
  const double t_kv[2] = {seconds(kv, false), seconds(kv, true)},
               t_q[2] = {seconds(qb, false), seconds(qb, true)},
               t_res[2] = {seconds(res, false), seconds(res, true)};
  std::vector<std::int64_t> sent(n, 0), network(n, 0);
  // Message 2r: rank r's result of step t - 1; 2r + 1: its input for step t + 1.
  std::vector<double> ready(2 * n), fin(2 * n), dt(2 * n);
  std::vector<int> dst(2 * n), stack;
  std::vector<char> has(2 * n), known(2 * n);
  for (int t = 0; t <= T; ++t) {
    const int u = t + 1, h = t - 1;  // inputs of step u; results of step h
    if (t < T && !cost.empty()) {
      // Pair classes: owners (r >= t) compute q - k = t, helpers (r < t,
      // 2t < P) q - k = P - t, the others nothing (balanced_task()).
      const std::size_t own = std::size_t(t + P - 1), help = std::size_t(2 * P - 1 - t);
      const bool helping = t > 0 && 2 * t < P;
      for (int r = 0; r < P; ++r) {
        const bool owner = r >= t;
        double c = 0;
        if (owner || helping) {
          const std::size_t d = owner ? own : help;
          c = cost[d];
          idle[std::size_t(r)] += works[d] ? 0 : 1;
          busy[std::size_t(r)] += c;
        } else {
          ++idle[std::size_t(r)];
        }
        cend[std::size_t(r)] = start[std::size_t(r)] + c;
        done[std::size_t(r)] = cend[std::size_t(r)];
      }
    } else
      for (int r = 0; r < P; ++r) {
        double c = 0;
        if (t < T) {
          const BlockTask task = balanced_task(r, t, P);
          if (task.idle()) {
            ++idle[std::size_t(r)];
          } else if (!cost.empty()) {
            const std::size_t d = std::size_t(task.q_rank - task.k_rank + P - 1);
            c = cost[d];
            if (!works[d]) ++idle[std::size_t(r)];
            busy[std::size_t(r)] += c;
          } else {
            const TileCounts tiles = w(task.q_rank, task.k_rank);
            c = tile_seconds(p, hw, tiles) + (tiles.computed() == 0 ? 0.0 : hw.step_overhead);
            if (tiles.computed() == 0) ++idle[std::size_t(r)];
            busy[std::size_t(r)] += c;
          }
        }
        cend[std::size_t(r)] = start[std::size_t(r)] + c;
        done[std::size_t(r)] = cend[std::size_t(r)];
      }
    const auto add = [&](std::size_t m, int from, int to, std::int64_t bytes, const double* time,
                         double at) {
      const bool near = hw.ranks_per_node > 0 && node[std::size_t(from)] == node[std::size_t(to)];
      has[m] = 1;
      known[m] = 0;
      dst[m] = to;
      ready[m] = at;
      dt[m] = time[near ? 1 : 0];
      sent[std::size_t(from)] += bytes;
      if (!near) network[std::size_t(from)] += bytes;
    };
    for (int r = 0; r < P; ++r) {
      const std::size_t m = 2 * std::size_t(r);
      has[m] = has[m + 1] = 0;
      if (h >= 1 && r < h && 2 * h < P) {  // it helped rank r - h + P at step h
        const int q = r - h + P;
        add(m, r, q, res, t_res, std::max(prev_cend[std::size_t(r)], prev_start[std::size_t(q)]));
      }
      if (t < T && u < T) {
        const int to = r + u < P ? r + u : balanced_helper_of(r, u, P);
        if (to >= 0)
          add(m + 1, r, to, r + u < P ? kv : qb, r + u < P ? t_kv : t_q,
              std::max(start[std::size_t(r)], start[std::size_t(to)]));
      }
    }
    // The other message on the receiving link of message m, or -1.
    const auto in_partner = [&](std::size_t m) -> long {
      const int x = dst[m];
      if (m % 2 == 1) {  // an input into x; a result comes from x + h - P
        const int from = x + h - P;
        return h >= 1 && 2 * h < P && from >= 0 && from < h ? long(2 * from) : -1L;
      }
      const int from = x >= u ? x - u : (2 * u < P ? x - u + P : -1);  // the input into x
      return from >= 0 && u < T && has[2 * std::size_t(from) + 1] ? long(2 * from + 1) : -1L;
    };
    const auto before = [&](std::size_t a, std::size_t b) {  // a is taken before b
      return ready[a] < ready[b] || (ready[a] == ready[b] && a < b);
    };
    for (std::size_t m0 = 0; m0 < 2 * n; ++m0) {
      if (!has[m0] || known[m0]) continue;
      {  // most messages share no link with an earlier one
        const std::size_t other = m0 ^ 1;
        const long pin = in_partner(m0);
        if (!(has[other] && before(other, m0)) && !(pin >= 0 && before(std::size_t(pin), m0))) {
          fin[m0] = std::max({ready[m0], out_free[m0 / 2], in_free[std::size_t(dst[m0])]}) + dt[m0];
          known[m0] = 1;
          continue;
        }
      }
      stack.clear();
      stack.push_back(int(m0));
      while (!stack.empty()) {
        const std::size_t m = std::size_t(stack.back());
        const std::size_t src = m / 2;
        const std::size_t other = m ^ 1;
        const long pin = in_partner(m);
        const bool wait_out = has[other] && before(other, m);
        const bool wait_in = pin >= 0 && before(std::size_t(pin), m);
        if (wait_out && !known[other]) {
          stack.push_back(int(other));
          continue;
        }
        if (wait_in && !known[std::size_t(pin)]) {
          stack.push_back(int(pin));
          continue;
        }
        const double link_out = wait_out ? fin[other] : out_free[src];
        const double link_in = wait_in ? fin[std::size_t(pin)] : in_free[std::size_t(dst[m])];
        fin[m] = std::max({ready[m], link_out, link_in}) + dt[m];
        known[m] = 1;
        stack.pop_back();
      }
    }
    for (std::size_t m = 0; m < 2 * n; ++m) {
      if (!has[m]) continue;
      const std::size_t src = m / 2, to = std::size_t(dst[m]);
      out_free[src] = std::max(out_free[src], fin[m]);
      in_free[to] = std::max(in_free[to], fin[m]);
      done[src] = std::max(done[src], fin[m]);
      done[to] = std::max(done[to], fin[m]);
    }
    prev_start.swap(start);
    prev_cend.swap(cend);
    start.swap(done);  // done is set afresh at the next step
  }
  const ForwardBufferBytes bytes = buffer_bytes(p);
  for (int r = 0; r < P; ++r) {
    RankPlan& rp = pr.ranks[std::size_t(r)];
    rp.step_count = T;
    rp.idle_step_count = idle[std::size_t(r)];
    rp.compute_s = busy[std::size_t(r)];
    rp.sent = sent[std::size_t(r)];
    rp.network = network[std::size_t(r)];
    rp.workspace_bytes = forward_workspace_bytes(balanced_slots(r, P), bytes);
    pr.makespan_s = std::max(pr.makespan_s, start[std::size_t(r)]);
  }
}

/// The balanced forward (BalancedSchedule) without a message list: at step
/// t the inputs of step t + 1 (a K/V block to an owner, a Q block to a
/// helper; posted at the start of step t by both ends) and the results of
/// step t - 1 (posted by the helper after its compute) complete. A rank may
/// send (and receive) two of them in one step: on each link they go in the
/// order predict_reference() takes them (ready time, then the schedule's
/// order), one at a time.
template <class Partition, class Mask>
void balanced_model(Prediction& pr, const Problem& p, const Hardware& hw,
                    PairWork<Partition, Mask>& w, int stride, bool keep) {
  const int P = p.P, T = balanced_steps(P);
  const std::int64_t kv = payload_bytes(p, Payload::kv), qb = payload_bytes(p, Payload::q),
                     res = payload_bytes(p, Payload::result);
  struct Msg {
    int src, dst;
    std::int64_t bytes;
    double ready, fin;
    int src_step, dst_step;
  };
  std::vector<double> start(std::size_t(P), 0.0), cend(static_cast<std::size_t>(P)),
      done(static_cast<std::size_t>(P));
  std::vector<double> prev_start(std::size_t(P), 0.0), prev_cend(std::size_t(P), 0.0);
  std::vector<double> out_free(std::size_t(P), 0.0), in_free(std::size_t(P), 0.0);
  std::vector<StepPlan> cur(static_cast<std::size_t>(P)), last(static_cast<std::size_t>(P));
  std::vector<Msg> msgs;
  std::vector<int> order;
  for (int t = 0; t <= T; ++t) {  // t == T: what completes after the last step
    for (int r = 0; r < P; ++r) {
      if (t < T) {
        const BlockTask task = balanced_task(r, t, P);
        cur[std::size_t(r)] = task.idle() ? step_work(p, hw, {}, {})
                                          : step_work(p, hw, task, w(task.q_rank, task.k_rank));
      } else {
        cur[std::size_t(r)] = StepPlan{};
      }
      cend[std::size_t(r)] = start[std::size_t(r)] + cur[std::size_t(r)].compute_s;
      done[std::size_t(r)] = cend[std::size_t(r)];
    }
    // Due now, in the reference's list order (by sender, then step).
    msgs.clear();
    const int u = t + 1;
    for (int r = 0; r < P; ++r) {
      if (t >= 1) {  // the result of step t - 1 to the rank it helped
        const BlockTask task = balanced_task(r, t - 1, P);
        if (!task.idle() && task.q_rank != r)
          msgs.push_back({r, task.q_rank, res,
                          std::max(prev_cend[std::size_t(r)], prev_start[std::size_t(task.q_rank)]),
                          0.0, t - 1, t - 1});
      }
      if (t < T && u < T) {  // an input of step u
        int to = -1;
        std::int64_t bytes = 0;
        if (r + u < P)
          to = r + u, bytes = kv;
        else if (const int h = balanced_helper_of(r, u, P); h >= 0)
          to = h, bytes = qb;
        if (to >= 0)
          msgs.push_back(
              {r, to, bytes, std::max(start[std::size_t(r)], start[std::size_t(to)]), 0.0, t, t});
      }
    }
    order.resize(msgs.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = int(i);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return msgs[std::size_t(a)].ready < msgs[std::size_t(b)].ready;
    });
    for (int i : order) {
      Msg& m = msgs[std::size_t(i)];
      const double dt = hw.transfer_seconds(m.src * stride, m.dst * stride, double(m.bytes));
      m.fin = std::max({m.ready, out_free[std::size_t(m.src)], in_free[std::size_t(m.dst)]}) + dt;
      out_free[std::size_t(m.src)] = in_free[std::size_t(m.dst)] = m.fin;
      done[std::size_t(m.src)] = std::max(done[std::size_t(m.src)], m.fin);
      done[std::size_t(m.dst)] = std::max(done[std::size_t(m.dst)], m.fin);
      StepPlan& a =
          std::min(m.src_step, T - 1) == t ? cur[std::size_t(m.src)] : last[std::size_t(m.src)];
      a.bytes_sent += m.bytes;
      if (!hw.same_node(m.src * stride, m.dst * stride)) a.network_bytes += m.bytes;
      a.comm_s += dt;
      StepPlan& b =
          std::min(m.dst_step, T - 1) == t ? cur[std::size_t(m.dst)] : last[std::size_t(m.dst)];
      b.bytes_received += m.bytes;
      b.comm_s += dt;
    }
    // Step t - 1 is complete (results of step t - 1 land in it): record it.
    for (int r = 0; r < P; ++r) {
      if (t >= 1) pr.ranks[std::size_t(r)].add(last[std::size_t(r)], keep);
      cur[std::size_t(r)].start_s = start[std::size_t(r)];
      cur[std::size_t(r)].end_s = done[std::size_t(r)];
      if (t >= 1 && keep) {
        // The last step ends where the virtual step after it does.
        if (t == T) pr.ranks[std::size_t(r)].steps.back().end_s = done[std::size_t(r)];
      }
      last[std::size_t(r)] = cur[std::size_t(r)];
      prev_start[std::size_t(r)] = start[std::size_t(r)];
      prev_cend[std::size_t(r)] = cend[std::size_t(r)];
      start[std::size_t(r)] = done[std::size_t(r)];
    }
  }
  const ForwardBufferBytes bytes = buffer_bytes(p);
  for (int r = 0; r < P; ++r) {
    pr.makespan_s = std::max(pr.makespan_s, start[std::size_t(r)]);
    pr.ranks[std::size_t(r)].workspace_bytes = forward_workspace_bytes(balanced_slots(r, P), bytes);
  }
}

}  // namespace detail

/// The reference model of one partition x mask x schedule, for any schedule:
/// every rank's every step from the schedule's description (step()), every
/// message in one list, and an event simulation of them. Work per rank and
/// step comes from the kernels' tile classifier on the partition's global
/// positions; the timing simulation runs the steps as DistributedAttention
/// does: the transfers a step needs are posted at the start of the step
/// before and complete at its end, a rank's link sends and receives one
/// message at a time per direction, and a message starts when both sides
/// have posted it (messages ready at the same time go in the order the
/// schedule lists them). O(P x steps) memory and O(P^2 x steps) time for the
/// all-gather: predict() uses it for schedules it has no model of, the tests
/// compare predict() with it.
/// count_pairs: also count allowed pairs (cost ~ pairs of partial tiles).
/// rank_stride: rank r of the prediction is rank r x rank_stride of the
/// machine (HybridAttention's rings: the ranks of one member index).
template <class Partition, class Schedule, class Mask>
Prediction predict_reference(const Problem& problem, const Mask& mask, const Hardware& hw,
                             bool count_pairs = false, int rank_stride = 1) {
  Prediction pr;
  pr.partition = Partition::name();
  pr.schedule = Schedule::name();
  const int P = problem.P;
  // One static_assert per missing member of the schedule (impl::check_schedule).
  static_assert(sizeof(impl::schedule_complete<Schedule>) > 0, "");
  if (std::string why = detail::layout_why_not<Partition, Schedule, Mask>(problem.N, P);
      !why.empty())
    return detail::invalid(std::move(pr), std::move(why));
  Problem p = problem;  // buffers sized for the longest rank, as DistributedAttention's
  p.most = max_local_length<Partition>(p.N, P);
  if constexpr (Schedule::template supports<Partition, Mask>)
    if (std::string why = Schedule::template can_implement<Partition>(mask, p.N, P); !why.empty())
      return detail::invalid(std::move(pr), std::move(why));
  const ScheduleContext ctx = schedule_context<Partition>(mask, p.N, P);
  const int steps = schedule_steps<Schedule>(ctx);
  std::vector<detail::Message> msgs;
  std::vector<std::int64_t> ws;
  detail::schedule_plan<Schedule>(p, ctx, msgs, ws);
  pr.ranks.resize(std::size_t(P));
  const std::int64_t inputs =
      detail::rows_bytes(p, 2 * p.heads + 2 * p.kv_heads, p.dim) + detail::state_bytes(p);
  for (int r = 0; r < P; ++r) {
    RankPlan& rp = pr.ranks[std::size_t(r)];
    rp.input_bytes = inputs;
    rp.workspace_bytes = ws[std::size_t(r)];
    for (int s = 0; s < steps; ++s) {
      StepPlan st;
      st.task = schedule_task<Schedule>(ctx, r, s);
      st.tiles = task_work<Partition>(mask, p.N, P, st.task, p.block_q, p.block_k, count_pairs);
      st.flops =
          4.0 * double(st.tiles.computed()) * p.block_q * p.block_k * p.dim * p.batch * p.heads;
      st.compute_s = detail::tile_seconds(p, hw, st.tiles) + (st.idle() ? 0.0 : hw.step_overhead);
      rp.steps.push_back(st);
    }
  }
  // Timing: steps in order; a virtual last step holds what completes after the loop.
  const int total = steps + 1;
  std::vector<double> start(std::size_t(P) * total), cend(std::size_t(P) * total),
      end(std::size_t(P) * total);
  auto at = [&](std::vector<double>& v, int r, int s) -> double& {
    return v[std::size_t(r) * total + std::size_t(s)];
  };
  std::vector<double> out_free(std::size_t(P), 0.0), in_free(std::size_t(P), 0.0);
  for (int s = 0; s < total; ++s) {
    std::vector<double> done(std::size_t(P), 0.0);
    for (int r = 0; r < P; ++r) {
      at(start, r, s) = s == 0 ? 0.0 : at(end, r, s - 1);
      at(cend, r, s) =
          at(start, r, s) + (s < steps ? pr.ranks[std::size_t(r)].steps[s].compute_s : 0.0);
      done[std::size_t(r)] = at(cend, r, s);
    }
    std::vector<std::pair<double, const detail::Message*>> due;
    for (const auto& m : msgs)
      if (std::min(m.done_step, steps) == s) {
        const double src_post =
            m.after_compute ? at(cend, m.src, m.src_step) : at(start, m.src, m.src_step);
        due.push_back({std::max(src_post, at(start, m.dst, m.dst_step)), &m});
      }
    std::stable_sort(due.begin(), due.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [ready, m] : due) {
      const double dt =
          hw.transfer_seconds(m->src * rank_stride, m->dst * rank_stride, double(m->bytes));
      const double begin =
          std::max({ready, out_free[std::size_t(m->src)], in_free[std::size_t(m->dst)]});
      const double fin = begin + dt;
      out_free[std::size_t(m->src)] = in_free[std::size_t(m->dst)] = fin;
      done[std::size_t(m->src)] = std::max(done[std::size_t(m->src)], fin);
      done[std::size_t(m->dst)] = std::max(done[std::size_t(m->dst)], fin);
      const int step_src = std::min(m->src_step, steps - 1);
      auto& ss = pr.ranks[std::size_t(m->src)].steps[std::size_t(step_src)];
      ss.bytes_sent += m->bytes;
      if (!hw.same_node(m->src * rank_stride, m->dst * rank_stride)) ss.network_bytes += m->bytes;
      ss.comm_s += dt;
      auto& sd = pr.ranks[std::size_t(m->dst)].steps[std::size_t(std::min(m->dst_step, steps - 1))];
      sd.bytes_received += m->bytes;
      sd.comm_s += dt;
    }
    for (int r = 0; r < P; ++r) at(end, r, s) = done[std::size_t(r)];
  }
  for (int r = 0; r < P; ++r) {
    for (int s = 0; s < steps; ++s) {
      auto& st = pr.ranks[std::size_t(r)].steps[std::size_t(s)];
      st.start_s = at(start, r, s);
      st.end_s = s + 1 < steps ? at(end, r, s) : at(end, r, steps);
    }
    pr.makespan_s = std::max(pr.makespan_s, at(end, r, steps));
    RankPlan& rp = pr.ranks[std::size_t(r)];
    std::vector<StepPlan> kept;
    kept.swap(rp.steps);
    for (const StepPlan& st : kept) rp.add(st, true);
  }
  pr.single_device_s = detail::tile_seconds(
      p, hw, detail::whole_sequence_tiles(mask, p.N, p.block_q, p.block_k, false));
  pr.fits = hw.memory_bytes <= 0 || double(pr.peak_bytes()) <= hw.memory_bytes;
  return pr;
}

namespace detail {

inline std::int64_t round_up(std::int64_t n, int b) {
  return (n + b - 1) / b * std::int64_t(b);
}

/// Bytes of one backward transfer's payload (the sizes the run's backward
/// sends): K and V rows in the storage type; a packed query block (Q, dO
/// rows padded to the backward's query tiles and head dim in the storage
/// type, LSE and D in the compute type); dQ and dK/dV partials in the
/// compute type.
inline std::int64_t backward_payload_bytes(const Problem& p, Payload what) {
  const std::int64_t b = p.batch, most = p.local(), s = p.dtype_bytes, cs = p.accumulator_bytes();
  const std::int64_t rows = b * p.heads * round_up(most, p.backward_block_q());
  switch (what) {
    case Payload::kv:
      return 2 * b * most * p.kv_heads * p.dim * s;
    case Payload::q:
      return 2 * rows * p.backward_stored_dim() * s + 2 * rows * cs;
    case Payload::dq:
      return b * most * p.heads * p.dim * cs;
    case Payload::dkv:
      return 2 * b * most * p.kv_heads * p.dim * cs;
    case Payload::result:
      break;
  }
  return 0;
}

/// The buffers of the backward of a rank holding `n` tokens, for
/// backward_workspace_bytes(): the caller's gradients are taken to be
/// LayoutRight Views of the storage type (16-bit ones get fp32 sums).
inline BackwardBufferBytes backward_buffer_bytes(const Problem& p, index_type n) {
  const std::int64_t b = p.batch, cs = p.accumulator_bytes(), dp = p.backward_stored_dim();
  BackwardBufferBytes bb;
  bb.kv = backward_payload_bytes(p, Payload::kv);
  bb.q = backward_payload_bytes(p, Payload::q);
  if (p.widens())
    bb.widened_q = 2 * b * p.heads * round_up(p.local(), p.backward_block_q()) * dp * cs;
  bb.keys = 3 * b * p.kv_heads * round_up(p.local(), p.backward_block_k()) * dp * cs;
  bb.dq = backward_payload_bytes(p, Payload::dq);
  bb.dkv = backward_payload_bytes(p, Payload::dkv);
  if (p.widens()) bb.own = b * n * (p.heads + 2 * std::int64_t(p.kv_heads)) * p.dim * cs;
  return bb;
}

/// Compute time of backward tiles: 10 D FLOPs per pair at Hardware::backward_rate(),
/// a partial tile at Hardware::backward_partial_cost() of a full one.
inline double backward_tile_seconds(const Problem& p, const Hardware& hw, const TileCounts& t) {
  const double rate = hw.backward_rate();
  if (rate <= 0) return 0;
  const double per_tile =
      10.0 * p.backward_block_q() * p.backward_block_k() * p.dim * double(p.batch) * p.heads;
  return (double(t.full) + hw.backward_partial_cost() * double(t.partial)) * per_tile / rate;
}

/// The whole sequence on one rank, same kernel model, for p.pass.
template <class Mask>
double single_device_seconds(const Problem& p, const Mask& mask, const Hardware& hw) {
  double t = 0;
  if (p.pass != Pass::backward)
    t += tile_seconds(p, hw, whole_sequence_tiles(mask, p.N, p.block_q, p.block_k, false));
  if (p.pass != Pass::forward)
    t += backward_tile_seconds(
        p, hw, whole_sequence_tiles(mask, p.N, p.backward_block_q(), p.backward_block_k(), false));
  return t;
}

/// The caller's Views of a backward on a rank of the longest length: q, o,
/// dO, dQ; k, v, dK, dV; LSE.
inline std::int64_t backward_input_bytes(const Problem& p) {
  return rows_bytes(p, 4 * p.heads + 4 * p.kv_heads, p.dim) + state_bytes(p);
}

/// Schedule::can_implement() for predict() and predict_backward(), from the
/// pair table: for the balanced schedule with a mask tabled by difference,
/// its first pair (i, j > i) that is not empty is (0, the nearest such j),
/// since rank 0 meets every distance.
template <class Partition, class Schedule, class Mask>
std::string implement_why_not(const Mask& mask, index_type N, int P,
                              const PairWork<Partition, Mask>& w) {
  if constexpr (!Schedule::template supports<Partition, Mask>) {
    return {};
  } else {
    if (std::is_same<Schedule, BalancedSchedule>::value && w.by_difference()) {
      for (int j = 1; j < P; ++j)
        if (!w.empty(0, j)) return BalancedSchedule::reaches_later(0, j);
      return {};
    }
    return Schedule::template can_implement<Partition>(mask, N, P);
  }
}

/// AllGatherSchedule::Backward::step() in O(P) at step 0 and O(1) after:
/// `used` counts the K/V slots `rank` filled at steps 1 .. s - 1 (call it for
/// s = 0, 1, ... in turn); the description's slot() recounts them (O(s) per
/// call, O(P^3) over a prediction). A send's dst_slot (the receiver's slot,
/// which no count of the sender's buffers reads) is left 0.
inline void allgather_backward_step(const ScheduleContext& c, int rank, int s, int& used,
                                    BackwardStep& out) {
  const int P = c.P, j = AllGatherSchedule::source(rank, s, P);
  const int in = s == 0 ? 0 : c.empty(rank, j) ? -1 : ++used;
  if (in >= 0) {
    out.task = {rank, j};
    out.kv_slot = in;
    if (s > 0) out.dkv_slot = s % 2;
  }
  if (s == 0) {
    int n = 0;
    for (int t = 1; t < P; ++t) {
      const int from = AllGatherSchedule::source(rank, t, P), to = (rank + t) % P;
      if (!c.empty(rank, from))
        out.transfers.push_back({from, rank, Payload::kv, 0, 0, false, t - 1, 0, ++n});
      if (!c.empty(to, rank))
        out.transfers.push_back({rank, to, Payload::kv, 0, 0, false, t - 1, 0, 0});
    }
    return;
  }
  const int i = s % 2;
  if (in >= 0) out.transfers.push_back({rank, j, Payload::dkv, s, s, true, s + 1, i, i, -1});
  const int from = (rank + s) % P;  // uses our block at its step s
  if (!c.empty(from, rank))
    out.transfers.push_back({from, rank, Payload::dkv, s, s, true, s + 1, i, i, -1});
}

/// A training step's attention from its forward and backward predictions:
/// times, steps (the backward's after the forward's), bytes and FLOPs add up;
/// the peak per rank is the larger of the two passes' (input_bytes: the
/// backward's Views; workspace_bytes: the rest of that peak).
inline Prediction training(Prediction f, const Prediction& b) {
  if (!f.valid) return f;
  if (!b.valid) return b;
  const double shift = f.makespan_s;
  for (std::size_t r = 0; r < f.ranks.size(); ++r) {
    RankPlan& x = f.ranks[r];
    const RankPlan& y = b.ranks[r];
    for (StepPlan st : y.steps) {
      st.start_s += shift;
      st.end_s += shift;
      x.steps.push_back(st);
    }
    const std::int64_t peak = std::max(x.peak_bytes(), y.peak_bytes());
    x.step_count += y.step_count;
    x.idle_step_count += y.idle_step_count;
    x.compute_s += y.compute_s;
    x.sent += y.sent;
    x.network += y.network;
    x.alltoall_bytes += y.alltoall_bytes;
    x.alltoall_network_bytes += y.alltoall_network_bytes;
    x.alltoall_s += y.alltoall_s;
    x.input_bytes = y.input_bytes;
    x.workspace_bytes = peak - y.input_bytes;
  }
  f.makespan_s += b.makespan_s;
  f.single_device_s += b.single_device_s;
  f.passes = 2;
  f.fits = f.fits && b.fits;
  return f;
}

}  // namespace detail

/// Predicts the backward of one partition x mask x schedule: the steps of
/// the schedule's backward description (Schedule::backward_type) with their
/// tiles at the backward kernels' tile sizes (Problem::bwd_block_q, _k),
/// priced at 10 D FLOPs per pair (Hardware::backward_rate()), its messages
/// (K/V blocks, packed query blocks, dQ and dK/dV partials at the sizes the
/// run sends) and workspace (backward_workspace_bytes(), RunStats'), timed as
/// predict_reference() times a forward: a message starts when both sides have
/// posted it and its links are free, in the order of readiness (ties: by
/// step, then rank). Generated step by step: O(P) memory besides the steps
/// kept (keep_steps) and, for a schedule other than the built-in ones, the
/// history of step starts (O(P x steps) doubles).
template <class Partition, class Schedule, class Mask>
Prediction predict_backward(const Problem& problem, const Mask& mask, const Hardware& hw,
                            bool count_pairs = false, int rank_stride = 1, bool keep_steps = true) {
  using B = typename Schedule::backward_type;
  Prediction pr;
  pr.partition = Partition::name();
  pr.schedule = Schedule::name();
  const int P = problem.P;
  static_assert(sizeof(impl::schedule_complete<Schedule>) > 0, "");
  if (std::string why = detail::layout_why_not<Partition, Schedule, Mask>(problem.N, P);
      !why.empty())
    return detail::invalid(std::move(pr), std::move(why));
  Problem p = problem;  // buffers sized for the longest rank, as the run's
  p.most = max_local_length<Partition>(p.N, P);
  const int bq = p.backward_block_q(), bk = p.backward_block_k();
  detail::PairWork<Partition, Mask> w(mask, p.N, P, bq, bk, count_pairs);
  if (std::string why = detail::implement_why_not<Partition, Schedule>(mask, p.N, P, w);
      !why.empty())
    return detail::invalid(std::move(pr), std::move(why));
  ScheduleContext ctx;
  ctx.P = P;
  ctx.empty_pair = [&w](int q_rank, int k_rank) { return w.empty(q_rank, k_rank); };
  ctx.reach = w.ring_reach();
  const int steps = B::steps(ctx), total = steps + 1;
  pr.ranks.resize(std::size_t(P));
  const std::int64_t inputs = detail::backward_input_bytes(p);
  const double pair_flops = 10.0 * bq * bk * p.dim * double(p.batch) * p.heads;
  // A message waits in the bucket of the step that completes it; its
  // receiver's post time (the start of dst_step) is filled in once that step
  // has started on every rank. The built-in descriptions post no receive
  // before the step that sends it, except the all-gather's at step 0 (whose
  // start is 0): they need no history of step starts. Other descriptions
  // keep it (P x steps doubles).
  constexpr bool gather = std::is_same<Schedule, AllGatherSchedule>::value;
  constexpr bool builtin = gather || std::is_same<Schedule, BalancedSchedule>::value ||
                           impl::is_kv_ring_forward<Schedule>::value;
  struct Pending {
    int src, dst, src_step, dst_step;
    std::int64_t bytes;
    double src_post, dst_post;
  };
  std::vector<std::vector<Pending>> due(static_cast<std::size_t>(total));
  std::vector<std::vector<std::pair<int, std::size_t>>> unresolved(static_cast<std::size_t>(total));
  std::vector<double> history(builtin ? 0 : std::size_t(P) * std::size_t(total), 0.0),
      done(std::size_t(P), 0.0), row(std::size_t(P), 0.0), out_free(std::size_t(P), 0.0),
      in_free(std::size_t(P), 0.0);  // row: the starts of the current step
  std::vector<BackwardSlots> slots(static_cast<std::size_t>(P));
  std::vector<int> used(gather ? std::size_t(P) : 0, 0);  // the all-gather's K/V slots so far
  std::vector<std::pair<double, const Pending*>> ready;
  std::vector<Pending> gathered;
  BackwardStep f;
  for (auto& rp : pr.ranks) {
    rp.input_bytes = inputs;
    if (keep_steps) rp.steps.reserve(std::size_t(steps));
  }
  const std::int64_t kv_bytes = detail::backward_payload_bytes(p, Payload::kv);
  for (int s = 0; s < total; ++s) {
    for (int r = 0; r < P; ++r) {
      RankPlan& rp = pr.ranks[std::size_t(r)];
      const double t0 = done[std::size_t(r)];  // the end of step s - 1 (0 at the start)
      row[std::size_t(r)] = t0;
      if (!builtin) history[std::size_t(r) * total + std::size_t(s)] = t0;
      if (s == steps) continue;
      f.clear();
      if constexpr (gather)
        detail::allgather_backward_step(ctx, r, s, used[std::size_t(r)], f);
      else
        B::step(ctx, r, s, f);
      add_backward_slots(slots[std::size_t(r)], f, r, s);
      StepPlan st;
      st.task = f.task;
      if (!f.task.idle()) st.tiles = w(f.task.q_rank, f.task.k_rank);
      st.flops = pair_flops * double(st.tiles.computed());
      st.compute_s =
          detail::backward_tile_seconds(p, hw, st.tiles) + (st.idle() ? 0.0 : hw.step_overhead);
      st.start_s = t0;
      done[std::size_t(r)] = t0 + st.compute_s;
      for (const ScheduledTransfer& t : f.transfers) {
        if (t.src != r || t.src_step != s) continue;
        if (gather && t.payload == Payload::kv) continue;  // generated when due (below)
        auto& bucket = due[std::size_t(std::min(t.done_step, steps))];
        Pending m{t.src,
                  t.dst,
                  t.src_step,
                  t.dst_step,
                  detail::backward_payload_bytes(p, t.payload),
                  t.after_compute ? done[std::size_t(r)] : t0,
                  0.0};
        if (t.dst_step >= s)
          unresolved[std::size_t(t.dst_step)].push_back(
              {std::min(t.done_step, steps), bucket.size()});
        else if (!builtin)
          m.dst_post = history[std::size_t(t.dst) * total + std::size_t(t.dst_step)];
        bucket.push_back(m);
      }
      ++rp.step_count;
      rp.idle_step_count += st.idle() ? 1 : 0;
      rp.compute_s += st.compute_s;
      if (keep_steps) rp.steps.push_back(st);
    }
    // Step s has started everywhere: the receivers' post times of step s.
    for (const auto& [b, i] : unresolved[std::size_t(s)]) {
      Pending& m = due[std::size_t(b)][i];
      m.dst_post = row[std::size_t(m.dst)];
    }
    std::vector<std::pair<int, std::size_t>>().swap(unresolved[std::size_t(s)]);
    // The all-gather's K/V of step s + 1, posted by both sides at step 0 (in
    // the order its description lists them: by sender), completed by step s.
    if constexpr (gather) {
      gathered.clear();
      if (s + 1 < steps)
        for (int r = 0; r < P; ++r) {
          const int to = (r + s + 1) % P;  // AllGatherSchedule::source(to, s + 1) == r
          if (!ctx.empty(to, r)) gathered.push_back({r, to, 0, 0, kv_bytes, 0.0, 0.0});
        }
      auto& bucket = due[std::size_t(s)];
      bucket.insert(bucket.begin(), gathered.begin(), gathered.end());
    }
    ready.clear();
    for (const Pending& m : due[std::size_t(s)])
      ready.push_back({std::max(m.src_post, m.dst_post), &m});
    std::stable_sort(ready.begin(), ready.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [at, m] : ready) {
      const std::size_t a = std::size_t(m->src), b = std::size_t(m->dst);
      const bool net = !hw.same_node(m->src * rank_stride, m->dst * rank_stride);
      const double dt =
          hw.transfer_seconds(m->src * rank_stride, m->dst * rank_stride, double(m->bytes));
      const double fin = std::max({at, out_free[a], in_free[b]}) + dt;
      out_free[a] = in_free[b] = fin;
      done[a] = std::max(done[a], fin);
      done[b] = std::max(done[b], fin);
      RankPlan &ra = pr.ranks[a], &rb = pr.ranks[b];
      ra.sent += m->bytes;
      ra.network += net ? m->bytes : 0;
      if (keep_steps && steps > 0) {
        StepPlan& x = ra.steps[std::size_t(std::min(m->src_step, steps - 1))];
        x.bytes_sent += m->bytes;
        x.network_bytes += net ? m->bytes : 0;
        x.comm_s += dt;
        StepPlan& y = rb.steps[std::size_t(std::min(m->dst_step, steps - 1))];
        y.bytes_received += m->bytes;
        y.comm_s += dt;
      }
    }
    std::vector<Pending>().swap(due[std::size_t(s)]);
    // Step s ends here; the last one with what completes after the loop.
    if (keep_steps && steps > 0 && s != steps - 1)
      for (int r = 0; r < P; ++r)
        pr.ranks[std::size_t(r)].steps[std::size_t(std::min(s, steps - 1))].end_s =
            done[std::size_t(r)];
  }
  for (int r = 0; r < P; ++r) {
    RankPlan& rp = pr.ranks[std::size_t(r)];
    rp.workspace_bytes = backward_workspace_bytes(
        slots[std::size_t(r)],
        detail::backward_buffer_bytes(p, local_length<Partition>(p.N, P, r)));
    pr.makespan_s = std::max(pr.makespan_s, done[std::size_t(r)]);
  }
  pr.single_device_s = detail::single_device_seconds(p, mask, hw);
  pr.fits = hw.memory_bytes <= 0 || double(pr.peak_bytes()) <= hw.memory_bytes;
  return pr;
}

/// Predicts one partition x mask x schedule: per rank and step the block
/// pair, its tiles (the kernels' classifier), the messages of the schedule's
/// description and their timing, as predict_reference() does, in O(P)
/// memory (O(P x steps) with keep_steps) and O(P x steps) time for the
/// built-in schedules (the KV ring, the all-gather, the balanced schedule),
/// with the tiles of a block pair computed once per class of pairs where the
/// layout repeats (detail::PairWork). Other schedules go to
/// predict_reference(). count_pairs: also count allowed pairs (cost ~ pairs
/// of partial tiles). rank_stride: rank r of the prediction is rank r x
/// rank_stride of the machine (HybridAttention's rings: the ranks of one
/// member index). keep_steps: keep RankPlan::steps (else only the totals).
/// Problem::pass: backward goes to predict_backward(), training adds the
/// forward and the backward (detail::training()).
template <class Partition, class Schedule, class Mask>
Prediction predict(const Problem& problem, const Mask& mask, const Hardware& hw,
                   bool count_pairs = false, int rank_stride = 1, bool keep_steps = true) {
  if (problem.pass != Pass::forward) {
    Problem b = problem;
    b.pass = Pass::backward;
    Prediction back =
        predict_backward<Partition, Schedule>(b, mask, hw, count_pairs, rank_stride, keep_steps);
    if (problem.pass == Pass::backward) return back;
    Problem f = problem;
    f.pass = Pass::forward;
    return detail::training(
        predict<Partition, Schedule>(f, mask, hw, count_pairs, rank_stride, keep_steps), back);
  }
  constexpr bool ring = impl::is_kv_ring_forward<Schedule>::value,
                 gather = std::is_same<Schedule, AllGatherSchedule>::value,
                 balanced = std::is_same<Schedule, BalancedSchedule>::value;
  if constexpr (!ring && !gather && !balanced) {
    return predict_reference<Partition, Schedule>(problem, mask, hw, count_pairs, rank_stride);
  } else {
    Prediction pr;
    pr.partition = Partition::name();
    pr.schedule = Schedule::name();
    const int P = problem.P;
    if (std::string why = detail::layout_why_not<Partition, Schedule, Mask>(problem.N, P);
        !why.empty())
      return detail::invalid(std::move(pr), std::move(why));
    Problem p = problem;  // buffers sized for the longest rank, as DistributedAttention's
    p.most = max_local_length<Partition>(p.N, P);
    detail::PairWork<Partition, Mask> w(mask, p.N, P, p.block_q, p.block_k, count_pairs);
    if (std::string why = detail::implement_why_not<Partition, Schedule>(mask, p.N, P, w);
        !why.empty())
      return detail::invalid(std::move(pr), std::move(why));
    pr.ranks.resize(std::size_t(P));
    const std::int64_t inputs =
        detail::rows_bytes(p, 2 * p.heads + 2 * p.kv_heads, p.dim) + detail::state_bytes(p);
    for (auto& rp : pr.ranks) rp.input_bytes = inputs;
    if constexpr (balanced) {
      if (keep_steps)
        detail::balanced_model(pr, p, hw, w, rank_stride, true);
      else
        detail::balanced_totals(pr, p, hw, w, rank_stride);
    } else {
      const int S = w.ring_reach() + 1;
      if constexpr (gather) {
        detail::allgather_model(pr, p, hw, w, S, rank_stride, keep_steps);
      } else {
        detail::ring_model(pr, p, hw, w, S, rank_stride, keep_steps);
        ScheduleContext c{P, {}};
        c.reach = S - 1;
        const std::int64_t ws =
            forward_workspace_bytes(forward_slots<Schedule>(c, 0), detail::buffer_bytes(p));
        for (auto& rp : pr.ranks) rp.workspace_bytes = ws;
      }
    }
    pr.single_device_s = detail::tile_seconds(
        p, hw, detail::whole_sequence_tiles(mask, p.N, p.block_q, p.block_k, false));
    pr.fits = hw.memory_bytes <= 0 || double(pr.peak_bytes()) <= hw.memory_bytes;
    return pr;
  }
}

/// Predicts UlyssesAttention (head-parallel all-to-all, arXiv:2309.14509) on
/// the partition's layout: every rank computes the whole sequence for H / P
/// heads (the same work on every rank, whatever the mask), after the
/// all-to-alls of Q, K, V and before those of O and LSE, which do not overlap
/// with the compute. An all-to-all costs each rank P - 1 messages per
/// direction, one at a time (latency + bytes / B each). Bytes and workspace
/// are those of ulysses_forward_volume() (blockattn/schedule/ulysses.hpp),
/// which the run reports in RunStats.
template <class Partition, class Mask>
Prediction predict_ulysses(const Problem& p, const Mask& mask, const Hardware& hw,
                           bool count_pairs = false) {
  if (p.pass == Pass::training) {
    Problem f = p, b = p;
    f.pass = Pass::forward;
    b.pass = Pass::backward;
    return detail::training(predict_ulysses<Partition>(f, mask, hw, count_pairs),
                            predict_ulysses<Partition>(b, mask, hw, count_pairs));
  }
  const bool bwd = p.pass == Pass::backward;
  Prediction pr;
  pr.partition = Partition::name();
  pr.schedule = "ulysses";
  const int P = p.P;
  if (std::string why = detail::length_why_not<Partition>(p.N, P); !why.empty())
    return detail::invalid(std::move(pr), std::move(why));
  if (std::string why = UlyssesHeads::why_not(p.heads, p.kv_heads, P); !why.empty())
    return detail::invalid(std::move(pr), std::move(why));
  const UlyssesHeads u = UlyssesHeads::make(p.heads, p.kv_heads, P);
  const int cs = p.accumulator_bytes();
  const std::int64_t b = p.batch, hq = u.heads_per_rank, hk = u.kv_heads_per_rank;
  const int bq = bwd ? p.backward_block_q() : p.block_q,
            bk = bwd ? p.backward_block_k() : p.block_k;
  // The local attention's packed buffers (compute type): the forward's K/V
  // block; the backward's keys (K^T, V^T panels, K rows) and rows (Q, dO, LSE, D).
  const std::int64_t keys_padded = detail::round_up(p.N, bk),
                     rows_padded = detail::round_up(p.N, bq);
  const std::int64_t packed = bwd ? (3 * hk * keys_padded * p.backward_stored_dim() +
                                     2 * hq * rows_padded * (p.backward_stored_dim() + 1)) *
                                        b * cs
                                  : 2 * b * hk * keys_padded * p.stored_dim() * cs;
  // Chunks of the longest rank's tokens (every rank's when P divides N).
  Problem widest = p;
  widest.most = max_local_length<Partition>(p.N, P);
  const UlyssesForwardVolume vol =
      bwd ? ulysses_backward_volume(u, p.batch, p.N, p.dim, p.dtype_bytes, cs, cs, packed,
                                    widest.most)
          : ulysses_forward_volume(u, p.batch, p.N, p.dim, p.dtype_bytes, cs, packed, widest.most);
  // Time: the all-to-alls in (Q, K, V; backward: and O, dO, LSE) and out (O,
  // LSE; backward: dQ, dK, dV in the compute type), P - 1 chunks each.
  const std::int64_t n = widest.local(), chunk_row = b * n * p.dim;
  const auto a2a = [&](std::int64_t chunk_bytes) {
    return detail::alltoall_seconds(hw, 0, P, 1, chunk_bytes);
  };
  const std::int64_t s = p.dtype_bytes;
  const double lse_a2a = a2a(b * n * hq * cs);
  const double in = (bwd ? 3 : 1) * a2a(chunk_row * hq * s) + 2 * a2a(chunk_row * hk * s) +
                    (bwd ? lse_a2a : 0.0),
               out = a2a(chunk_row * hq * s) + (bwd ? 2 * a2a(chunk_row * hk * cs) : lse_a2a);
  Problem local = p;
  local.heads = u.heads_per_rank;
  StepPlan st;
  st.task = BlockTask{};
  st.tiles = detail::whole_sequence_tiles(mask, p.N, bq, bk, count_pairs);
  st.flops = (bwd ? 10.0 : 4.0) * double(st.tiles.computed()) * bq * bk * p.dim * p.batch * hq;
  st.compute_s = (bwd ? detail::backward_tile_seconds(local, hw, st.tiles)
                      : detail::tile_seconds(local, hw, st.tiles)) +
                 hw.step_overhead;
  st.comm_s = in + out;
  st.bytes_sent = st.bytes_received = vol.sent;
  st.start_s = 0;
  st.end_s = in + st.compute_s + out;
  const std::int64_t inputs =
      bwd ? detail::backward_input_bytes(widest)
          : detail::rows_bytes(widest, 2 * p.heads + 2 * p.kv_heads, p.dim) +
                detail::state_bytes(widest);
  pr.ranks.resize(std::size_t(P));
  for (int r = 0; r < P; ++r) {
    RankPlan& rp = pr.ranks[std::size_t(r)];
    rp.input_bytes = inputs;
    rp.workspace_bytes = vol.workspace;
    st.task.q_rank = st.task.k_rank = r;
    // The same bytes to each of the P - 1 peers.
    st.network_bytes = P > 1 ? vol.sent / (P - 1) * detail::alltoall_remote_peers(hw, 0, P, r) : 0;
    rp.add(st, true);
  }
  pr.makespan_s = st.end_s;
  pr.single_device_s = detail::single_device_seconds(p, mask, hw);
  pr.fits = hw.memory_bytes <= 0 || double(pr.peak_bytes()) <= hw.memory_bytes;
  return pr;
}

/// Predicts HybridAttention on a P = ulysses x (P / ulysses) grid: the
/// all-to-alls inside each group of `ulysses` consecutive ranks (Q, K, V in,
/// O and LSE out, as predict_ulysses on the group's N / P_r tokens; on the
/// intra-node links when a group sits on one node), around the ring of
/// Partition x Schedule across the groups for H / ulysses heads (predict()
/// on P_r ranks; its messages between ranks g x ulysses + a of different
/// groups). Bytes and workspace are what the run reports: the ring's steps,
/// RankPlan::alltoall_bytes = RunStats::alltoall_bytes, and the peak of
/// ulysses_forward_volume() around the ring's workspace. The ring's times and
/// network bytes are those of member 0's ranks (g x ulysses); exact for every
/// member when groups and nodes align (ulysses divides ranks_per_node or the
/// reverse).
template <class Partition, class Schedule, class Mask>
Prediction predict_hybrid(const Problem& p, const Mask& mask, const Hardware& hw, int ulysses,
                          bool count_pairs = false, bool keep_steps = true) {
  if (p.pass == Pass::training) {
    Problem f = p, b = p;
    f.pass = Pass::forward;
    b.pass = Pass::backward;
    return detail::training(
        predict_hybrid<Partition, Schedule>(f, mask, hw, ulysses, count_pairs, keep_steps),
        predict_hybrid<Partition, Schedule>(b, mask, hw, ulysses, count_pairs, keep_steps));
  }
  const bool bwd = p.pass == Pass::backward;
  Prediction pr;
  pr.partition = Partition::name();
  pr.ulysses = ulysses;
  const int P = p.P;
  pr.schedule = std::string("hybrid ") + std::to_string(ulysses) + "x" +
                std::to_string(ulysses > 0 ? P / ulysses : 0) + " " + Schedule::name();
  auto invalid = [&](std::string why) {
    pr.valid = false;
    pr.why_not = std::move(why);
    return pr;
  };
  if (const std::string why = HybridGrid::why_not(P, ulysses); !why.empty()) return invalid(why);
  const HybridGrid g = HybridGrid::make(P, ulysses);
  if (const std::string why = hybrid_length_why_not<Partition>(p.N, g); !why.empty())
    return invalid(why);
  if (const std::string why = UlyssesHeads::why_not(p.heads, p.kv_heads, ulysses); !why.empty())
    return invalid(why);
  const UlyssesHeads u = UlyssesHeads::make(p.heads, p.kv_heads, ulysses);
  Problem inner = p;
  inner.P = g.ring;
  inner.heads = u.heads_per_rank;
  inner.kv_heads = u.kv_heads_per_rank;
  const Prediction ring =
      predict<Partition, Schedule>(inner, mask, hw, count_pairs, ulysses, keep_steps);
  if (!ring.valid) return invalid(ring.why_not);
  // The all-to-alls: chunks of the longest member's tokens (N / P when the
  // layout is even), as in predict_ulysses; a group's chunks are those of its
  // longest member.
  const int cs = p.accumulator_bytes();
  const auto group_tokens = [&](int group) {
    return hybrid_group_length<Partition>(p.N, g, group);
  };
  std::int64_t n = 0;
  for (int r = 0; r < P; ++r) n = std::max<std::int64_t>(n, hybrid_length<Partition>(p.N, g, r));
  const std::int64_t s = p.dtype_bytes, chunk_row = std::int64_t(p.batch) * n * p.dim;
  const auto a2a = [&](std::int64_t chunk) {
    return detail::alltoall_seconds(hw, 0, ulysses, g.ring, chunk);
  };
  // Backward: O, dO and LSE join Q, K, V on the way in; dQ, dK, dV go back
  // in the storage type (the ring's gradients).
  const double lse_a2a = a2a(std::int64_t(p.batch) * n * u.heads_per_rank * cs);
  const double in = (bwd ? 3 : 1) * a2a(chunk_row * u.heads_per_rank * s) +
                    2 * a2a(chunk_row * u.kv_heads_per_rank * s) + (bwd ? lse_a2a : 0.0),
               out = a2a(chunk_row * u.heads_per_rank * s) +
                     (bwd ? 2 * a2a(chunk_row * u.kv_heads_per_rank * s) : lse_a2a);
  Problem widest = p;
  widest.most = n;
  const std::int64_t inputs =
      bwd ? detail::backward_input_bytes(widest)
          : detail::rows_bytes(widest, 2 * p.heads + 2 * p.kv_heads, p.dim) +
                detail::state_bytes(widest);
  pr.ranks.resize(std::size_t(P));
  for (int r = 0; r < P; ++r) {
    const RankPlan& rr = ring.ranks[std::size_t(g.group(r))];
    RankPlan& rp = pr.ranks[std::size_t(r)];
    const index_type Ng = group_tokens(g.group(r));
    const index_type most = impl::EvenCut{Ng, ulysses}.length(0);
    const UlyssesForwardVolume vol =
        bwd ? ulysses_backward_volume(u, p.batch, Ng, p.dim, p.dtype_bytes, cs, p.dtype_bytes,
                                      rr.workspace_bytes, most)
            : ulysses_forward_volume(u, p.batch, Ng, p.dim, p.dtype_bytes, cs, rr.workspace_bytes,
                                     most);
    rp.steps = rr.steps;
    rp.step_count = rr.step_count;
    rp.idle_step_count = rr.idle_step_count;
    rp.compute_s = rr.compute_s;
    rp.sent = rr.sent;
    rp.network = rr.network;
    for (auto& st : rp.steps) {
      st.start_s += in;
      st.end_s += in;
      if (st.task.q_rank >= 0) st.task.q_rank = g.rank_of(st.task.q_rank, g.member(r));
      if (st.task.k_rank >= 0) st.task.k_rank = g.rank_of(st.task.k_rank, g.member(r));
    }
    rp.input_bytes = inputs;
    rp.workspace_bytes = vol.workspace;
    rp.alltoall_bytes = vol.sent;
    rp.alltoall_network_bytes =
        ulysses > 1
            ? vol.sent / (ulysses - 1) *
                  detail::alltoall_remote_peers(hw, g.group(r) * ulysses, ulysses, g.member(r))
            : 0;
    rp.alltoall_s = in + out;
  }
  pr.makespan_s = in + ring.makespan_s + out;
  pr.single_device_s = detail::single_device_seconds(p, mask, hw);
  pr.fits = hw.memory_bytes <= 0 || double(pr.peak_bytes()) <= hw.memory_bytes;
  return pr;
}

/// Every built-in combination for this mask: contiguous, striped and zigzag
/// with the KV ring (and, when p.pass has a backward, zigzag with the Q ring:
/// BurstSchedule), contiguous with the balanced schedule (masks other than
/// full), zigzag with the all-gather (Llama 3's layout), and the head-parallel
/// all-to-all (Ulysses; invalid when P does not divide the heads), and on
/// two-level hardware (ranks_per_node > 0) the 2D hybrid for every group size
/// 1 < P_a < P that divides P and the heads, last. The first entry is the
/// contiguous ring, the baseline of speedup_over_ring().
template <class Mask>
std::vector<Prediction> compare(const Problem& p, const Mask& mask, const Hardware& hw,
                                bool count_pairs = false, bool keep_steps = true) {
  std::vector<Prediction> all;
  all.push_back(
      predict<ContiguousPartition, RingSchedule>(p, mask, hw, count_pairs, 1, keep_steps));
  all.push_back(predict<StripedPartition, RingSchedule>(p, mask, hw, count_pairs, 1, keep_steps));
  all.push_back(predict<ZigzagPartition, RingSchedule>(p, mask, hw, count_pairs, 1, keep_steps));
  // The Q ring's forward is the KV ring's; its backward moves the queries.
  if (p.pass != Pass::forward)
    all.push_back(predict<ZigzagPartition, BurstSchedule>(p, mask, hw, count_pairs, 1, keep_steps));
  if constexpr (!std::is_same<Mask, FullMask>::value)
    all.push_back(
        predict<ContiguousPartition, BalancedSchedule>(p, mask, hw, count_pairs, 1, keep_steps));
  all.push_back(
      predict<ZigzagPartition, AllGatherSchedule>(p, mask, hw, count_pairs, 1, keep_steps));
  all.push_back(predict_ulysses<ContiguousPartition>(p, mask, hw, count_pairs));
  // Two-level hardware: the 2D hybrid on every grid whose groups split the
  // heads (zigzag ring across groups; contiguous for the full mask, whose
  // work is even on any layout).
  if (hw.ranks_per_node > 0)
    for (int a = 2; a < p.P; ++a) {
      if (p.P % a != 0 || !UlyssesHeads::why_not(p.heads, p.kv_heads, a).empty()) continue;
      if constexpr (std::is_same<Mask, FullMask>::value)
        all.push_back(predict_hybrid<ContiguousPartition, RingSchedule>(p, mask, hw, a, count_pairs,
                                                                        keep_steps));
      else
        all.push_back(
            predict_hybrid<ZigzagPartition, RingSchedule>(p, mask, hw, a, count_pairs, keep_steps));
    }
  for (auto& x : all) x.ring_makespan_s = all[0].makespan_s;
  return all;
}

/// Index of the fastest valid prediction that fits in memory (ties: less
/// memory, then fewer bytes sent); -1 when none does.
inline int recommend(const std::vector<Prediction>& all) {
  int best = -1;
  for (int i = 0; i < int(all.size()); ++i) {
    const Prediction& x = all[std::size_t(i)];
    if (!x.valid || !x.fits) continue;
    if (best < 0) {
      best = i;
      continue;
    }
    const Prediction& b = all[std::size_t(best)];
    const double tol = 1e-9 * b.makespan_s;
    if (x.makespan_s < b.makespan_s - tol ||
        (x.makespan_s <= b.makespan_s + tol &&
         (x.peak_bytes() < b.peak_bytes() ||
          (x.peak_bytes() == b.peak_bytes() && x.max_bytes_sent() < b.max_bytes_sent()))))
      best = i;
  }
  return best;
}

}  // namespace plan
}  // namespace blockattn
