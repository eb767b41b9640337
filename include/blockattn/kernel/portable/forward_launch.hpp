// SPDX-License-Identifier: Apache-2.0
// The single-device forward behind attention_forward(): view checks, the head-dim
// and tile-shape dispatch, packing and the kernel launch. Also used by the
// distributed step loop (one block pair per call, resumable softmax state).
#pragma once

#include <algorithm>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/impl/pack.hpp>
#include <blockattn/kernel/impl/softmax_state.hpp>
#include <blockattn/kernel/options.hpp>
#include <blockattn/kernel/policy_check.hpp>
#include <blockattn/kernel/portable/forward_kernel.hpp>
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
  // bf16 inputs on a host space: AMX tile products where the CPU has them
  // (automatic), or the fp32 kernels (off). See kernel/host/amx.hpp.
  HostMatrix host_matrix = HostMatrix::automatic;
  // The block in the AMX forward's layout, packed by the caller straight from
  // its bf16 K and V (pack_amx_kv_views; the fp32 block is then not read), or
  // empty: packed from the fp32 block at the launch.
  Kokkos::View<std::uint16_t*, Kokkos::HostSpace> matrix_kv;
  Kokkos::View<unsigned char*, Kokkos::HostSpace> matrix_v_bad;
};

/// Whether the forward kernel of (ExecSpace, T, Shape) with queries stored as
/// QS runs on the host matrix engine for `setting` in this process.
template <class ExecSpace, class T, class Shape, class QS>
bool forward_uses_matrix(HostMatrix setting) {
  if constexpr (forward_amx_capable<ExecSpace, T, Shape, QS>) {
    return matrix_path(setting) != MatrixPath::none;
  } else {
    (void)setting;
    return false;
  }
}

#if BLOCKATTN_HOST_AMX
/// f(u, b, hk, kb, kd, vd) for key tile kb of each (batch b, kv head hk) of a
/// block packed as pack_amx_kv's at dst (kp keys per head, head dim da): kd
/// and vd are the head's K and V, u the tile's flat index.
template <class ExecSpace, class F>
void for_each_amx_kv_tile(const ExecSpace& exec, std::uint16_t* dst, int batch, int heads,
                          int tiles, std::size_t kp, int da, F f) {
  Kokkos::parallel_for(
      "blockattn::pack_amx_kv", Kokkos::RangePolicy<ExecSpace>(exec, 0, batch * heads * tiles),
      [=](const int u) {
        const int kb = u % tiles, hk = (u / tiles) % heads, b = u / (tiles * heads);
        std::uint16_t* const kd = dst + (std::size_t(b) * heads + hk) * 2 * kp * da;
        f(u, b, hk, kb, kd, kd + kp * da);
      });
}

/// K and V of a packed block (fp32 widenings of bf16 values) as the AMX
/// forward reads them, per (batch, kv head) with kp = tiles * BK keys:
///   K (kp x da): for each 16-key chunk j, da / 2 VNNI rows p of the 16 keys'
///      (d = 2p, 2p + 1) pairs: element (j, p, i, t) = K(key 16 j + i, dim 2 p + t);
///   V (kp x da, after K): for each 16-column chunk n, kp / 2 VNNI rows p of the
///      16 columns' (key 2p, 2p + 1) pairs: element (n, p, i, t) = V(key 2 p + t,
///      dim 16 n + i);
/// zero past the packed head dim (da: a multiple of 32). `bad`: one flag per
/// (batch, kv head, key tile), set where the tile's V holds an inf or NaN.
template <class ExecSpace, int BK, int KP, class T>
Kokkos::View<std::uint16_t*, Kokkos::HostSpace> pack_amx_kv(
    const ExecSpace& exec, const PackedKV<T, Kokkos::HostSpace>& kv, int da, int vp,
    Kokkos::View<unsigned char*, Kokkos::HostSpace>& bad) {
  const int batch = static_cast<int>(kv.kt.extent(0)), heads = static_cast<int>(kv.kt.extent(1));
  const int tiles = static_cast<int>(kv.kt.extent(2)), dp = static_cast<int>(kv.kt.extent(3));
  const std::size_t kp = std::size_t(tiles) * BK;
  Kokkos::View<std::uint16_t*, Kokkos::HostSpace> out(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::amx_kv"),
      std::size_t(batch) * heads * 2 * kp * da);
  bad = Kokkos::View<unsigned char*, Kokkos::HostSpace>(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::amx_v_bad"),
      std::size_t(batch) * heads * tiles);
  auto kt = kv.kt;
  auto v = kv.v;
  std::uint16_t* const dst = out.data();
  unsigned char* const flags = bad.data();
  for_each_amx_kv_tile(exec, dst, batch, heads, tiles, kp, da,
                       [=](const int u, const int b, const int hk, const int kb,
                           std::uint16_t* const kd, std::uint16_t* const vd) {
                         flags[u] = amx_pack_tile(&kt(b, hk, kb, 0, 0), &v(b, hk, kb * BK, 0), BK,
                                                  KP, vp, dp, da, kd + std::size_t(kb) * BK * da,
                                                  vd + std::size_t(kb) * BK * 16, kp * 16)
                                        ? 1
                                        : 0;
                       });
  return out;
}

/// pack_amx_kv straight from bf16 k, v (batch, keys, kv_heads, dim; any
/// layout) for key tiles of bk keys and head dim da (a multiple of 32, at
/// least dim). `buffers`: a single call's cached buffer to carve the block
/// from (nullptr: allocate it).
template <class ExecSpace, class KView, class VView, class Buffers = NoCallBuffers>
Kokkos::View<std::uint16_t*, Kokkos::HostSpace> pack_amx_kv_views(
    const ExecSpace& exec, const KView& k, const VView& v, int bk, int da,
    Kokkos::View<unsigned char*, Kokkos::HostSpace>& bad, Buffers* buffers = nullptr) {
  const int batch = static_cast<int>(k.extent(0)), keys = static_cast<int>(k.extent(1));
  const int heads = static_cast<int>(k.extent(2)), dim = static_cast<int>(k.extent(3));
  const int tiles = (keys + bk - 1) / bk;
  const std::size_t kp = std::size_t(tiles) * bk;
  using u16 = Kokkos::View<std::uint16_t*, Kokkos::LayoutRight, Kokkos::HostSpace>;
  using u8 = Kokkos::View<unsigned char*, Kokkos::LayoutRight, Kokkos::HostSpace>;
  // Every element is written below (the flags too).
  const Kokkos::View<std::uint16_t*, Kokkos::HostSpace> out =
      allocate_view<u16>(buffers, "blockattn::amx_kv", std::size_t(batch) * heads * 2 * kp * da);
  bad = allocate_view<u8>(buffers, "blockattn::amx_v_bad", std::size_t(batch) * heads * tiles);
  std::uint16_t* const dst = out.data();
  unsigned char* const flags = bad.data();
  const std::ptrdiff_t ks = k.stride(3), vs = v.stride(3), k_key = k.stride(1);
  // Whole 32-bit pairs of contiguous rows: one gather per K row, 16 columns at a time for V.
  const bool fast_k = ks == 1 && dim % 32 == 0 && dim == da && k_key % 2 == 0 &&
                      reinterpret_cast<std::uintptr_t>(k.data()) % 4 == 0;
  const bool fast_v = vs == 1 && dim % 16 == 0;
  for_each_amx_kv_tile(
      exec, dst, batch, heads, tiles, kp, da,
      [=](const int u, const int b, const int hk, const int kb, std::uint16_t* const kd,
          std::uint16_t* const vd) {
        for (int j = kb * bk / 16; j < (kb + 1) * bk / 16; ++j) {
          std::uint16_t* const kj = kd + std::size_t(j) * 16 * da;
          if (fast_k && 16 * j + 15 < keys) {
            amx_gather_k16(&k(b, 16 * j, hk, 0).bits, k_key, da / 2, kj);
            continue;
          }
          for (int i = 0; i < 16; ++i) {
            const int key = 16 * j + i;
            const auto* const kr = key < keys ? &k(b, key, hk, 0) : nullptr;
            for (int p = 0; p < da / 2; ++p)
              for (int t = 0; t < 2; ++t) {
                const int d = 2 * p + t;
                kj[p * 32 + 2 * i + t] =
                    kr != nullptr && d < dim ? kr[d * ks].bits : std::uint16_t(0);
              }
          }
        }
        bool any_bad = false;
        for (int p = kb * bk / 2; p < (kb + 1) * bk / 2; ++p) {
          const auto* const r0 = 2 * p < keys ? &v(b, 2 * p, hk, 0) : nullptr;
          const auto* const r1 = 2 * p + 1 < keys ? &v(b, 2 * p + 1, hk, 0) : nullptr;
          for (int n = 0; n < da / 16; ++n) {
            std::uint16_t* const row = vd + std::size_t(n) * kp * 16 + std::size_t(p) * 32;
            if (fast_v && r0 != nullptr && r1 != nullptr && 16 * n < dim) {
              any_bad = amx_pair_bf16x16(&r0[16 * n].bits, &r1[16 * n].bits, row) || any_bad;
              continue;
            }
            for (int i = 0; i < 16; ++i) {
              const int d = 16 * n + i;
              const std::uint16_t x = r0 != nullptr && d < dim ? r0[d * vs].bits : 0;
              const std::uint16_t y = r1 != nullptr && d < dim ? r1[d * vs].bits : 0;
              any_bad = any_bad || (x & 0x7f80) == 0x7f80 || (y & 0x7f80) == 0x7f80;
              row[2 * i] = x;
              row[2 * i + 1] = y;
            }
          }
        }
        flags[u] = any_bad ? 1 : 0;
      });
  return out;
}
#endif

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

/// Query rows of one block of the host matrix engine's forward (run_amx):
/// it computes whole blocks, so its tiles are cut at multiples of them.
inline constexpr int matrix_query_rows = 32;

/// balanced_query_tiles for a launch that runs on the host matrix engine
/// (`matrix`) or not: the engine's tiles are whole 32-row blocks (a tile of 84
/// rows costs it 96), so its candidates are too. (Zen 4, 2 threads, H = 1,
/// N = 1024, bf16: 13 tiles of 84 rows computed 1184 rows for 1024.)
inline QueryTiles balanced_query_tiles(const ForwardExtents& e, int block_q, int micro_rows,
                                       int threads, bool rows_are_work, bool matrix) {
  if (!matrix) return balanced_query_tiles(e, block_q, micro_rows, threads, rows_are_work);
  constexpr int R = matrix_query_rows;
  return balanced_query_tiles(e, block_q / R * R, R, threads, rows_are_work).with_granule(R);
}

/// The same for the tiles of Shape.
template <class Shape>
QueryTiles balanced_query_tiles(const ForwardExtents& e, int threads, bool rows_are_work,
                                bool matrix = false) {
  return balanced_query_tiles(e, Shape::block_q, Shape::micro_rows, threads, rows_are_work, matrix);
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
#if BLOCKATTN_HOST_AMX
  Kokkos::View<std::uint16_t*, Kokkos::HostSpace> amx_kv;  // alive through the launch
  Kokkos::View<unsigned char*, Kokkos::HostSpace> amx_v_bad;
#endif
  f.mask = mask;
  f.qpos = qpos;
  f.kpos = kpos;
  f.ext = e;
  f.dim_padded = static_cast<int>(kv.kt.extent(3));
  const QueryTiles split = step.query_tiles.resolved(e.queries, Shape::block_q, Shape::micro_rows);
  constexpr int MR = Shape::micro_rows;
  const int G = split.rows_per_group(MR);
  // Every tile non-empty and at most block_q rows, the last one reaching the
  // last query.
  if (e.queries > 0 &&
      (split.tiles < 1 || split.groups < split.tiles || G < 1 ||
       (split.groups + split.tiles - 1) / split.tiles * G > Shape::block_q ||
       std::int64_t(split.groups) * G < e.queries || split.begin(split.tiles - 1, MR) >= e.queries))
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
  std::size_t bytes = Kernel::scratch_bytes(f.dim_padded);
#if BLOCKATTN_HOST_AMX
  if constexpr (Kernel::amx_capable) {
    if (f.k_tiles > 0 && forward_uses_matrix<ExecSpace, T, Shape, value_of<QV>>(step.host_matrix)) {
      f.amx_dim = (f.dim_padded + 31) / 32 * 32;
      f.amx_tiles = static_cast<int>(kv.kt.extent(2));
      const std::size_t size = std::size_t(kv.kt.extent(0)) * kv.kt.extent(1) * 2 *
                               std::size_t(f.amx_tiles) * Shape::block_k * f.amx_dim;
      if (step.matrix_kv.size() > 0) {
        if (step.matrix_kv.size() != size ||
            step.matrix_v_bad.size() !=
                std::size_t(kv.kt.extent(0)) * kv.kt.extent(1) * f.amx_tiles)
          throw std::logic_error("BlockAttn: the AMX block's size differs from the packed block's");
        amx_kv = step.matrix_kv;
        amx_v_bad = step.matrix_v_bad;
      } else {
        amx_kv = pack_amx_kv<ExecSpace, Shape::block_k, Kernel::KP>(
            exec, kv, f.amx_dim, Kernel::Panels::v(f.dim_padded), amx_v_bad);
      }
      f.amx_kv = amx_kv.data();
      f.matrix_tiles = matrix_path(step.host_matrix) == MatrixPath::tiles;
      f.amx_v_bad = amx_v_bad.data();
      bytes = Kernel::amx_scratch_bytes(f.amx_dim);
    }
  }
#endif
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
      step.query_tiles = balanced_query_tiles<S>(
          e, exec.concurrency(), rows_are_work,
          e.keys > 0 && forward_uses_matrix<ExecSpace, T, S, value_of<QV>>(step.host_matrix));
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
