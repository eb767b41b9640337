// SPDX-License-Identifier: Apache-2.0
// The invariant mode's host side: the canonical tiles of a block of keys, the
// checks, and the single-device forward (attention_forward with
// ForwardOptions::invariant). The distributed and serving entry points run
// the same passes (kernel/invariant/invariant_kernel.hpp) over their blocks.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/kernel/invariant/invariant_kernel.hpp>
#include <blockattn/kernel/options.hpp>

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

/// UlyssesAttention's and HybridAttention's backward have no invariant mode
/// (their all-to-alls sum a replicated K/V head's partials in arrival
/// order): a call that asks for it stops here, on every rank alike.
template <class Opts>
void reject_invariant_backward(const char* fn, const Opts& opts) {
  if (opts.invariant)
    fail(fn,
         "argument 'options.invariant' is set: the invariant backward runs in "
         "attention_backward and DistributedAttention::backward (any schedule and partition); "
         "the head-parallel drivers have the invariant forward only");
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

}  // namespace blockattn::impl
