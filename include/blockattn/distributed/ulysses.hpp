// SPDX-License-Identifier: Apache-2.0
// Head-parallel distributed attention (DeepSpeed-Ulysses, arXiv:2309.14509):
// the ranks hold the sequence split by a partition (any built-in or user
// partition, as for DistributedAttention); one all-to-all turns that into the
// whole sequence for H / P heads on every rank, attention runs on one device
// over global positions (so every mask, custom ones included, just works),
// and one all-to-all brings O (and LSE) back to the sequence split. The
// backward does the same with Q, K, V, O, dO, LSE in and dQ, dK, dV out.
//
//   blockattn::UlyssesAttention<blockattn::ZigzagPartition, blockattn::CausalMask,
//                               blockattn::MpiCommunicator<>> attn(comm);
//   attn.forward(q, k, v, o, lse);                       // local Views: the partition's tokens
//   attn.backward(q, k, v, o, lse, dout, dq, dk, dv);
//
// Heads: rank r computes query heads [r H/P, (r+1) H/P), so P must divide H.
// K/V heads (GQA): with G = H / H_kv query heads per K/V head, rank r needs
// the K/V heads of its query heads; when H/P is a multiple of G each rank gets
// H_kv / P of them, when G is a multiple of H/P (fewer K/V heads than ranks)
// one K/V head goes to the G / (H/P) ranks that share it (replicated, as
// users of Ulysses do) and their dK, dV are summed on the way back. Other
// shapes are rejected on every rank.
//
// Bytes per rank and call (B batch, n = N/P local tokens, d head dim, s the
// storage size, c the compute size): forward sends (P-1)/P of Q, K, V (with
// replication, K and V for every receiving rank) and of O, plus the LSE in c;
// the backward sends Q, K, V, O, dO in s and LSE in c, and returns dQ in s and
// dK, dV in c (partials of a replicated head are summed in fp32 for 16-bit
// storage). RunStats reports them in one step.
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/distributed/distributed_attention.hpp>
#include <blockattn/distributed/impl/consensus.hpp>
#include <blockattn/distributed/impl/step_loop.hpp>
#include <blockattn/distributed/impl/validate.hpp>
#include <blockattn/kernel/attention_backward.hpp>
#include <blockattn/kernel/attention_forward.hpp>
#include <blockattn/kernel/buffer_cache.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/work.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/partition.hpp>
#include <blockattn/schedule/ulysses.hpp>

#include <chrono>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace blockattn {

namespace impl {

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
template <class Derived>
class HeadParallelCalls {
 public:
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
      apply_sinks(d.m_exec, opts.sinks, o, lse);
      d.m_exec.fence();
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
      using ES = typename Derived::execution_space;
      const auto t0 = std::chrono::steady_clock::now();
      const auto [e, N] = d.validate(Derived::bfn, q, k, v, o, lse, opts, [&] {
        validate_backward<ES>(Derived::bfn, q, k, v, o, lse, dout, dq, dk, dv, opts.scale, true);
      });
      distributed_sink_gradient(d.m_comm, d.m_exec, opts, o, dout, lse);
      d.run_backward(e, N, q, k, v, o, lse, dout, dq, dk, dv, opts, stats);
      d.m_exec.fence();
      Derived::account(stats, seconds_since(t0));
    }
    return stats;
  }
};

}  // namespace impl

template <class Partition, class Mask, class Communicator,
          class ExecSpace = Kokkos::DefaultExecutionSpace>
class UlyssesAttention
    : public impl::HeadParallelCalls<UlyssesAttention<Partition, Mask, Communicator, ExecSpace>> {
  static_assert(Kokkos::is_execution_space<ExecSpace>::value,
                "BlockAttn: UlyssesAttention<Partition, Mask, Communicator, ExecSpace>: ExecSpace "
                "must be a Kokkos execution space (e.g. Kokkos::OpenMP)");
  static_assert(is_partition_policy_v<Partition>,
                "BlockAttn: UlyssesAttention: the first parameter must be a partition policy "
                "(ContiguousPartition, StripedPartition, ZigzagPartition, or your own)");
  static_assert(!is_partition_policy_v<Partition> || impl::is_stateless_partition<Partition>::value,
                "BlockAttn: UlyssesAttention takes a stateless partition policy (static members; "
                "the built-ins); a partition object such as TablePartition runs with "
                "DistributedAttention");
  static_assert(is_mask_policy_v<Mask>,
                "BlockAttn: UlyssesAttention: the second parameter must be a mask policy");
  static_assert(is_communicator_v<Communicator>,
                "BlockAttn: UlyssesAttention: the third parameter must be a communicator "
                "(MpiCommunicator<>, SelfCommunicator; see blockattn/comm/communicator.hpp)");
  static_assert(!is_communicator_v<Communicator> || is_alltoall_communicator_v<Communicator>,
                "BlockAttn: UlyssesAttention needs a communicator with the optional alltoall() "
                "collective (MpiCommunicator<> and SelfCommunicator have it; see "
                "blockattn/comm/communicator.hpp)");

 public:
  using partition_type = Partition;
  using mask_type = Mask;
  using communicator_type = Communicator;
  using execution_space = ExecSpace;

  explicit UlyssesAttention(Communicator comm, const Mask& mask = {}, const ExecSpace& exec = {})
      : m_comm(std::move(comm)), m_mask(mask), m_exec(exec) {}

  Communicator& communicator() { return m_comm; }
  const Mask& mask() const { return m_mask; }

 private:
  friend class impl::HeadParallelCalls<UlyssesAttention>;
  /// The wall time of a call: its one step's seconds.
  static void account(RunStats& stats, double seconds) { stats.steps.back().seconds = seconds; }
  static constexpr const char* fn = "UlyssesAttention::forward";
  static constexpr const char* bfn = "UlyssesAttention::backward";
  using mem = typename ExecSpace::memory_space;
  template <class T>
  using Buf4 = impl::UlyssesBuf4<T, ExecSpace>;
  template <class T>
  using Buf3 = impl::UlyssesBuf3<T, ExecSpace>;

  Communicator m_comm;
  Mask m_mask;
  ExecSpace m_exec;

  /// Per-rank checks, then one consensus step (as DistributedAttention; it
  /// also gathers every rank's local length). Returns this rank's extents
  /// and the global length.
  template <class QV, class KV, class VV, class OV, class LV, class Extra = void (*)()>
  std::pair<BlockExtents, index_type> validate(
      const char* name, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
      const DistributedOptions& opts, Extra extra = [] {}) {
    std::vector<std::int64_t> lengths;
    const BlockExtents e = impl::agree_on_call<ExecSpace>(
        m_comm, name, m_mask, q, k, v, o, lse, opts, false,
        [](impl::Fingerprint& f) {
          f.text("schedule", "ulysses")
              .text("partition",
                    std::string(Partition::name()) + " (" + impl::type_name<Partition>() + ")");
        },
        extra, &lengths);
    // Every rank holds the same configuration now: these throw on all or none.
    const int P = m_comm.size();
    const index_type N = impl::agreed_length<Partition>(name, lengths);
    check_partition_contract<Partition>(name, N, P);
    if (const std::string why = UlyssesHeads::why_not(e.heads, e.kv_heads, P); !why.empty())
      impl::fail(name, why);
    if (impl::check_policies_always || opts.check_policies)
      impl::check_mask_contract(name, m_exec, m_mask, 0, N, 0, N);
    return {e, N};
  }

  /// The all-to-alls over every rank (impl::HeadExchange): the whole sequence
  /// in global order on each rank, for its heads.
  impl::HeadExchange<Communicator, ExecSpace> exchange(const BlockExtents& e, index_type N) {
    const int P = m_comm.size();
    return impl::HeadExchange<Communicator, ExecSpace>(m_comm, m_exec,
                                                       impl::ulysses_index<Partition>(m_exec, N, P),
                                                       UlyssesHeads::make(e.heads, e.kv_heads, P));
  }

  /// The single-device options of the local attention.
  static ForwardOptions local_options(const DistributedOptions& opts, BlockPathCounts& paths) {
    ForwardOptions f;
    f.portable_only = opts.portable_only;
    f.host_matrix = opts.host_matrix;
    f.tensor_cores = opts.tensor_cores;
    f.tensor_core_backward = opts.tensor_core_backward;
    f.guard_masked_nonfinite = opts.guard_masked_nonfinite;
    f.paths = &paths;
    return f;
  }

  template <class QV, class KV, class VV, class OV, class LV>
  void run_forward(const BlockExtents& e, index_type N, const QV& q, const KV& k, const VV& v,
                   const OV& o, const LV& lse, const DistributedOptions& opts, RunStats& stats) {
    using V = typename OV::non_const_value_type;
    using C = compute_t<V>;
    auto x = exchange(e, N);
    // Phase 1: Q, K, V to the head split (whole sequence, global order).
    const Buf4<V> qf = x.template in<V>(q, false), kf = x.template in<V>(k, true),
                  vf = x.template in<V>(v, true);
    // Phase 2: attention over global positions on this rank's heads.
    const Buf4<V> of = x.template buffer<V>("blockattn::ulysses_o", e.batch, N, x.hl, e.dim);
    const Buf3<C> lf = x.template lse_buffer<C>("blockattn::ulysses_lse", e.batch, N);
    BlockExtents fe = e;
    fe.queries = fe.keys = int(N);
    fe.heads = x.hl;
    fe.kv_heads = x.kl;
    const BlockLayout layout = forward_layout<C, ExecSpace>(e.dim);
    const C scale = impl::softmax_scale<C>(opts.scale, e.dim);
    // One single-device call over the whole sequence for this rank's heads:
    // the dispatcher's choice of implementation (kernel/dispatch.hpp), as
    // attention_forward's; the sinks are folded in by the caller.
    BlockPathCounts paths;
    // The kernels' packed K/V block (the planner's `packed`, whichever
    // implementation runs: ulysses_forward_volume()).
    const std::int64_t tiles = (std::int64_t(N) + layout.block_k - 1) / layout.block_k;
    const std::int64_t packed = 2 * std::int64_t(e.batch) * x.kl * tiles * layout.block_k *
                                layout.dim_padded * std::int64_t(sizeof(C));
    x.live.add(packed);
    const auto c0 = std::chrono::steady_clock::now();
    impl::forward_call(m_exec, fe, qf, kf, vf, of, lf, impl::shift_heads(m_mask, x.first_q),
                       OffsetPositions{}, OffsetPositions{}, scale, local_options(opts, paths));
    m_exec.fence();
    const double busy =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
    x.live.sub(packed);
    // Phase 3: O and LSE back to the sequence split.
    x.template out<C>(of, o, false);
    x.out_lse(lf, lse);
    finish_stats(layout, N, opts, x, busy, paths, stats);
  }

  template <class QV, class KV, class VV, class OV, class LV, class DOV, class DQV, class DKV,
            class DVV>
  void run_backward(const BlockExtents& e, index_type N, const QV& q, const KV& k, const VV& v,
                    const OV& o, const LV& lse, const DOV& dout, const DQV& dq, const DKV& dk,
                    const DVV& dv, const DistributedOptions& opts, RunStats& stats) {
    using V = typename OV::non_const_value_type;
    using C = compute_t<V>;
    auto x = exchange(e, N);
    const Buf4<V> qf = x.template in<V>(q, false), kf = x.template in<V>(k, true),
                  vf = x.template in<V>(v, true), of = x.template in<V>(o, false),
                  dof = x.template in<V>(dout, false);
    const auto lf = x.in_lse(lse);
    // dQ in the storage type (one rank computes each head); dK, dV in the
    // compute type: a replicated K/V head's partials are summed on the way back.
    const Buf4<V> dqf = x.template buffer<V>("blockattn::ulysses_dq", e.batch, N, x.hl, e.dim);
    const Buf4<C> dkf = x.template buffer<C>("blockattn::ulysses_dk", e.batch, N, x.kl, e.dim),
                  dvf = x.template buffer<C>("blockattn::ulysses_dv", e.batch, N, x.kl, e.dim);
    BlockExtents fe = e;
    fe.queries = fe.keys = int(N);
    fe.heads = x.hl;
    fe.kv_heads = x.kl;
    const BlockLayout layout = backward_layout<C, ExecSpace>(e.dim);
    const C scale = impl::softmax_scale<C>(opts.scale, e.dim);
    BlockPathCounts paths;
    // The kernels' packed keys and rows (the planner's `packed`:
    // ulysses_backward_volume()).
    const std::int64_t ktiles = (std::int64_t(N) + layout.block_k - 1) / layout.block_k;
    const std::int64_t qrows =
        (std::int64_t(N) + layout.block_q - 1) / layout.block_q * layout.block_q;
    const std::int64_t packed = std::int64_t(sizeof(C)) * e.batch *
                                (3 * x.kl * ktiles * layout.block_k * layout.dim_padded +
                                 x.hl * qrows * (2 * std::int64_t(layout.dim_padded) + 2));
    x.live.add(packed);
    const auto c0 = std::chrono::steady_clock::now();
    impl::backward_call(m_exec, fe, qf, kf, vf, of, lf, dof, dqf, dkf, dvf,
                        impl::shift_heads(m_mask, x.first_q), OffsetPositions{}, OffsetPositions{},
                        scale, local_options(opts, paths));
    m_exec.fence();
    const double busy =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
    x.live.sub(packed);
    x.template out<C>(dqf, dq, false);
    x.template out<C>(dkf, dk, true);
    x.template out<C>(dvf, dv, true);
    finish_stats(layout, N, opts, x, busy, paths, stats);
  }

  /// The one "step" of RunStats: the local attention's tiles (per batch and
  /// head, over the whole sequence), the bytes of the all-to-alls, the peak
  /// workspace and the busy time (packing and the local attention).
  void finish_stats(const BlockLayout& layout, index_type N, const DistributedOptions& opts,
                    const impl::HeadExchange<Communicator, ExecSpace>& x, double busy,
                    const BlockPathCounts& paths, RunStats& stats) const {
    const int rank = m_comm.rank();
    StepStats st;
    st.step = 0;
    st.source = rank;
    st.query_source = rank;
    st.computed = true;
    st.tiles = count_tiles(m_mask, N, N, layout.block_q, layout.block_k, OffsetPositions{},
                           OffsetPositions{}, opts.count_pairs);
    st.bytes_sent = x.sent;
    st.bytes_received = x.sent;  // every rank sends and receives the same amounts
    st.compute_seconds = busy;
    st.path = paths.user     ? BlockPath::user
              : paths.fused  ? BlockPath::fused
              : paths.matrix ? BlockPath::matrix
                             : BlockPath::portable;
    st.fused_pieces = int(paths.fused_pieces);
    stats.block_q = layout.block_q;
    stats.block_k = layout.block_k;
    stats.workspace_bytes = x.live.peak;
    stats.steps.push_back(st);
  }
};

}  // namespace blockattn
