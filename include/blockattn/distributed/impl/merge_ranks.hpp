// SPDX-License-Identifier: Apache-2.0
// The merge of the serving calls' partial results over the ranks
// (distributed/decode.hpp, distributed/batch.hpp). Each rank holds the
// normalised partial (O, LSE) of its shard for every row; the merge gives
// every rank the rows' results:
//   tree (Tree Attention): one max-allreduce of the LSEs (exact in any
//        order), then one sum over the ranks of e^(lse - max) (O, 1) by
//        recursive doubling in a fixed order (sum_over_ranks): log P steps;
//   ring: every partial travels the ring (P - 1 steps), then every rank
//        merges the P partials in rank order.
// Either way every rank gets the same bits, and a row's bits depend on its
// own partials and P only: not on how many other rows the call merges (an
// MPI allreduce picks its algorithm, and with it the order of each
// element's sum, by message size), so a batched call gives the bits of
// separate ones.
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/distributed/impl/transfer.hpp>
#include <blockattn/distributed/options.hpp>
#include <blockattn/kernel/decode.hpp>
#include <blockattn/kernel/sinks.hpp>

#include <cstdint>

namespace blockattn {
namespace impl {

/// buf(i) += other(i), then waits (a function of its own: nvcc takes no
/// extended lambda inside another lambda).
template <class ExecSpace, class T>
void add_into(const ExecSpace& exec, const Kokkos::View<T*, typename ExecSpace::memory_space>& buf,
              const Kokkos::View<T*, typename ExecSpace::memory_space>& other) {
  Kokkos::parallel_for(
      "blockattn::sum_over_ranks",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0,
                                                                      std::int64_t(buf.extent(0))),
      KOKKOS_LAMBDA(const std::int64_t i) { buf(i) = buf(i) + other(i); });
  exec.fence();
}

/// buf summed over the ranks in place, every element in the same order
/// whatever buf's length: ranks P' .. P - 1 (P' the largest power of two <=
/// P) first add theirs into rank r - P', then recursive doubling over the P'
/// ranks (at level m the partners r and r ^ m add their sums: x + y == y + x
/// bitwise, so both hold the same bits), then ranks r - P' send the total
/// back. Waits for `exec`; log2 P' + 2 message steps at most.
template <class C, class ExecSpace, class T>
void sum_over_ranks(C& comm, const ExecSpace& exec, const char* fn, double timeout,
                    const Kokkos::View<T*, typename ExecSpace::memory_space>& buf) {
  using mem = typename ExecSpace::memory_space;
  const int P = comm.size(), me = comm.rank();
  if (P == 1) return;
  int p2 = 1;
  while (2 * p2 <= P) p2 *= 2;
  const std::int64_t n = std::int64_t(buf.extent(0));
  Kokkos::View<T*, mem> other(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::sum_in"),
                              std::size_t(n));
  Transfers<C, ExecSpace> x(comm, exec, fn, timeout);
  exec.fence();  // buf's producer
  int step = 0;
  // Fold ranks p2 .. P - 1 into ranks 0 .. P - p2 - 1.
  if (me >= p2) {
    auto s = x.send(buf, me - p2, step, Message::rows);
    x.wait(s);
  } else if (me + p2 < P) {
    auto r = x.receive(other, me + p2, step, Message::rows);
    x.wait(r);
    add_into(exec, buf, other);
  }
  ++step;
  if (me < p2) {
    for (int m = 1; m < p2; m *= 2, ++step) {
      const int peer = me ^ m;
      auto r = x.receive(other, peer, step, Message::rows);
      auto s = x.send(buf, peer, step, Message::rows);
      x.wait(s);
      x.wait(r);
      add_into(exec, buf, other);
    }
  } else {
    for (int m = 1; m < p2; m *= 2) ++step;
  }
  // The folded ranks get the total.
  if (me >= p2) {
    auto r = x.receive(buf, me - p2, step, Message::rows);
    x.wait(r);
    exec.fence();
  } else if (me + p2 < P) {
    auto s = x.send(buf, me + p2, step, Message::rows);
    x.wait(s);
  }
}

inline const char* merge_name(MergeAlgorithm m) {
  return m == MergeAlgorithm::tree ? "tree" : "ring";
}

/// Row r of (batch, heads, rows) -> (b, h, i).
struct RowIndex {
  int rows, heads;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t r, int& b, int& h, int& i) const {
    i = int(r % rows);
    h = int((r / rows) % heads);
    b = int(r / (std::int64_t(rows) * heads));
  }
};

/// The merge over ranks of the rows' normalised partials (o_part, lse_part:
/// compute type T) into o (storage OS) and lse, each head's sink folded into
/// the normalisation (a 16-bit o is rounded once). A row's bits depend on
/// its own partials and P only, never on the other rows of the call.
template <class C, class ExecSpace, class T, class OV, class LV>
void merge_over_ranks(
    C& comm, const ExecSpace& exec, const char* fn, MergeAlgorithm algorithm, double timeout,
    const Kokkos::View<T****, Kokkos::LayoutRight, typename ExecSpace::memory_space>& o_part,
    const Kokkos::View<T***, Kokkos::LayoutRight, typename ExecSpace::memory_space>& lse_part,
    const OV& o, const LV& lse, const SinkLogits& sinks) {
  using mem = typename ExecSpace::memory_space;
  using OS = typename OV::non_const_value_type;
  sink_view<mem> sk;
  if (sinks.data() != nullptr) sk = sink_view<mem>(sinks.data(), sinks.extent(0));
  const int B = int(o.extent(0)), N = int(o.extent(1)), H = int(o.extent(2)), D = int(o.extent(3));
  const std::int64_t rows = std::int64_t(B) * N * H;
  const int P = comm.size();
  // Row r = (b, h, i) packed as [O (D values), weight or LSE].
  const RowIndex row_of{N, H};
  const std::int64_t W = D + 1;
  const Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>> each_row(exec, 0, rows);
  if (algorithm == MergeAlgorithm::tree || P == 1) {
    Kokkos::View<T*, mem> mx(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::mx"),
                             rows);
    Kokkos::parallel_for(
        "blockattn::merge_max", each_row, KOKKOS_LAMBDA(const std::int64_t r) {
          int b, h, i;
          row_of(r, b, h, i);
          const T l = lse_part(b, h, i);
          mx(r) = l == l ? l : -infinity<T>();  // a NaN part makes the row NaN below
        });
    allreduce_view(comm, exec, mx, ReduceOp::max);
    Kokkos::View<T*, mem> buf(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::merge"),
                              rows * W);
    Kokkos::parallel_for(
        "blockattn::merge_scale", each_row, KOKKOS_LAMBDA(const std::int64_t r) {
          int b, h, i;
          row_of(r, b, h, i);
          const T l = lse_part(b, h, i);
          // e^(lse - M): 0 for a part without a key, NaN for a NaN part.
          const T w = l == -infinity<T>() ? T(0) : (l != l ? l : kmath::exp(l - mx(r)));
          for (int d = 0; d < D; ++d) buf(r * W + d) = w != T(0) ? w * o_part(b, i, h, d) : T(0);
          buf(r * W + D) = w;
        });
    sum_over_ranks(comm, exec, fn, timeout, buf);
    Kokkos::parallel_for(
        "blockattn::merge_finish", each_row, KOKKOS_LAMBDA(const std::int64_t r) {
          int b, h, i;
          row_of(r, b, h, i);
          const T l = buf(r * W + D);
          T f;
          if (l == T(0)) {  // no rank saw a key
            for (int d = 0; d < D; ++d) o(b, i, h, d) = OS(T(0));
            lse(b, h, i) = fold_sink(-infinity<T>(), sink_of<T>(sk, h), f);
            return;
          }
          lse(b, h, i) = fold_sink(l != l ? l : mx(r) + kmath::log(l), sink_of<T>(sk, h), f);
          const T inv = T(1) / l;
          for (int d = 0; d < D; ++d) o(b, i, h, d) = OS(buf(r * W + d) * inv * f);
        });
    return;
  }
  // Ring: all P packed partials on every rank, then one merge in rank order.
  Kokkos::View<T**, Kokkos::LayoutRight, mem> all(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::merge_parts"), P, rows * W);
  const int me = comm.rank();
  Kokkos::parallel_for(
      "blockattn::merge_pack", each_row, KOKKOS_LAMBDA(const std::int64_t r) {
        int b, h, i;
        row_of(r, b, h, i);
        for (int d = 0; d < D; ++d) all(me, r * W + d) = o_part(b, i, h, d);
        all(me, r * W + D) = lse_part(b, h, i);
      });
  exec.fence();
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  // Through the schedules' transfer layer: its one tag encoding and the timeout.
  Transfers<C, ExecSpace> x(comm, exec, fn, timeout);
  for (int step = 0; step < P - 1; ++step) {
    // Send the partial received last step (our own first); receive prev's.
    const int send_part = (me - step + P) % P, recv_part = (me - step - 1 + 2 * P) % P;
    auto rr = x.receive(Kokkos::subview(all, recv_part, Kokkos::ALL), prev, step, Message::rows);
    auto sr = x.send(Kokkos::subview(all, send_part, Kokkos::ALL), next, step, Message::rows);
    x.wait(sr);
    x.wait(rr);
  }
  Kokkos::parallel_for(
      "blockattn::merge_ring", each_row, KOKKOS_LAMBDA(const std::int64_t r) {
        int b, h, i;
        row_of(r, b, h, i);
        lse(b, h, i) = merge_row<T>(
            P, D, [&](int s, int d) { return all(s, r * W + d); },
            [&](int s) { return all(s, r * W + D); }, [&](int d, T x) { o(b, i, h, d) = OS(x); },
            sink_of<T>(sk, h));
      });
}

}  // namespace impl
}  // namespace blockattn
