// SPDX-License-Identifier: Apache-2.0
// The distributed forward of the invariant mode (DistributedOptions::
// invariant): whatever the schedule, a KV ring of two passes over every
// rank's keys (kernel/invariant/invariant_kernel.hpp). The first pass fixes
// each row's maximum and value bound, the second adds every canonical tile's
// partials into the row's folds; the folds' sums are exact, so neither the
// order in which the blocks arrive nor the number of ranks changes a bit.
// Each rank's queries stay; the K/V blocks travel, each twice.
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/distributed/impl/transfer.hpp>
#include <blockattn/distributed/options.hpp>
#include <blockattn/kernel/invariant/invariant_backward.hpp>
#include <blockattn/kernel/invariant/invariant_forward.hpp>
#include <blockattn/kernel/sinks.hpp>
#include <blockattn/policy/partition.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

namespace blockattn::impl {

/// Throws (on every rank alike: each checks every rank's keys) unless every
/// rank's keys are whole canonical tiles of `tile` keys. O(N) host work.
template <class Partition>
void check_invariant_tiles(const Partition& part, const char* fn, index_type N, int P, int tile) {
  for (int r = 0; r < P; ++r) {
    std::vector<index_type> tiles;
    const std::vector<int> runs =
        invariant_runs(part.positions(N, P, r), local_length(part, N, P, r), tile, &tiles);
    for (std::size_t u = 0; u < tiles.size(); ++u) {
      const index_type first = tiles[u] * tile;
      const index_type want = std::min<index_type>(tile, N - first);
      if (runs[2 * u + 1] != want)
        fail(fn, "argument 'options.invariant_tile' = ", tile, ": rank ", r, " of the ",
             Partition::name(), " partition (N = ", N, ", P = ", P, ") holds ", runs[2 * u + 1],
             " of the ", want, " keys of canonical tile ", tiles[u], " (positions ", first, " .. ",
             first + want - 1,
             "); the invariant mode needs every rank's keys in whole tiles: a partition whose "
             "pieces start at multiples of the tile, or invariant_tile = 1");
    }
  }
}

/// Copies rows [0, n) of a (batch, n, heads, dim) View into a contiguous
/// buffer of the same value type.
template <class ExecSpace, class Src, class Dst>
void invariant_pack(const ExecSpace& exec, const Src& src, const Dst& dst, index_type n) {
  if (n <= 0) return;
  const int b = int(src.extent(0)), h = int(src.extent(2)), d = int(src.extent(3));
  Kokkos::parallel_for(
      "blockattn::invariant_pack",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<4>>(exec, {0, 0, 0, 0}, {b, int(n), h, d}),
      KOKKOS_LAMBDA(int a, int i, int x, int y) { dst(a, i, x, y) = src(a, i, x, y); });
}

/// The invariant distributed forward of this rank's rows (`e`: the local
/// extents; lengths: every rank's local length; N their sum).
template <class Comm, class ExecSpace, class Partition, class Mask, class QV, class KV, class VV,
          class OV, class LV>
void invariant_ring_forward(Comm& comm, const ExecSpace& exec, const char* fn,
                            const Partition& part, const Mask& mask, const BlockExtents& e,
                            index_type N, const std::vector<index_type>& lengths, const QV& q,
                            const KV& k, const VV& v, const OV& o, const LV& lse,
                            const DistributedOptions& opts, RunStats& stats) {
  using V = typename OV::non_const_value_type;
  using mem = typename ExecSpace::memory_space;
  const int P = comm.size(), rank = comm.rank(), tile = opts.invariant_tile;
  check_invariant<V>(fn, tile, N);
  check_invariant_tiles(part, fn, N, P, tile);
  if constexpr (!std::is_same<V, double>::value) {
    const index_type most = *std::max_element(lengths.begin(), lengths.end());
    using Buf = Kokkos::View<V****, Kokkos::LayoutRight, mem>;
    Buf kb[2], vb[2];
    for (int x = 0; x < 2; ++x) {
      kb[x] = Buf(
          Kokkos::view_alloc(std::string("blockattn::invariant_k"), Kokkos::WithoutInitializing),
          e.batch, most, e.kv_heads, e.dim);
      vb[x] = Buf(
          Kokkos::view_alloc(std::string("blockattn::invariant_v"), Kokkos::WithoutInitializing),
          e.batch, most, e.kv_heads, e.dim);
    }
    stats.workspace_bytes = 4 * std::int64_t(kb[0].span()) * std::int64_t(sizeof(V));
    invariant_pack(exec, k, kb[0], e.keys);
    invariant_pack(exec, v, vb[0], e.keys);
    std::vector<InvariantRuns<mem>> runs(static_cast<std::size_t>(P));
    for (int r = 0; r < P; ++r)
      runs[std::size_t(r)] = invariant_runs_view(
          exec, invariant_runs(part.positions(N, P, r), lengths[std::size_t(r)], tile));
    InvariantState<mem> st(e.batch, e.heads, e.queries, e.dim);
    const float scale = softmax_scale<float>(opts.scale, e.dim);
    const auto qpos = part.positions(N, P, rank);
    Transfers<Comm, ExecSpace> xfer(comm, exec, fn, opts.timeout_seconds);
    using Tr = typename Transfers<Comm, ExecSpace>::transfer_type;
    const int steps = 2 * P;  // pass 1: steps 0 .. P-1; pass 2: P .. 2P-1
    const int next = (rank + 1) % P, prev = (rank + P - 1) % P;
    int cur = 0;
    exec.fence();
    for (int s = 0; s < steps; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      const int src = ((rank - s) % P + P) % P;
      // The blocks travel P - 1 times per pass; pass 2 starts from the own
      // block, packed again (a copy instead of a transfer).
      const bool shift = P > 1 && s + 1 < steps && s != P - 1;
      if (P > 1 && s == P) {
        invariant_pack(exec, k, kb[cur], e.keys);
        invariant_pack(exec, v, vb[cur], e.keys);
      }
      Tr tr[4];
      if (shift) {
        tr[0] = xfer.receive(kb[1 - cur], prev, s, Message::k);
        tr[1] = xfer.receive(vb[1 - cur], prev, s, Message::v);
        tr[2] = xfer.send(kb[cur], next, s, Message::k);
        tr[3] = xfer.send(vb[cur], next, s, Message::v);
        xfer.flush();
      }
      BlockExtents be = e;
      be.keys = int(lengths[std::size_t(src)]);
      const auto kpos = part.positions(N, P, src);
      const auto t1 = std::chrono::steady_clock::now();
      if (s < P)
        invariant_pass<false>(exec, be, q, kb[cur], vb[cur], mask, qpos, kpos, scale,
                              runs[std::size_t(src)], st);
      else
        invariant_pass<true>(exec, be, q, kb[cur], vb[cur], mask, qpos, kpos, scale,
                             runs[std::size_t(src)], st);
      exec.fence();
      StepStats ss;
      ss.step = s;
      ss.source = src;
      ss.query_source = rank;
      ss.computed = true;
      ss.path = BlockPath::portable;
      ss.compute_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
      if (shift) {
        for (Tr& t : tr) xfer.wait(t);
        ss.bytes_sent = ss.bytes_received =
            2 * std::int64_t(kb[0].span()) * std::int64_t(sizeof(V));
        cur = 1 - cur;
      }
      ss.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      stats.steps.push_back(ss);
    }
    invariant_finish(exec, st, o, lse, e.heads);
    apply_sinks(exec, opts.sinks, o, lse);
  }
}

}  // namespace blockattn::impl

namespace blockattn::impl {

/// The invariant distributed backward of this rank's rows and keys: a KV
/// ring for dQ (the K/V blocks travel; dQ's folds of the own rows gather
/// every key tile), then a Q ring for dK and dV (Q, dO, LSE log2 e and D
/// travel; the own keys' folds gather every query tile). Only inputs travel;
/// the bounds and the sinks' sums are allreduced (maxima; exact sums).
template <class Comm, class ExecSpace, class Partition, class Mask, class QV, class KV, class VV,
          class OV, class LV, class DOV, class DQV, class DKV, class DVV>
void invariant_ring_backward(Comm& comm, const ExecSpace& exec, const char* fn,
                             const Partition& part, const Mask& mask, const BlockExtents& e,
                             index_type N, const std::vector<index_type>& lengths, const QV& q,
                             const KV& k, const VV& v, const OV& o, const LV& lse, const DOV& dout,
                             const DQV& dq, const DKV& dk, const DVV& dv,
                             const DistributedOptions& opts, RunStats& stats) {
  using V = typename OV::non_const_value_type;
  using mem = typename ExecSpace::memory_space;
  const int P = comm.size(), rank = comm.rank(), tile = opts.invariant_tile;
  check_invariant<V>(fn, tile, N);
  check_invariant_tiles(part, fn, N, P, tile);
  if constexpr (!std::is_same<V, double>::value) {
    const index_type most = *std::max_element(lengths.begin(), lengths.end());
    const index_type n = e.queries;  // this rank's rows and keys
    using R3 = Kokkos::View<float***, Kokkos::LayoutRight, mem>;
    using Buf = Kokkos::View<V****, Kokkos::LayoutRight, mem>;
    R3 drow[2], lse2[2];
    Buf xb[2], yb[2];  // pass 1: K, V; pass 2: Q, dO
    for (int x = 0; x < 2; ++x) {
      drow[x] = R3("blockattn::invariant_d", e.batch, e.heads, most);
      lse2[x] = R3("blockattn::invariant_lse2", e.batch, e.heads, most);
    }
    const auto d_own =
        Kokkos::subview(drow[0], Kokkos::ALL, Kokkos::ALL, Kokkos::make_pair(index_type(0), n));
    const auto l_own =
        Kokkos::subview(lse2[0], Kokkos::ALL, Kokkos::ALL, Kokkos::make_pair(index_type(0), n));
    invariant_row_terms(exec, o, dout, lse, d_own, l_own);
    // The bounds over every rank (maxima).
    InvariantGradBounds b = invariant_local_bounds(exec, q, k, v, dout, d_own);
    {
      const float in[5] = {b.q, b.k, b.v, b.do1, b.d};
      float out[5];
      allreduce_values(comm, in, out, 5, ReduceOp::max);
      b.q = out[0], b.k = out[1], b.v = out[2], b.do1 = out[3], b.d = out[4];
    }
    // dL/dsinks: each rank's rows into per-head folds, summed exactly.
    if (opts.sink_grad.data() != nullptr) {
      Kokkos::View<double**, Kokkos::LayoutRight, mem> sf("blockattn::invariant_sink_folds",
                                                          e.heads, 3);
      invariant_sink_terms(exec, opts.sinks, lse, d_own, sf, InvariantFolds::exponent_of(b.d));
      exec.fence();
      if (P > 1) allreduce_view(comm, exec, sf, ReduceOp::sum);
      invariant_sink_finish(exec, sf, opts.sink_grad);
    }
    std::vector<InvariantRuns<mem>> runs(static_cast<std::size_t>(P));
    for (int r = 0; r < P; ++r)
      runs[std::size_t(r)] = invariant_runs_view(
          exec, invariant_runs(part.positions(N, P, r), lengths[std::size_t(r)], tile));
    InvariantGrads<mem> gq(e.batch, e.heads, n, e.dim), gk(e.batch, e.kv_heads, n, e.dim),
        gv(e.batch, e.kv_heads, n, e.dim);
    const float scale = softmax_scale<float>(opts.scale, e.dim);
    const auto own_pos = part.positions(N, P, rank);
    Transfers<Comm, ExecSpace> xfer(comm, exec, fn, opts.timeout_seconds);
    using Tr = typename Transfers<Comm, ExecSpace>::transfer_type;
    const int next = (rank + 1) % P, prev = (rank + P - 1) % P;
    for (int pass = 0; pass < 2; ++pass) {
      const int heads = pass == 0 ? e.kv_heads : e.heads;
      for (int x = 0; x < 2; ++x) {
        xb[x] = Buf(
            Kokkos::view_alloc(std::string("blockattn::invariant_x"), Kokkos::WithoutInitializing),
            e.batch, most, heads, e.dim);
        yb[x] = Buf(
            Kokkos::view_alloc(std::string("blockattn::invariant_y"), Kokkos::WithoutInitializing),
            e.batch, most, heads, e.dim);
      }
      invariant_pack(exec, pass == 0 ? k : q, xb[0], n);
      invariant_pack(exec, pass == 0 ? v : dout, yb[0], n);
      exec.fence();
      int cur = 0;
      for (int s = 0; s < P; ++s) {
        const auto t0 = std::chrono::steady_clock::now();
        const int src = ((rank - s) % P + P) % P;
        const bool shift = s + 1 < P;
        Tr tr[8];
        int posted = 0;
        if (shift) {
          tr[posted++] = xfer.receive(xb[1 - cur], prev, 2 * s + pass, Message::k);
          tr[posted++] = xfer.receive(yb[1 - cur], prev, 2 * s + pass, Message::v);
          tr[posted++] = xfer.send(xb[cur], next, 2 * s + pass, Message::k);
          tr[posted++] = xfer.send(yb[cur], next, 2 * s + pass, Message::v);
          if (pass == 1) {
            tr[posted++] = xfer.receive(lse2[1 - cur], prev, 2 * s + pass, Message::q_lse);
            tr[posted++] = xfer.receive(drow[1 - cur], prev, 2 * s + pass, Message::q_drow);
            tr[posted++] = xfer.send(lse2[cur], next, 2 * s + pass, Message::q_lse);
            tr[posted++] = xfer.send(drow[cur], next, 2 * s + pass, Message::q_drow);
          }
          xfer.flush();
        }
        const auto t1 = std::chrono::steady_clock::now();
        BlockExtents be = e;
        const auto src_pos = part.positions(N, P, src);
        if (pass == 0) {  // dQ of the own rows against rank src's keys
          be.keys = int(lengths[std::size_t(src)]);
          invariant_grad_pass<false>(exec, be, q, dout, lse2[0], drow[0], xb[cur], yb[cur], mask,
                                     own_pos, src_pos, scale, runs[std::size_t(src)], b, gq, gq);
        } else {  // dK, dV of the own keys against rank src's rows
          be.queries = int(lengths[std::size_t(src)]);
          invariant_grad_pass<true>(exec, be, xb[cur], yb[cur], lse2[cur], drow[cur], k, v, mask,
                                    src_pos, own_pos, scale, runs[std::size_t(src)], b, gk, gv);
        }
        exec.fence();
        StepStats ss;
        ss.step = pass * P + s;
        ss.source = src;
        ss.query_source = pass == 0 ? rank : src;
        ss.computed = true;
        ss.path = BlockPath::portable;
        ss.compute_seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
        for (int t = 0; t < posted; ++t) xfer.wait(tr[t]);
        if (shift) {
          ss.bytes_sent = ss.bytes_received =
              2 * std::int64_t(xb[0].span()) * std::int64_t(sizeof(V)) +
              (pass == 1 ? 2 * std::int64_t(drow[0].span()) * 4 : 0);
          cur = 1 - cur;
        }
        ss.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        stats.steps.push_back(ss);
      }
    }
    // The same verdict on every rank: the overflow counts summed.
    const std::int64_t over = comm.allreduce(
        std::int64_t(invariant_overflows(gq) + invariant_overflows(gk)), ReduceOp::sum);
    if (over > 0) fail_invariant_overflow(fn, long(over));
    invariant_grad_finish(exec, gq, dq, double(scale));
    invariant_grad_finish(exec, gk, dk, double(scale));
    invariant_grad_finish(exec, gv, dv, 1.0);
    exec.fence();
  }
}

}  // namespace blockattn::impl
