// SPDX-License-Identifier: Apache-2.0
// decode_attention and prefill_attention in the invariant mode
// (ServeOptions::invariant): each rank runs the two passes of
// kernel/invariant/ over its shard of every sequence; between them the ranks
// take the maxima of the rows' bounds, after them the sums of their folds
// (exact: any order of the ranks gives the same bits). The rows' O and LSE are
// then the bits of attention_forward over the whole sequence with the same
// options, whatever the placement, the rank count or the chunks of prefill.
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/distributed/impl/cache_access.hpp>
#include <blockattn/distributed/options.hpp>
#include <blockattn/kernel/invariant/invariant_forward.hpp>
#include <blockattn/kernel/sinks.hpp>

#include <string>
#include <utility>
#include <vector>

namespace blockattn::impl {

/// Why the cache's placement cuts a canonical tile of one of sequences
/// [s0, s1) (lengths `appending` tokens on), or empty. The same answer on
/// every rank (placement, size and lengths are compared in the consensus).
template <class Cache>
std::string invariant_cache_error(const char* fn, const Cache& cache, int s0, int s1,
                                  index_type appending, int tile) {
  if (tile < 1 || tile > (1 << 20))
    return std::string("blockattn::") + fn + ": argument 'opts.invariant_tile' is " +
           std::to_string(tile) + ", expected 1 <= tile <= 2^20 (keys per canonical tile)";
  if (std::is_same<typename Cache::value_type, double>::value)
    return std::string("blockattn::") + fn +
           ": argument 'opts.invariant': the invariant mode takes fp32, bf16 and fp16 caches, "
           "got fp64";
  index_type longest = 0;
  for (int s = s0; s < s1; ++s) longest = std::max(longest, cache.length(s) + appending);
  const int P = cache.size();
  for (index_type t = 1; t < longest; ++t)
    if (t % tile != 0 && cache.placement().owner(t, P) != cache.placement().owner(t - 1, P))
      return std::string("blockattn::") + fn +
             ": argument 'opts.invariant_tile' = " + std::to_string(tile) +
             ": the cache's placement puts position " + std::to_string(t - 1) + " on rank " +
             std::to_string(cache.placement().owner(t - 1, P)) + " and " + std::to_string(t) +
             " on rank " + std::to_string(cache.placement().owner(t, P)) +
             ", inside one canonical tile; the invariant mode needs every rank's keys in whole "
             "tiles: a placement whose pieces are multiples of the tile (interleave, "
             "tokens_per_rank), or invariant_tile = 1";
  return {};
}

/// The invariant rows of sequences [s0, s1): q (B, N, H, D) at positions
/// [length(s) - N, length(s)), into o, lse, the sinks folded in.
template <class C, class ExecSpace, class Cache, class QV, class OV, class LV, class Mask>
void invariant_attend(C& comm, const ExecSpace& exec, const Cache& cache, int s0, int s1,
                      const QV& q, const OV& o, const LV& lse, const Mask& mask,
                      const ServeOptions& opts) {
  using mem = typename ExecSpace::memory_space;
  const int B = s1 - s0;
  const int N = int(q.extent(1)), H = int(q.extent(2)), D = int(q.extent(3));
  InvariantState<mem> st(B, H, N, D);
  const float scale = softmax_scale<float>(opts.scale, D);
  using Rows = decltype(shard_rows(exec, cache, s0, 0));
  std::vector<Rows> kv;
  std::vector<InvariantRuns<mem>> runs;
  for (int pass = 0; pass < 2; ++pass) {
    for (int s = s0; s < s1; ++s) {
      const index_type L = cache.local_length(s);
      if (pass == 0) {
        kv.push_back(shard_rows(exec, cache, s, L));
        runs.push_back(
            invariant_runs_view(exec, invariant_runs(cache.positions(), L, opts.invariant_tile)));
      }
      BlockExtents e;
      e.batch = 1;
      e.heads = H;
      e.kv_heads = cache.kv_heads();
      e.queries = N;
      e.keys = int(L);
      e.dim = D;
      const auto qs = Kokkos::subview(q, Kokkos::make_pair(s - s0, s - s0 + 1), Kokkos::ALL,
                                      Kokkos::ALL, Kokkos::ALL);
      const OffsetPositions qpos{cache.length(s) - N};
      const Rows& r = kv[std::size_t(s - s0)];
      const auto& run = runs[std::size_t(s - s0)];
      if (pass == 0)
        invariant_pass<false>(exec, e, qs, r.first, r.second, mask, qpos, cache.positions(), scale,
                              run, st, s - s0);
      else
        invariant_pass<true>(exec, e, qs, r.first, r.second, mask, qpos, cache.positions(), scale,
                             run, st, s - s0);
    }
    if (comm.size() > 1) {
      exec.fence();
      if (pass == 0) {
        allreduce_view(comm, exec, st.m, ReduceOp::max);
        allreduce_view(comm, exec, st.b, ReduceOp::max);
      } else {
        allreduce_view(comm, exec, st.folds, ReduceOp::sum);
        allreduce_view(comm, exec, st.nf, ReduceOp::sum);
      }
    }
  }
  invariant_finish(exec, st, o, lse, H);
  apply_sinks(exec, opts.sinks, o, lse);
  exec.fence();  // the runs and shard copies are this call's
}

}  // namespace blockattn::impl
