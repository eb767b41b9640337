// SPDX-License-Identifier: Apache-2.0
// The single-device forward behind attention_forward(): view checks, the head-dim
// and tile-shape dispatch, packing and the kernel launch. Also used by the
// distributed step loop (one block pair per call, resumable softmax state).
#pragma once

#include <algorithm>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/impl/forward_kernel.hpp>
#include <blockattn/kernel/impl/pack.hpp>
#include <blockattn/kernel/impl/policy_check.hpp>
#include <blockattn/kernel/impl/softmax_state.hpp>
#include <blockattn/kernel/options.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace blockattn {

namespace impl {

template <class V>
using value_of = typename V::non_const_value_type;

/// True when q, k, v, o, lse are Views of the ranks and value types attention_forward takes.
template <class QV, class KV, class VV, class OV, class LV>
constexpr bool forward_views_ok() {
  if constexpr (Kokkos::is_view<QV>::value && Kokkos::is_view<KV>::value &&
                Kokkos::is_view<VV>::value && Kokkos::is_view<OV>::value &&
                Kokkos::is_view<LV>::value) {
    using T = value_of<OV>;
    return QV::rank == 4 && KV::rank == 4 && VV::rank == 4 && OV::rank == 4 && LV::rank == 3 &&
           is_value_type_v<T> && std::is_same<value_of<QV>, T>::value &&
           std::is_same<value_of<KV>, T>::value && std::is_same<value_of<VV>, T>::value &&
           std::is_same<value_of<LV>, compute_t<T>>::value &&
           !std::is_const<typename OV::value_type>::value &&
           !std::is_const<typename LV::value_type>::value;
  } else {
    return false;
  }
}

/// One static_assert per requirement, each naming the fix.
template <class QV, class KV, class VV, class OV, class LV>
constexpr void check_forward_view_types() {
  constexpr bool views = Kokkos::is_view<QV>::value && Kokkos::is_view<KV>::value &&
                         Kokkos::is_view<VV>::value && Kokkos::is_view<OV>::value &&
                         Kokkos::is_view<LV>::value;
  static_assert(views, "BlockAttn: attention_forward takes Kokkos::Views q, k, v, o, lse");
  if constexpr (views) {
    static_assert(QV::rank == 4 && KV::rank == 4 && VV::rank == 4 && OV::rank == 4,
                  "BlockAttn: q, k, v and o must be rank-4 Views (batch, seq, heads, head_dim)");
    static_assert(LV::rank == 3, "BlockAttn: lse must be a rank-3 View (batch, heads, seq)");
    using T = value_of<OV>;
    static_assert(is_value_type_v<T>,
                  "BlockAttn: the value type of o must be float, double, blockattn::bf16 or "
                  "blockattn::fp16");
    static_assert(std::is_same<value_of<QV>, T>::value && std::is_same<value_of<KV>, T>::value &&
                      std::is_same<value_of<VV>, T>::value,
                  "BlockAttn: q, k, v and o must have the same value type (mixed storage types "
                  "are not supported: convert the inputs)");
    static_assert(std::is_same<value_of<LV>, compute_t<T>>::value,
                  "BlockAttn: lse must have the compute type of the values: float for float, "
                  "bf16 and fp16, double for double");
    static_assert(!std::is_const<typename OV::value_type>::value &&
                      !std::is_const<typename LV::value_type>::value,
                  "BlockAttn: o and lse are outputs and must not be Views of const");
  }
}

/// Validates shapes and spaces of a forward call; returns the extents.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
ForwardExtents validate_forward(const char* fn, const QV& q, const KV& k, const VV& v, const OV& o,
                                const LV& lse, double scale, bool empty_seq_ok = false) {
  require_accessible<ExecSpace, typename QV::memory_space>(fn, "q");
  require_accessible<ExecSpace, typename KV::memory_space>(fn, "k");
  require_accessible<ExecSpace, typename VV::memory_space>(fn, "v");
  require_accessible<ExecSpace, typename OV::memory_space>(fn, "o");
  require_accessible<ExecSpace, typename LV::memory_space>(fn, "lse");
  const char* names[4] = {"batch", "seq", "heads", "head_dim"};
  for (int d = 0; d < 4; ++d) {
    if (d == 1 && empty_seq_ok) continue;  // a rank of a distributed call may hold no token
    require_positive_extent(fn, "q", q, d, names[d]);
    require_positive_extent(fn, "k", k, d, names[d]);
  }
  require_extent(fn, "k", k, 0, "batch", q.extent(0), "the batch of q");
  require_extent(fn, "k", k, 3, "head_dim", q.extent(3), "the head_dim of q");
  for (int d = 0; d < 4; ++d)
    require_extent(fn, "v", v, d, names[d], k.extent(d), "the same extent of k");
  for (int d = 0; d < 4; ++d)
    require_extent(fn, "o", o, d, names[d], q.extent(d), "the same extent of q");
  require_extent(fn, "lse", lse, 0, "batch", q.extent(0), "q.extent(0)");
  require_extent(fn, "lse", lse, 1, "heads", q.extent(2), "q.extent(2)");
  require_extent(fn, "lse", lse, 2, "seq", q.extent(1), "q.extent(1)");
  if (q.extent(2) % k.extent(2) != 0)
    fail(fn, "argument 'k' has extent(2) (heads) = ", k.extent(2),
         ", expected a divisor of the heads of q (", q.extent(2), ")");
  if (q.extent(3) > std::size_t(max_head_dim))
    fail(fn, "argument 'q' has extent(3) (head_dim) = ", q.extent(3), ", expected at most ",
         max_head_dim);
  constexpr std::size_t int_max = std::size_t(std::numeric_limits<int>::max());
  if (q.extent(1) > int_max / 2 || k.extent(1) > int_max / 2)
    fail(fn, "sequence length ", q.extent(1) > k.extent(1) ? q.extent(1) : k.extent(1),
         " exceeds the per-call limit of ", int_max / 2, " rows");
  if (!std::isnan(scale) && !(std::isfinite(scale) && scale != 0.0))
    fail(fn, "argument 'scale' is ", scale, ", expected a finite non-zero value");
  using T = compute_t<value_of<OV>>;
  // The kernels multiply by scale * log2(e) in T: it must be a normal number of T.
  const double limit = double(std::numeric_limits<T>::max()) / 1.4426950408889634;
  if (!std::isnan(scale) && (std::abs(scale) > limit || std::abs(scale) * 1.4426950408889634 <
                                                            double(std::numeric_limits<T>::min())))
    fail(fn, "argument 'scale' is ", scale, ", which ", std::abs(scale) > limit ? "over" : "under",
         "flows ", std::is_same<T, float>::value ? "float" : "double",
         " (the compute type) once multiplied by log2(e); expected ",
         double(std::numeric_limits<T>::min()) / 1.4426950408889634, " <= |scale| <= ", limit);
  ForwardExtents e;
  e.batch = int(q.extent(0));
  e.queries = int(q.extent(1));
  e.heads = int(q.extent(2));
  e.dim = int(q.extent(3));
  e.keys = int(k.extent(1));
  e.kv_heads = int(k.extent(2));
  return e;
}

/// Global positions are bounded by +-2^62, so that differences of positions
/// (masks compare k - q) never overflow 64-bit index_type.
inline constexpr index_type max_position = index_type(1) << 62;

/// The offsets of ForwardOptions: any sign, |offset| <= max_position.
inline void require_offsets(const char* fn, const ForwardOptions& opts) {
  const index_type off[2] = {opts.q_offset, opts.k_offset};
  const char* names[2] = {"opts.q_offset", "opts.k_offset"};
  for (int i = 0; i < 2; ++i)
    if (off[i] > max_position || off[i] < -max_position)
      fail(fn, "argument '", names[i], "' is ", off[i],
           ", expected |offset| <= 2^62 = ", max_position,
           " (global positions are bounded so that k - q never overflows)");
}

/// The softmax scale: the caller's, or 1 / sqrt(head_dim) when NaN (the default).
template <class T>
T softmax_scale(double requested, int head_dim) {
  return std::isnan(requested) ? T(1) / std::sqrt(T(head_dim)) : T(requested);
}

/// How one kernel call relates to the calls before and after it over other
/// K/V blocks of the same queries (the ring schedules make one call per step).
template <class T, class MemorySpace>
struct BlockStep {
  SoftmaxState<T, MemorySpace> state;  // (m, l) of the rows between calls; O lives in o
  bool resume = false;                 // continue from the state of an earlier call
  bool finish = true;                  // normalise into o and lse
  bool skip_keys = false;              // no key tile at all (only resume/finish)
  // Launch only teams [league_begin, league_end) of (batch, head, query tile);
  // league_end < 0: all. Schedules split a step to progress communication.
  int league_begin = 0, league_end = -1;
  // How the queries are cut into team tiles; default: tiles of block_q rows.
  // See balanced_query_tiles.
  QueryTiles query_tiles;
  // Where the unnormalised O lives between calls (resume / !finish): empty
  // means the caller's o, which then must have value type T.
  Kokkos::View<T****, Kokkos::LayoutStride, MemorySpace> o_acc;
};

/// Number of teams (batch x heads x query tiles) of a forward launch with the
/// query split `split` (default: tiles of block_q rows).
template <class Shape>
int forward_league_size(const ForwardExtents& e, const QueryTiles& split = {}) {
  return e.batch * e.heads * split.resolved(e.queries, Shape::block_q, Shape::micro_rows).tiles;
}

/// The query split for `threads` threads taking teams one at a time
/// (heaviest-first, dynamic): tiles of block_q rows, unless another split
/// finishes sooner by the row count. At N = 1024 on 2 threads 11 tiles of 96
/// rows are 6 tiles (544 rows) on one thread and 5 (480) on the other. The
/// candidates, each tile at most block_q and at least half of it tall:
///  - tiles of fewer rows (a multiple of micro_rows; 13 tiles of 84 rows, the
///    last 16, are 7 + 6 tiles, 520 and 504 rows);
///  - where `rows_are_work` (every query row meets the same keys: the mask
///    keeps the whole block), an even split over as many or more tiles (12
///    tiles of 84 or 90 rows: about 512 rows per thread). Elsewhere tile
///    heights other than block_q cut more key tiles on a causal diagonal:
///    there an even split measured up to 6 % slower at N = 512, 2 threads.
/// With 8 or more teams per thread dynamic scheduling evens out within a few
/// percent and every extra tile streams all of K and V once more: there only
/// the even split over the same number of tiles, where rows are work (N = 2048
/// on 2 threads: 22 tiles of 90 or 96 rows instead of 21 of 96 and one of 32).
template <class Shape>
QueryTiles balanced_query_tiles(const ForwardExtents& e, int threads, bool rows_are_work) {
  constexpr int BQ = Shape::block_q, MR = Shape::micro_rows;
  const QueryTiles whole = QueryTiles::rows(e.queries, BQ, MR);
  const std::int64_t heads = std::int64_t(e.batch) * e.heads;
  if (threads <= 1 || e.queries <= 0) return {};
  if (heads * whole.tiles >= 8 * std::int64_t(threads))
    return rows_are_work ? QueryTiles::even(e.queries, whole.tiles, MR) : QueryTiles{};
  // Makespan (in rows, plus a team's fixed cost of one micro-tile row) of the
  // heaviest-first dynamic order: the tiles of a (batch, head) are taken
  // last-first, each by the thread that is free first.
  auto makespan = [&](const QueryTiles& split) {
    std::vector<std::int64_t> load(std::size_t(threads), 0);
    for (std::int64_t u = 0; u < heads * split.tiles; ++u) {
      const int qt = split.tiles - 1 - int(u % split.tiles);
      const int rows = split.end(qt, MR, e.queries) - split.begin(qt, MR);
      const std::size_t t = std::size_t(std::min_element(load.begin(), load.end()) - load.begin());
      load[t] += (rows + MR - 1) / MR * MR + MR;
    }
    return *std::max_element(load.begin(), load.end());
  };
  QueryTiles best{};
  std::int64_t best_time = makespan(whole);
  auto consider = [&](const QueryTiles& split) {
    const std::int64_t t = makespan(split);
    if (t < best_time) {
      best = split;
      best_time = t;
    }
  };
  for (int rows = BQ - MR; rows >= MR && 2 * rows >= BQ; rows -= MR)
    consider(QueryTiles::rows(e.queries, rows, MR));
  if (rows_are_work) {
    const int groups = (e.queries + MR - 1) / MR;
    for (int tiles = whole.tiles; tiles <= groups; ++tiles) {
      const int tallest = (groups + tiles - 1) / tiles * MR;  // rows of the tallest tile
      if (tallest > BQ) continue;
      if (2 * tallest < BQ) break;
      consider(QueryTiles::even(e.queries, tiles, MR));
    }
  }
  return best;
}

template <class ExecSpace, class T, int StaticD, class Shape, class Mask, class QPos, class KPos,
          class QV, class OV, class LV>
void launch_forward(const ExecSpace& exec, const ForwardExtents& e, const QV& q,
                    const PackedKV<T, typename ExecSpace::memory_space>& kv, const OV& o,
                    const LV& lse, const Mask& mask, const QPos& qpos, const KPos& kpos, T scale,
                    const BlockStep<T, typename ExecSpace::memory_space>& step = {}) {
  using Kernel =
      ForwardKernel<ExecSpace, T, StaticD, Shape, Mask, QPos, KPos, value_of<QV>, value_of<OV>>;
  Kernel f;
  f.m_state = step.state.m;
  f.l_state = step.state.l;
  f.resume = step.resume;
  f.finish = step.finish;
  f.q = typename Kernel::in_view(q);
  if (kv.panel != Kernel::Panels::kt ||
      kv.v_panel != Kernel::Panels::v(static_cast<int>(kv.kt.extent(3))))
    throw std::logic_error(
        "BlockAttn: packed K/V panels differ from the forward kernel's (allocate_forward_kv)");
  f.kt = kv.kt;
  f.v = kv.v;
  f.o = typename Kernel::out_view(o);
  if constexpr (std::is_same<value_of<OV>, T>::value) {
    f.o_acc = step.o_acc.data() != nullptr ? typename Kernel::acc_view(step.o_acc)
                                           : typename Kernel::acc_view(o);
  } else {
    if ((step.resume || !step.finish) && step.o_acc.data() == nullptr)
      throw std::logic_error("BlockAttn: a forward step over 16-bit o needs an fp32 accumulator");
    f.o_acc = typename Kernel::acc_view(step.o_acc);
  }
  f.lse = typename Kernel::lse_view(lse);
  f.mask = mask;
  f.qpos = qpos;
  f.kpos = kpos;
  f.ext = e;
  f.dim_padded = static_cast<int>(kv.kt.extent(3));
  const QueryTiles split = step.query_tiles.resolved(e.queries, Shape::block_q, Shape::micro_rows);
  constexpr int MR = Shape::micro_rows;
  // Every tile non-empty and at most block_q rows, the last one reaching the
  // last query.
  if (e.queries > 0 && (split.tiles < 1 || split.groups < split.tiles ||
                        (split.groups + split.tiles - 1) / split.tiles * MR > Shape::block_q ||
                        std::int64_t(split.groups) * MR < e.queries ||
                        split.begin(split.tiles - 1, MR) >= e.queries))
    throw std::logic_error(
        "BlockAttn: forward query tiles must hold 1 to block_q rows each and cover the queries");
  f.q_split = split;
  f.k_tiles = step.skip_keys ? 0 : (e.keys + Shape::block_k - 1) / Shape::block_k;
  f.group = e.heads / e.kv_heads;
  f.q_scale = scale * log2e<T>;
  const int full_league = e.batch * e.heads * split.tiles;
  f.league_begin = step.league_begin;
  const int league = (step.league_end < 0 ? full_league : step.league_end) - step.league_begin;
  if (league <= 0) return;
  // Chunk size 1: with dynamic scheduling, a thread takes one query tile at a
  // time, so the uneven tiles of causal masks spread evenly over threads.
  const std::size_t bytes = Kernel::scratch_bytes(f.dim_padded);
  typename Kernel::policy_type policy =
      is_host_space_v<ExecSpace> ? typename Kernel::policy_type(exec, league, 1)
                                 : typename Kernel::policy_type(exec, league, Kokkos::AUTO);
  policy.set_chunk_size(1);
  f.scratch_level = bytes <= std::size_t(policy.scratch_size_max(0)) ? 0 : 1;
  policy.set_scratch_size(f.scratch_level, Kokkos::PerTeam(bytes));
  Kokkos::parallel_for("blockattn::forward", policy, f);
}

/// The forward after its compile-time checks passed: validates and launches.
template <class Shape, class ExecSpace, class QV, class KV, class VV, class OV, class LV,
          class Mask, class QPos, class KPos>
void forward_checked(const char* fn, const ExecSpace& exec, const QV& q, const KV& k, const VV& v,
                     const OV& o, const LV& lse, const Mask& mask, const QPos& qpos,
                     const KPos& kpos, double scale, bool check_policies) {
  using T = compute_t<value_of<OV>>;
  using mem = typename ExecSpace::memory_space;
  const ForwardExtents e = validate_forward<ExecSpace>(fn, q, k, v, o, lse, scale);
  if (check_policies_always || check_policies)
    check_mask_contract(fn, exec, mask, qpos(0), qpos(e.queries - 1) + 1, kpos(0),
                        kpos(e.keys - 1) + 1);
  const T s = softmax_scale<T>(scale, e.dim);
  with_shape_for<Shape>(e.dim, [&](auto static_d, auto shape) {
    constexpr int SD = decltype(static_d)::value;
    using S = decltype(shape);
    check_tile_shape<S>();
    using Kernel = ForwardKernel<ExecSpace, T, SD, S, Mask, QPos, KPos, value_of<QV>, value_of<OV>>;
    CallBuffers<ExecSpace> buffers(exec);
    auto kv = allocate_forward_kv<T, mem, S, SD>(e.batch, e.kv_heads, e.keys,
                                                 Kernel::pad_dim(e.dim), &buffers);
    pack_kv(exec, k, v, kv);
    BlockStep<T, mem> step;
    if constexpr (is_host_space_v<ExecSpace>) {
      // Rows are work where every query meets every key of the block.
      const bool rows_are_work = e.queries > 0 && e.keys > 0 &&
                                 mask.classify(qpos(0), qpos(e.queries - 1) + 1, kpos(0),
                                               kpos(e.keys - 1) + 1) == TileKind::full;
      step.query_tiles = balanced_query_tiles<S>(e, exec.concurrency(), rows_are_work);
    }
    launch_forward<ExecSpace, T, SD, S>(exec, e, q, kv, o, lse, mask, qpos, kpos, s, step);
  });
}

/// Forward on one device for arbitrary (strictly increasing) position maps.
template <class Shape, class ExecSpace, class QV, class KV, class VV, class OV, class LV,
          class Mask, class QPos, class KPos>
void forward(const char* fn, const ExecSpace& exec, const QV& q, const KV& k, const VV& v,
             const OV& o, const LV& lse, const Mask& mask, const QPos& qpos, const KPos& kpos,
             double scale, bool check_policies = false) {
  check_forward_view_types<QV, KV, VV, OV, LV>();
  check_mask_policy<Mask>();
  check_position_map<QPos>();
  check_position_map<KPos>();
  // Stop here when a requirement failed: the static_assert above is the only
  // diagnostic, not a backtrace from deeper templates.
  if constexpr (forward_views_ok<QV, KV, VV, OV, LV>() && is_mask_policy_v<Mask> &&
                is_position_map<QPos>::value && is_position_map<KPos>::value) {
    forward_checked<Shape>(fn, exec, q, k, v, o, lse, mask, qpos, kpos, scale, check_policies);
  }
}

}  // namespace impl

}  // namespace blockattn
