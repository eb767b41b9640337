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
#include <blockattn/kernel/impl/softmax_state.hpp>
#include <blockattn/kernel/options.hpp>
#include <blockattn/kernel/policy_check.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace blockattn {

namespace impl {

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
inline QueryTiles balanced_query_tiles(const ForwardExtents& e, int BQ, int MR, int threads,
                                       bool rows_are_work) {
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

/// The same for the tiles of Shape.
template <class Shape>
QueryTiles balanced_query_tiles(const ForwardExtents& e, int threads, bool rows_are_work) {
  return balanced_query_tiles(e, Shape::block_q, Shape::micro_rows, threads, rows_are_work);
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
