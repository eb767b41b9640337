// SPDX-License-Identifier: Apache-2.0
// The invariant mode's host side: the canonical tiles of a block of keys, the
// checks, the single-device forward (attention_forward with
// ForwardOptions::invariant) and decode (attention_decode, _paged). The distributed and serving
// entry points run the same passes (kernel/invariant/invariant_kernel.hpp) over their blocks.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/kernel/invariant/invariant_kernel.hpp>
#include <blockattn/kernel/options.hpp>
#include <blockattn/kernel/sinks.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/positions.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace blockattn::impl {

/// floor(a / b) for b > 0.
inline index_type floor_div_positive(index_type a, index_type b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

/// The checks of the invariant options: the storage type and the tile.
template <class V>
void check_invariant(const char* fn, int tile, index_type keys) {
  if constexpr (std::is_same<V, double>::value)
    fail(fn,
         "argument 'options.invariant': the invariant mode takes fp32, bf16 and fp16 storage, "
         "got fp64 (its tiles sum in fp32 and its folds hold fp32 partials exactly)");
  if (tile < 1 || tile > (1 << 20))
    fail(fn, "argument 'options.invariant_tile' is ", tile,
         ", expected 1 <= tile <= 2^20 (keys per canonical tile)");
  if (keys >= (index_type(1) << 31))
    fail(fn, "the invariant mode takes sequences of fewer than 2^31 keys, got ", keys);
}

/// The runs of canonical tiles of `n` local keys at positions pos(0 .. n-1)
/// (strictly increasing): (start, count) pairs, a run per tile. `counts`
/// (optional) receives each run's tile index.
template <class Pos>
std::vector<int> invariant_runs(const Pos& pos, index_type n, int tile,
                                std::vector<index_type>* tiles = nullptr) {
  std::vector<int> r;
  index_type cur = 0;
  for (index_type j = 0; j < n; ++j) {
    const index_type t = floor_div_positive(pos(j), tile);
    if (j == 0 || t != cur) {
      r.push_back(int(j));
      r.push_back(0);
      if (tiles) tiles->push_back(t);
      cur = t;
    }
    ++r.back();
  }
  return r;
}

/// The runs as a View of the execution space.
template <class ExecSpace>
InvariantRuns<typename ExecSpace::memory_space> invariant_runs_view(const ExecSpace& exec,
                                                                    const std::vector<int>& r) {
  InvariantRuns<typename ExecSpace::memory_space> v(
      Kokkos::view_alloc(std::string("blockattn::invariant_runs"), Kokkos::WithoutInitializing),
      r.size() / 2);
  auto h = Kokkos::create_mirror_view(v);
  for (std::size_t u = 0; u < r.size() / 2; ++u) {
    h(u, 0) = r[2 * u];
    h(u, 1) = r[2 * u + 1];
  }
  Kokkos::deep_copy(exec, v, h);
  exec.fence();
  return v;
}

/// forward_call with options.invariant (attention_forward, the head-parallel
/// schedules' local attention, chunked prefill): both passes over the one
/// block of keys, then O and LSE (the caller folds the sinks in).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask, class QP,
          class KP>
void invariant_forward(const char* fn, const ExecSpace& exec, const BlockExtents& e, const QV& q,
                       const KV& k, const VV& v, const OV& o, const LV& lse, const Mask& mask,
                       const QP& qpos, const KP& kpos, float scale, const ForwardOptions& opts) {
  using V = typename OV::non_const_value_type;
  check_invariant<V>(fn, opts.invariant_tile, e.keys);
  using mem = typename ExecSpace::memory_space;
  InvariantState<mem> st(e.batch, e.heads, e.queries, e.dim);
  const auto runs = invariant_runs_view(exec, invariant_runs(kpos, e.keys, opts.invariant_tile));
  invariant_pass<false>(exec, e, q, k, v, mask, qpos, kpos, scale, runs, st);
  invariant_pass<true>(exec, e, q, k, v, mask, qpos, kpos, scale, runs, st);
  invariant_finish(exec, st, o, lse, e.heads);
}

/// attention_decode and attention_decode_paged with options.invariant (the
/// checks done): sequence by sequence (rows at q_positions(b) + i, keys 0 ..
/// lengths(b) - 1), its keys copied out of the cache (a paged one's pages
/// gathered: an exact copy) and both passes run over them, so each row gets
/// the bits of attention_forward's invariant mode over the same keys; then
/// the sinks. Waits for exec (the lengths and positions are read on the host).
template <class ExecSpace, class QV, class KV, class VV, class LenV, class PosV, class OV, class LV,
          class Mask, class KPos, class Opts, class Pages>
void invariant_decode(const char* fn, const ExecSpace& exec, const BlockExtents& e, const QV& q,
                      const KV& k, const VV& v, const LenV& lengths, const PosV& q_positions,
                      const OV& o, const LV& lse, const Mask& mask, const KPos& kpos,
                      const Opts& opts, const Pages& pages) {
  using S = typename KV::non_const_value_type;
  using V = typename OV::non_const_value_type;
  using mem = typename ExecSpace::memory_space;
  const auto len = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lengths);
  const auto first = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), q_positions);
  index_type most = 0;
  for (int b = 0; b < e.batch; ++b) most = len(b) > most ? len(b) : most;
  check_invariant<V>(fn, opts.invariant_tile, most);
  if constexpr (!std::is_same<V, double>::value) {
    using Keys = Kokkos::View<S****, Kokkos::LayoutRight, mem>;
    const auto alloc = [](const char* label) {
      return Kokkos::view_alloc(std::string(label), Kokkos::WithoutInitializing);
    };
    const Keys kb(alloc("blockattn::invariant_decode_k"), 1, most, e.kv_heads, e.dim),
        vb(alloc("blockattn::invariant_decode_v"), 1, most, e.kv_heads, e.dim);
    ForwardOptions fo;
    fo.invariant = true;
    fo.invariant_tile = opts.invariant_tile;
    const float scale = softmax_scale<float>(opts.scale, e.dim);
    for (int b = 0; b < e.batch; ++b) {
      const index_type n = len(b);
      if (n > 0)
        Kokkos::parallel_for(
            "blockattn::invariant_decode_gather",
            Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(
                exec, {0, 0, 0}, {n, index_type(e.kv_heads), index_type(e.dim)}),
            KOKKOS_LAMBDA(index_type j, index_type g, index_type d) {
              const int p = pages.paged ? pages.table(b, int(j >> pages.shift)) : b;
              const index_type s = pages.paged ? j & ((index_type(1) << pages.shift) - 1) : j;
              kb(0, j, g, d) = k(p, s, g, d);
              vb(0, j, g, d) = v(p, s, g, d);
            });
      BlockExtents eb = e;
      eb.batch = 1;
      eb.keys = int(n);
      const auto one = Kokkos::make_pair(b, b + 1);
      const auto keys = Kokkos::make_pair(index_type(0), n);
      invariant_forward(fn, exec, eb,
                        Kokkos::subview(q, one, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL),
                        Kokkos::subview(kb, Kokkos::ALL, keys, Kokkos::ALL, Kokkos::ALL),
                        Kokkos::subview(vb, Kokkos::ALL, keys, Kokkos::ALL, Kokkos::ALL),
                        Kokkos::subview(o, one, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL),
                        Kokkos::subview(lse, one, Kokkos::ALL, Kokkos::ALL), mask,
                        OffsetPositions{first(b)}, kpos, scale, fo);
    }
    apply_sinks(exec, opts.sinks, o, lse);
  }
}

}  // namespace blockattn::impl
