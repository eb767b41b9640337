// SPDX-License-Identifier: Apache-2.0
// A quick calibration run of the tile kernel for the planner: times the
// forward on one block with a full and a causal mask, and fits the planner's
// compute model (F on full tiles, relative cost of a partial tile) to it;
// optionally the backward likewise (the backward's F and partial-tile cost).
#pragma once

#include <blockattn/kernel/attention_backward.hpp>
#include <blockattn/kernel/attention_forward.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/work.hpp>
#include <blockattn/plan/planner.hpp>
#include <blockattn/policy/mask.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>

namespace blockattn {
namespace plan {

struct Calibration {
  double flops = 0;              // FLOP/s on full tiles (4 D per pair of every computed tile)
  double partial_tile_cost = 1;  // partial tile time / full tile time
  double full_seconds = 0, causal_seconds = 0;
  double backward_flops = 0;  // the backward's on full tiles (10 D per pair); 0: not measured
  double backward_partial_tile_cost = 0;  // the backward's partial tile time / full tile time
  double backward_seconds = 0, backward_window_seconds = 0;  // full mask; window (see calibrate)
  int n = 0, heads = 0, dim = 0;
};

/// Fits F and the partial-tile cost to c.full_seconds and c.causal_seconds
/// (forward on one (1, c.n, c.heads, c.dim) block, tile sizes of T on ExecSpace).
template <class T, class ExecSpace = Kokkos::DefaultExecutionSpace>
Calibration fit_calibration(Calibration c) {
  const TileSizes ts = forward_tile_sizes<T, ExecSpace>(c.dim);
  const double per_tile = 4.0 * ts.block_q * ts.block_k * c.dim * double(c.heads);
  const TileCounts full = count_tiles(FullMask{}, c.n, c.n, ts.block_q, ts.block_k, {}, {}, false);
  const TileCounts causal =
      count_tiles(CausalMask{}, c.n, c.n, ts.block_q, ts.block_k, {}, {}, false);
  c.flops = double(full.computed()) * per_tile / c.full_seconds;
  c.partial_tile_cost = 1;
  if (causal.partial > 0) {
    const double tiles = c.causal_seconds * c.flops / per_tile;  // in full-tile units
    c.partial_tile_cost = std::max(0.05, (tiles - double(causal.full)) / double(causal.partial));
  }
  if (c.backward_seconds > 0) {
    const Problem bs = problem_for<T, ExecSpace>(c.n, 1, 1, c.heads, c.heads, c.dim);
    const int bq = bs.backward_block_q(), bk = bs.backward_block_k();
    const double per = 10.0 * bq * bk * c.dim * double(c.heads);
    const TileCounts b = count_tiles(FullMask{}, c.n, c.n, bq, bk, {}, {}, false);
    const TileCounts bw =
        count_tiles(causal_window(std::min(bq, bk)), c.n, c.n, bq, bk, {}, {}, false);
    c.backward_flops = double(b.computed()) * per / c.backward_seconds;
    c.backward_partial_tile_cost = 1;
    if (bw.partial > 0 && c.backward_window_seconds > 0)
      c.backward_partial_tile_cost =
          std::max(0.05, (c.backward_window_seconds * c.backward_flops / per - double(bw.full)) /
                             double(bw.partial));
  }
  return c;
}

/// Times attention_forward on (1, n, heads, dim) Views of T with a full and a
/// causal mask (alternating, best of `reps` after one warm-up each) and fits
///   t = (full tiles + c * partial tiles) * 4 * block_q * block_k * dim * heads / F.
/// With `backward`, also attention_backward with a full mask and with a
/// causal window of one tile's keys, every computed tile of which is partial
/// (best of the same rounds): Hardware::backward_flops and
/// backward_partial_tile_cost. (A causal mask's partial tiles are a few
/// percent of its tiles: fitted to it, the backward's partial cost came out
/// anywhere from 0.24 to 1.75 between runs.) Collective only in the sense that
/// every rank calling it at once measures the rate under the same load as a
/// distributed run.
template <class T, class ExecSpace = Kokkos::DefaultExecutionSpace>
Calibration calibrate(int n, int heads, int dim, int reps = 3, const ExecSpace& exec = {},
                      bool backward = false) {
  using V = Kokkos::View<T****, typename ExecSpace::memory_space>;
  using L = Kokkos::View<T***, typename ExecSpace::memory_space>;
  V q("blockattn::calibrate_q", 1, n, heads, dim), k("blockattn::calibrate_k", 1, n, heads, dim),
      v("blockattn::calibrate_v", 1, n, heads, dim), o("blockattn::calibrate_o", 1, n, heads, dim);
  L lse("blockattn::calibrate_lse", 1, heads, n);
  {
    auto h = Kokkos::create_mirror_view(q);
    std::uint64_t x = 0x9E3779B97F4A7C15ull;
    for (std::size_t i = 0; i < h.span(); ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      h.data()[i] = T(double(x >> 11) / double(1ull << 53) - 0.5);
    }
    Kokkos::deep_copy(q, h);
    Kokkos::deep_copy(k, h);
    Kokkos::deep_copy(v, h);
  }
  auto time_one = [&](const auto& mask) {
    exec.fence();
    const auto t0 = std::chrono::steady_clock::now();
    attention_forward(exec, q, k, v, o, lse, mask);
    exec.fence();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  // The backward's inputs: the forward's O and LSE, dO = q; its gradients.
  V dq, dk, dv;
  if (backward) {
    dq = V("blockattn::calibrate_dq", 1, n, heads, dim);
    dk = V("blockattn::calibrate_dk", 1, n, heads, dim);
    dv = V("blockattn::calibrate_dv", 1, n, heads, dim);
    attention_forward(exec, q, k, v, o, lse, FullMask{});
  }
  auto time_backward = [&](const auto& mask) {
    exec.fence();
    const auto t0 = std::chrono::steady_clock::now();
    attention_backward(exec, q, k, v, o, lse, q, dq, dk, dv, mask);
    exec.fence();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  Calibration c;
  c.n = n;
  c.heads = heads;
  c.dim = dim;
  c.full_seconds = c.causal_seconds = 1e300;
  c.backward_seconds = c.backward_window_seconds = backward ? 1e300 : 0.0;
  const Problem shape = problem_for<T, ExecSpace>(n, 1, 1, heads, heads, dim);
  const SlidingWindowMask band =
      causal_window(std::min(shape.backward_block_q(), shape.backward_block_k()));
  // Alternating, best of `reps` each after one warm-up: all see the same load.
  for (int r = 0; r <= reps; ++r) {
    const double tf = time_one(FullMask{});
    const double tc = time_one(CausalMask{});
    const double tb = backward ? time_backward(FullMask{}) : 0.0;
    const double tbw = backward ? time_backward(band) : 0.0;
    if (r == 0) continue;
    c.full_seconds = std::min(c.full_seconds, tf);
    c.causal_seconds = std::min(c.causal_seconds, tc);
    if (backward) {
      c.backward_seconds = std::min(c.backward_seconds, tb);
      c.backward_window_seconds = std::min(c.backward_window_seconds, tbw);
    }
  }
  return fit_calibration<T, ExecSpace>(c);
}

/// Hardware from a calibration and the link figures.
inline Hardware calibrated_hardware(const Calibration& c, double bandwidth, double latency,
                                    double memory_bytes = 0) {
  Hardware hw;
  hw.name = "calibrated";
  hw.flops = c.flops;
  hw.backward_flops = c.backward_flops;
  hw.backward_partial_tile_cost = c.backward_partial_tile_cost;
  hw.partial_tile_cost = c.partial_tile_cost;
  hw.bandwidth = bandwidth;
  hw.latency = latency;
  hw.memory_bytes = memory_bytes;
  return hw;
}

}  // namespace plan
}  // namespace blockattn
