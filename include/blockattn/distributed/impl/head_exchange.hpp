// SPDX-License-Identifier: Apache-2.0
// What the head-parallel drivers (UlyssesAttention, HybridAttention) share:
// the all-to-all phases around their local attention (HeadExchange: the
// sequence split to the head split of a group's ranks, and back), the
// buffers and their peak, and their public calls written once
// (HeadParallelCalls: checks, the consensus, the run, the sinks).
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/distributed/impl/consensus.hpp>
#include <blockattn/distributed/impl/invariant_ring.hpp>
#include <blockattn/distributed/impl/sinks.hpp>
#include <blockattn/distributed/impl/step_loop.hpp>
#include <blockattn/distributed/impl/validate.hpp>
#include <blockattn/distributed/options.hpp>
#include <blockattn/kernel/sinks.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/partition.hpp>
#include <blockattn/schedule/ulysses.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace blockattn::impl {

/// Workspace in use and its peak (RunStats::workspace_bytes of Ulysses is
/// the peak: its buffers live in phases).
struct UlyssesLive {
  std::int64_t now = 0, peak = 0;
  void add(std::int64_t b) {
    now += b;
    peak = now > peak ? now : peak;
  }
  void sub(std::int64_t b) { now -= b; }
};

/// Where the tokens of each rank of an all-to-all group go in the gathered
/// sequence of N tokens: at(i, t) = the position of rank i's local token t,
/// -1 past rank i's tokens (ranks may hold different numbers; the all-to-all
/// chunks have rows() rows, the longest rank's).
template <class MemorySpace>
struct UlyssesIndex {
  Kokkos::View<index_type**, Kokkos::LayoutRight, MemorySpace> at;  // (rank, local)
  index_type N = 0;
  KOKKOS_INLINE_FUNCTION index_type operator()(int i, int t) const { return at(i, t); }
  int rows() const { return int(at.extent(1)); }
};
template <class T, class ExecSpace>
using UlyssesBuf5 = Kokkos::View<T*****, Kokkos::LayoutRight, typename ExecSpace::memory_space>;
template <class T, class ExecSpace>
using UlyssesBuf4 = Kokkos::View<T****, Kokkos::LayoutRight, typename ExecSpace::memory_space>;
template <class T, class ExecSpace>
using UlyssesBuf3 = Kokkos::View<T***, Kokkos::LayoutRight, typename ExecSpace::memory_space>;
template <class ExecSpace>
using UlyssesRange = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;

/// f(i, bb, t, hh, dd) for i < P, bb < b, t < n, hh < inner, dd < d: one
/// team per row (i, bb, t), its threads over hh and vector lanes over dd, so
/// that a row's index arithmetic is done once per row, not per element.
template <class ExecSpace, class F>
void ulysses_rows(const char* label, const ExecSpace& exec, int P, int b, int n, int inner, int d,
                  const F& f) {
  using Team = Kokkos::TeamPolicy<ExecSpace>;
  Kokkos::parallel_for(
      label, Team(exec, P * b * n, Kokkos::AUTO),
      KOKKOS_LAMBDA(const typename Team::member_type& m) {
        const int row = m.league_rank();
        const int t = row % n, bb = (row / n) % b, i = row / (n * b);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(m, inner), [&](const int hh) {
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(m, d),
                               [&](const int dd) { f(i, bb, t, hh, dd); });
        });
      });
}

/// where(i, t): the global position of rank i's local token t (-1 past its tokens).
template <class Partition, class ExecSpace>
UlyssesIndex<typename ExecSpace::memory_space> ulysses_index(const ExecSpace& exec, index_type N,
                                                             int P) {
  UlyssesIndex<typename ExecSpace::memory_space> w;
  w.N = N;
  const int most = int(max_local_length<Partition>(N, P));
  w.at = decltype(w.at)(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::ulysses_index"),
                        P, most);
  auto h = Kokkos::create_mirror_view(w.at);
  for (int i = 0; i < P; ++i) {
    const auto map = Partition::positions(N, P, i);
    const int n = int(local_length<Partition>(N, P, i));
    for (int t = 0; t < most; ++t) h(i, t) = t < n ? map(t) : index_type(-1);
  }
  Kokkos::deep_copy(exec, w.at, h);
  exec.fence();  // h is a temporary
  return w;
}

/// First head of each rank's chunk, on the device.
template <class ExecSpace>
Kokkos::View<int*, typename ExecSpace::memory_space> ulysses_firsts(const ExecSpace& exec,
                                                                    const UlyssesHeads& u,
                                                                    bool kv) {
  Kokkos::View<int*, typename ExecSpace::memory_space> f("blockattn::ulysses_first", u.P);
  auto h = Kokkos::create_mirror_view(f);
  for (int r = 0; r < u.P; ++r) h(r) = kv ? u.first_kv_head(r) : u.first_head(r);
  Kokkos::deep_copy(exec, f, h);
  exec.fence();
  return f;
}

template <class View>
std::int64_t ulysses_bytes(const View& v) {
  return std::int64_t(v.span()) * std::int64_t(sizeof(typename View::value_type));
}
template <class MemorySpace>
std::int64_t ulysses_bytes(const UlyssesIndex<MemorySpace>& w) {
  return ulysses_bytes(w.at);
}

/// Sequence-sharded x (batch, n, H, d) -> head-sharded (batch, N, hl, d) of
/// this rank's heads [first(r), first(r) + hl), in global order. Adds the
/// bytes sent to other ranks to `sent`.
template <class T, class Comm, class ExecSpace, class X>
UlyssesBuf4<T, ExecSpace> ulysses_to_heads(
    Comm& comm, const ExecSpace& exec, const X& x, int hl,
    const Kokkos::View<int*, typename ExecSpace::memory_space>& first,
    const UlyssesIndex<typename ExecSpace::memory_space>& where, std::int64_t& sent,
    UlyssesLive& live) {
  const int P = comm.size(), b = int(x.extent(0)), n = int(x.extent(1)), d = int(x.extent(3));
  const int m = where.rows();  // rows of a chunk: the longest rank's tokens
  const index_type N = where.N;
  auto alloc = [](const char* label) {
    return Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label));
  };
  // The all-to-all's two buffers from the host buffer cache (fresh pages cost
  // as much as the copies: about 40 % of the call's time was page faults);
  // `full` outlives the call.
  CallBuffers<ExecSpace> buffers(exec);
  using B5 = UlyssesBuf5<T, ExecSpace>;
  const B5 send = buffers.template view<B5>("blockattn::ulysses_send", P, b, m, hl, d),
           recv = buffers.template view<B5>("blockattn::ulysses_recv", P, b, m, hl, d);
  UlyssesBuf4<T, ExecSpace> full(alloc("blockattn::ulysses_full"), b, N, hl, d);
  const std::int64_t chunk = std::int64_t(b) * m * hl * d;
  ulysses_rows(
      "blockattn::ulysses_pack", exec, P, b, n, hl, d,
      KOKKOS_LAMBDA(const int j, const int bb, const int t, const int hh, const int dd) {
        send(j, bb, t, hh, dd) = T(x(bb, t, first(j) + hh, dd));
      });
  comm.alltoall(exec, send, recv, chunk);
  ulysses_rows(
      "blockattn::ulysses_unpack", exec, P, b, m, hl, d,
      KOKKOS_LAMBDA(const int i, const int bb, const int t, const int hh, const int dd) {
        const index_type g = where(i, t);
        if (g >= 0) full(bb, g, hh, dd) = recv(i, bb, t, hh, dd);
      });
  sent += chunk * (P - 1) * std::int64_t(sizeof(T));
  live.add(ulysses_bytes(send) + ulysses_bytes(recv) + ulysses_bytes(full));
  // send and recv: back to the host buffer cache on return; `full` is the caller's.
  live.sub(ulysses_bytes(send) + ulysses_bytes(recv));
  return full;
}

/// LSE (batch, H, n) -> (batch, hl, N) of this rank's heads, global order.
template <class Comm, class ExecSpace, class L>
UlyssesBuf3<typename L::non_const_value_type, ExecSpace> ulysses_lse_to_heads(
    Comm& comm, const ExecSpace& exec, const L& lse, int hl,
    const Kokkos::View<int*, typename ExecSpace::memory_space>& first,
    const UlyssesIndex<typename ExecSpace::memory_space>& where, std::int64_t& sent,
    UlyssesLive& live) {
  using C = typename L::non_const_value_type;
  const int P = comm.size(), b = int(lse.extent(0)), n = int(lse.extent(2)), m = where.rows();
  const index_type N = where.N;
  auto alloc = [](const char* label) {
    return Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label));
  };
  CallBuffers<ExecSpace> buffers(exec);
  using B4 = Kokkos::View<C****, Kokkos::LayoutRight, typename ExecSpace::memory_space>;
  const B4 send = buffers.template view<B4>("blockattn::ulysses_send", P, b, hl, m),
           recv = buffers.template view<B4>("blockattn::ulysses_recv", P, b, hl, m);
  UlyssesBuf3<C, ExecSpace> full(alloc("blockattn::ulysses_lse"), b, hl, N);
  const std::int64_t chunk = std::int64_t(b) * hl * m;
  Kokkos::parallel_for(
      "blockattn::ulysses_pack_lse", UlyssesRange<ExecSpace>(exec, 0, chunk * P),
      KOKKOS_LAMBDA(const std::int64_t idx) {
        const int t = int(idx % m), hh = int((idx / m) % hl), bb = int((idx / (m * hl)) % b),
                  j = int(idx / chunk);
        if (t < n) send(j, bb, hh, t) = lse(bb, first(j) + hh, t);
      });
  comm.alltoall(exec, send, recv, chunk);
  Kokkos::parallel_for(
      "blockattn::ulysses_unpack_lse", UlyssesRange<ExecSpace>(exec, 0, chunk * P),
      KOKKOS_LAMBDA(const std::int64_t idx) {
        const int t = int(idx % m), hh = int((idx / m) % hl), bb = int((idx / (m * hl)) % b),
                  i = int(idx / chunk);
        const index_type g = where(i, t);
        if (g >= 0) full(bb, hh, g) = recv(i, bb, hh, t);
      });
  sent += chunk * (P - 1) * std::int64_t(sizeof(C));
  live.add(ulysses_bytes(send) + ulysses_bytes(recv) + ulysses_bytes(full));
  // send and recv: back to the host buffer cache on return; `full` is the caller's.
  live.sub(ulysses_bytes(send) + ulysses_bytes(recv));
  return full;
}

/// Head-sharded full (batch, N, hl, d) -> this rank's rows of `out` (batch,
/// n, H, d): out(b, t, h, :) = the sum, in compute type C, over the ranks j
/// whose chunk [first(j), first(j) + hl) holds h (one rank, or every rank
/// that shares a replicated K/V head), rounded once to out's type.
template <class C, class T, class Comm, class ExecSpace, class Out>
void ulysses_from_heads(Comm& comm, const ExecSpace& exec, const UlyssesBuf4<T, ExecSpace>& full,
                        const Out& out, int hl,
                        const Kokkos::View<int*, typename ExecSpace::memory_space>& first,
                        const UlyssesIndex<typename ExecSpace::memory_space>& where,
                        std::int64_t& sent, UlyssesLive& live) {
  using OS = typename Out::non_const_value_type;
  const int P = comm.size(), b = int(out.extent(0)), n = int(out.extent(1)), H = int(out.extent(2)),
            d = int(out.extent(3));
  const int m = where.rows();
  CallBuffers<ExecSpace> buffers(exec);
  using B5 = UlyssesBuf5<T, ExecSpace>;
  const B5 send = buffers.template view<B5>("blockattn::ulysses_send", P, b, m, hl, d),
           recv = buffers.template view<B5>("blockattn::ulysses_recv", P, b, m, hl, d);
  const std::int64_t chunk = std::int64_t(b) * m * hl * d;
  ulysses_rows(
      "blockattn::ulysses_pack_back", exec, P, b, m, hl, d,
      KOKKOS_LAMBDA(const int i, const int bb, const int t, const int hh, const int dd) {
        const index_type g = where(i, t);
        if (g >= 0) send(i, bb, t, hh, dd) = full(bb, g, hh, dd);
      });
  comm.alltoall(exec, send, recv, chunk);
  ulysses_rows(
      "blockattn::ulysses_unpack_back", exec, 1, b, n, H, d,
      KOKKOS_LAMBDA(const int, const int bb, const int t, const int h, const int dd) {
        C s = C(0);
        for (int j = 0; j < P; ++j)
          if (h >= first(j) && h < first(j) + hl) s += C(recv(j, bb, t, h - first(j), dd));
        out(bb, t, h, dd) = OS(s);
      });
  sent += chunk * (P - 1) * std::int64_t(sizeof(T));
  live.add(ulysses_bytes(send) + ulysses_bytes(recv));
  live.sub(ulysses_bytes(send) + ulysses_bytes(recv));  // back to the cache on return
}

template <class Comm, class ExecSpace, class LFull, class L>
void ulysses_lse_from_heads(Comm& comm, const ExecSpace& exec, const LFull& full, const L& lse,
                            int hl,
                            const Kokkos::View<int*, typename ExecSpace::memory_space>& first,
                            const UlyssesIndex<typename ExecSpace::memory_space>& where,
                            std::int64_t& sent, UlyssesLive& live) {
  using C = typename L::non_const_value_type;
  const int P = comm.size(), b = int(lse.extent(0)), n = int(lse.extent(2)), m = where.rows();
  CallBuffers<ExecSpace> buffers(exec);
  using B4 = Kokkos::View<C****, Kokkos::LayoutRight, typename ExecSpace::memory_space>;
  const B4 send = buffers.template view<B4>("blockattn::ulysses_send", P, b, hl, m),
           recv = buffers.template view<B4>("blockattn::ulysses_recv", P, b, hl, m);
  const std::int64_t chunk = std::int64_t(b) * hl * m;
  Kokkos::parallel_for(
      "blockattn::ulysses_pack_lse_back", UlyssesRange<ExecSpace>(exec, 0, chunk * P),
      KOKKOS_LAMBDA(const std::int64_t idx) {
        const int t = int(idx % m), hh = int((idx / m) % hl), bb = int((idx / (m * hl)) % b),
                  i = int(idx / chunk);
        const index_type g = where(i, t);
        if (g >= 0) send(i, bb, hh, t) = full(bb, hh, g);
      });
  comm.alltoall(exec, send, recv, chunk);
  Kokkos::parallel_for(
      "blockattn::ulysses_unpack_lse_back", UlyssesRange<ExecSpace>(exec, 0, chunk * P),
      KOKKOS_LAMBDA(const std::int64_t idx) {
        const int t = int(idx % m), hh = int((idx / m) % hl), bb = int((idx / (m * hl)) % b),
                  j = int(idx / chunk);
        if (t < n) lse(bb, first(j) + hh, t) = recv(j, bb, hh, t);
      });
  sent += chunk * (P - 1) * std::int64_t(sizeof(C));
  live.add(ulysses_bytes(send) + ulysses_bytes(recv));
  live.sub(ulysses_bytes(send) + ulysses_bytes(recv));  // back to the cache on return
}

/// The all-to-all phases around a head-parallel compute, written once for
/// UlyssesAttention (one group: every rank) and HybridAttention (the ranks of
/// a group): in, the sequence split to the head split (whole sequence of the
/// group in `where`'s order, this rank's heads); out, back. Counts the bytes
/// sent and the peak of the buffers alive.
template <class Comm, class ExecSpace>
struct HeadExchange {
  using mem = typename ExecSpace::memory_space;
  Comm& comm;
  ExecSpace exec;
  UlyssesIndex<mem> where;
  Kokkos::View<int*, mem> fq, fkv;  // each rank's first query / K/V head
  int hl, kl;                       // query and K/V heads per rank
  int first_q;                      // this rank's first query head (global index)
  std::int64_t sent = 0;
  UlyssesLive live;

  HeadExchange(Comm& c, const ExecSpace& e, const UlyssesIndex<mem>& w, const UlyssesHeads& u)
      : comm(c),
        exec(e),
        where(w),
        fq(ulysses_firsts(e, u, false)),
        fkv(ulysses_firsts(e, u, true)),
        hl(u.heads_per_rank),
        kl(u.kv_heads_per_rank),
        first_q(u.first_head(c.rank())) {
    live.add(ulysses_bytes(where));
  }
  /// Rows (batch, sequence, heads, dim) in: query heads (`kv` = false) or K/V heads.
  template <class V, class X>
  UlyssesBuf4<V, ExecSpace> in(const X& x, bool kv) {
    return ulysses_to_heads<V>(comm, exec, x, kv ? kl : hl, kv ? fkv : fq, where, sent, live);
  }
  template <class L>
  auto in_lse(const L& lse) {
    return ulysses_lse_to_heads(comm, exec, lse, hl, fq, where, sent, live);
  }
  /// Rows back to the sequence split (K/V heads: replicated heads summed in C).
  template <class C, class T, class X>
  void out(const UlyssesBuf4<T, ExecSpace>& full, const X& x, bool kv) {
    ulysses_from_heads<C>(comm, exec, full, x, kv ? kl : hl, kv ? fkv : fq, where, sent, live);
  }
  template <class LFull, class L>
  void out_lse(const LFull& full, const L& lse) {
    ulysses_lse_from_heads(comm, exec, full, lse, hl, fq, where, sent, live);
  }
  /// The rows a backward takes in: q, k, v, o, dout to the head split.
  template <class V>
  struct BackwardRows {
    UlyssesBuf4<V, ExecSpace> q, k, v, o, dout;
  };
  template <class V, class QV, class KV, class VV, class OV, class DOV>
  BackwardRows<V> backward_in(const QV& q, const KV& k, const VV& v, const OV& o, const DOV& dout) {
    return {in<V>(q, false), in<V>(k, true), in<V>(v, true), in<V>(o, false), in<V>(dout, false)};
  }
  /// The gradients back to the sequence split (dK, dV: replicated heads summed in C).
  template <class C, class GQ, class GK, class DQV, class DKV, class DVV>
  void gradients_out(const GQ& dqf, const GK& dkf, const GK& dvf, const DQV& dq, const DKV& dk,
                     const DVV& dv) {
    out<C>(dqf, dq, false);
    out<C>(dkf, dk, true);
    out<C>(dvf, dv, true);
  }
  /// The local attention's extents: the whole sequence (N rows) on this rank's heads.
  BlockExtents local_extents(const BlockExtents& e, index_type N) const {
    BlockExtents fe = e;
    fe.queries = fe.keys = int(N);
    fe.heads = hl;
    fe.kv_heads = kl;
    return fe;
  }
  /// Runs f (the local attention) with `packed` bytes (its kernels' packed
  /// operands) counted alive; the seconds it took, to its fence.
  template <class F>
  double run_local(std::int64_t packed, F&& f) {
    live.add(packed);
    const auto c0 = std::chrono::steady_clock::now();
    f();
    exec.fence();
    const double busy =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
    live.sub(packed);
    return busy;
  }
  /// A buffer of `rows` rows for `heads` heads, counted alive.
  template <class T>
  UlyssesBuf4<T, ExecSpace> buffer(const char* label, int batch, index_type rows, int heads,
                                   int dim) {
    UlyssesBuf4<T, ExecSpace> b(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)),
                                batch, rows, heads, dim);
    live.add(ulysses_bytes(b));
    return b;
  }
  template <class T>
  UlyssesBuf3<T, ExecSpace> lse_buffer(const char* label, int batch, index_type rows) {
    UlyssesBuf3<T, ExecSpace> b(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)),
                                batch, hl, rows);
    live.add(ulysses_bytes(b));
    return b;
  }
};

/// The public calls of a head-parallel driver (UlyssesAttention,
/// HybridAttention), written once: the compile-time checks, the consensus
/// (Derived::validate), the run (Derived::run_forward / run_backward) and the
/// wall time of the call (Derived::account).
template <class Derived, class Communicator, class Mask, class ExecSpace>
class HeadParallelCalls {
 public:
  Communicator& communicator() { return m_comm; }
  const Mask& mask() const { return m_mask; }

  /// O and LSE of this rank's queries; the same arguments and results as
  /// DistributedAttention::forward. Collective.
  template <class QV, class KV, class VV, class OV, class LV>
  RunStats forward(const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                   const DistributedOptions& opts = {}) {
    check_forward_view_types<QV, KV, VV, OV, LV>();
    RunStats stats;
    if constexpr (forward_views_ok<QV, KV, VV, OV, LV>()) {
      Derived& d = static_cast<Derived&>(*this);
      const auto t0 = std::chrono::steady_clock::now();
      const auto [e, N] = d.validate(Derived::fn, q, k, v, o, lse, opts);
      d.run_forward(e, N, q, k, v, o, lse, opts, stats);
      apply_sinks(m_exec, opts.sinks, o, lse);
      m_exec.fence();
      Derived::account(stats, seconds_since(t0));
    }
    return stats;
  }

  /// dQ, dK, dV of this rank's rows; the same arguments as
  /// DistributedAttention::backward. Collective.
  template <class QV, class KV, class VV, class OV, class LV, class DOV, class DQV, class DKV,
            class DVV>
  RunStats backward(const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                    const DOV& dout, const DQV& dq, const DKV& dk, const DVV& dv,
                    const DistributedOptions& opts = {}) {
    RunStats stats;
    if constexpr (check_backward_view_types<QV, KV, VV, OV, LV, DOV, DQV, DKV, DVV>()) {
      Derived& d = static_cast<Derived&>(*this);
      const auto t0 = std::chrono::steady_clock::now();
      const auto [e, N] = d.validate(Derived::bfn, q, k, v, o, lse, opts, [&] {
        validate_backward<ExecSpace>(Derived::bfn, q, k, v, o, lse, dout, dq, dk, dv, opts.scale,
                                     true);
      });
      if (opts.invariant) {
        // The invariant backward (the same options on every rank): the rings
        // of DistributedAttention's over every rank, on the ranks' own rows
        // (distributed/impl/invariant_ring.hpp): no all-to-all, and the
        // gradients of every other schedule, bit for bit.
        const auto layout = d.rank_layout(N);
        const int P = m_comm.size();
        std::vector<index_type> lengths(static_cast<std::size_t>(P));
        for (int r = 0; r < P; ++r) lengths[std::size_t(r)] = local_length(layout, N, P, r);
        invariant_ring_backward(m_comm, m_exec, Derived::bfn, layout, m_mask, e, N, lengths, q, k,
                                v, o, lse, dout, dq, dk, dv, opts, stats);
        return stats;
      }
      distributed_sink_gradient(m_comm, m_exec, opts, o, dout, lse);
      d.run_backward(e, N, q, k, v, o, lse, dout, dq, dk, dv, opts, stats);
      m_exec.fence();
      Derived::account(stats, seconds_since(t0));
    }
    return stats;
  }

 protected:
  HeadParallelCalls(const Communicator& comm, const Mask& mask, const ExecSpace& exec)
      : m_comm(comm), m_mask(mask), m_exec(exec) {}

  template <class T>
  using Buf4 = UlyssesBuf4<T, ExecSpace>;
  template <class T>
  using Buf3 = UlyssesBuf3<T, ExecSpace>;

  Communicator m_comm;  // every rank of the call
  Mask m_mask;
  ExecSpace m_exec;

  /// The consensus step of a call over Derived's communicator
  /// (agree_on_call): the fingerprint names the schedule, Derived's own
  /// fields (`describe`) and the partition; every rank's local length is
  /// gathered into `lengths`. Returns this rank's extents.
  template <class QV, class KV, class VV, class OV, class LV, class Describe, class Extra>
  BlockExtents agree(const char* name, const QV& q, const KV& k, const VV& v, const OV& o,
                     const LV& lse, const DistributedOptions& opts, const std::string& schedule,
                     const Describe& describe, Extra extra, std::vector<std::int64_t>& lengths) {
    using Partition = typename Derived::partition_type;
    return agree_on_call<ExecSpace>(
        m_comm, name, m_mask, q, k, v, o, lse, opts, false,
        [&](Fingerprint& f) {
          f.text("schedule", schedule);
          describe(f);
          f.text("partition", std::string(Partition::name()) + " (" + type_name<Partition>() + ")");
        },
        extra, &lengths);
  }

  /// Throws (on every rank alike: the extents agree) unless `P` ranks split
  /// the call's heads (UlyssesHeads); `what` says what P is.
  static void require_heads(const char* name, const BlockExtents& e, int P, const char* what) {
    if (const std::string why = UlyssesHeads::why_not(e.heads, e.kv_heads, P); !why.empty())
      fail(name, why, what);
  }
};

}  // namespace blockattn::impl
