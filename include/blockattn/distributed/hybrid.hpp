// SPDX-License-Identifier: Apache-2.0
// The 2D hybrid schedule: P = P_a x P_r ranks; an all-to-all over heads inside
// each group of P_a consecutive ranks (Ulysses), and a DistributedAttention
// ring (any partition and schedule: RingSchedule, BurstSchedule,
// BalancedSchedule, AllGatherSchedule) across the P_r groups, for the group's
// tokens and H / P_a heads. USP (arXiv:2405.07719), LoongTrain
// (arXiv:2406.18485) and Transformer Engine's "a2a+p2p" run this layout: the
// all-to-all moves few bytes on a node's fast links, the ring scales past the
// head count across nodes.
//
//   blockattn::HybridAttention<blockattn::ZigzagPartition, blockattn::CausalMask,
//                              blockattn::RingSchedule, blockattn::MpiCommunicator<>>
//       attn(comm, /*ulysses=*/8);                   // groups of 8 ranks, P / 8 groups
//   attn.forward(q, k, v, o, lse);                   // local Views: hybrid_length() tokens
//   attn.backward(q, k, v, o, lse, dout, dq, dk, dv);
//
// Layout (blockattn/schedule/hybrid.hpp): the partition splits the sequence
// over the P_r groups; member a of a group holds the a-th of P_a consecutive
// pieces of its group's tokens. hybrid_to_local() / hybrid_from_local() copy
// a global View to and from it. With P_a = 1 this is DistributedAttention on
// P ranks; with P_r = 1 it is UlyssesAttention over a contiguous split.
//
// Heads: as UlyssesAttention with P_a ranks (H a multiple of P_a; GQA K/V
// heads sharded, or replicated when a group has more ranks than K/V heads,
// their dK, dV summed in the compute type on the way back). The invariant
// backward (options.invariant) runs DistributedAttention's invariant rings
// over all P ranks on the hybrid layout instead (no all-to-all, no such sum).
//
// RunStats: `steps` are the ring's (its bytes cross groups), alltoall_bytes
// the all-to-alls' (inside a group), workspace_bytes the peak of both.
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/distributed/distributed_attention.hpp>
#include <blockattn/distributed/impl/consensus.hpp>
#include <blockattn/distributed/impl/head_exchange.hpp>
#include <blockattn/distributed/impl/validate.hpp>
#include <blockattn/kernel/attention_backward.hpp>
#include <blockattn/kernel/attention_forward.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/partition.hpp>
#include <blockattn/schedule/hybrid.hpp>
#include <blockattn/schedule/ulysses.hpp>

#include <chrono>
#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace blockattn {

namespace impl {
/// where(i, t) = start_i + t: member i's local token t sits at start_i + t
/// of the group's Ng tokens (the members hold consecutive pieces, the
/// first Ng mod P one token longer); -1 past a member's piece.
template <class ExecSpace>
UlyssesIndex<typename ExecSpace::memory_space> concatenated_index(const ExecSpace& exec, int P,
                                                                  index_type Ng) {
  const EvenCut pieces{Ng, P};
  UlyssesIndex<typename ExecSpace::memory_space> w;
  w.N = Ng;
  const int most = int(pieces.length(0));
  w.at = decltype(w.at)(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::hybrid_index"),
                        P, most);
  auto h = Kokkos::create_mirror_view(w.at);
  for (int i = 0; i < P; ++i)
    for (int t = 0; t < most; ++t)
      h(i, t) = t < pieces.length(i) ? pieces.start(i) + t : index_type(-1);
  Kokkos::deep_copy(exec, w.at, h);
  exec.fence();  // h is a temporary
  return w;
}

/// Makes the grid after one consensus on its shape (a group size that
/// differs between ranks, or does not divide P, throws on every rank before
/// any split).
template <class Comm>
HybridGrid agreed_grid(Comm& comm, int ulysses) {
  Fingerprint f;
  f.text("call", "HybridAttention::HybridAttention")
      .number("argument 'ulysses' (ranks per all-to-all group)", ulysses);
  reach_consensus(comm, "HybridAttention::HybridAttention", std::string(), f);
  if (const std::string why = HybridGrid::why_not(comm.size(), ulysses); !why.empty())
    fail("HybridAttention::HybridAttention", why);
  return HybridGrid::make(comm.size(), ulysses);
}
}  // namespace impl

template <class Partition, class Mask, class Schedule, class Communicator,
          class ExecSpace = Kokkos::DefaultExecutionSpace>
class HybridAttention : public impl::HeadParallelCalls<
                            HybridAttention<Partition, Mask, Schedule, Communicator, ExecSpace>,
                            Communicator, Mask, ExecSpace>,
                        public impl::DriverTypes<Partition, Mask, Communicator, ExecSpace> {
  static_assert(!is_partition_policy_v<Partition> || impl::is_stateless_partition<Partition>::value,
                "BlockAttn: HybridAttention takes a stateless partition policy (static members; "
                "the built-ins); a partition object such as TablePartition runs with "
                "DistributedAttention");
  static_assert(is_communicator_v<Communicator>,
                "BlockAttn: HybridAttention: the fourth parameter must be a communicator "
                "(MpiCommunicator<>, SelfCommunicator; see blockattn/comm/communicator.hpp)");
  static_assert(!is_communicator_v<Communicator> || is_alltoall_communicator_v<Communicator>,
                "BlockAttn: HybridAttention needs a communicator with the optional alltoall() "
                "collective and split() (MpiCommunicator<> and SelfCommunicator have them; see "
                "blockattn/comm/communicator.hpp)");

 public:
  using schedule_type = Schedule;
  /// The ring across groups: DistributedAttention on the P_r ranks of one member index.
  using ring_type = DistributedAttention<Partition, Mask, Schedule, Communicator, ExecSpace>;

  /// Collective over `comm`: checks that `ulysses` (P_a, ranks per
  /// all-to-all group) is the same on every rank and divides P, then splits
  /// `comm` into the groups and the rings.
  HybridAttention(const Communicator& comm, int ulysses, const Mask& mask = {},
                  const ExecSpace& exec = {})
      : Base(comm, mask, exec),
        m_grid(impl::agreed_grid(this->m_comm, ulysses)),
        m_group(comm.split(m_grid.group(comm.rank()), m_grid.member(comm.rank()))),
        m_ring(ring_type(comm.split(m_grid.member(comm.rank()), m_grid.group(comm.rank())), mask,
                         exec)) {}

  const HybridGrid& grid() const { return m_grid; }
  Communicator& group_communicator() { return m_group; }
  ring_type& ring() { return m_ring; }

 private:
  using Base = impl::HeadParallelCalls<HybridAttention, Communicator, Mask, ExecSpace>;
  friend Base;
  /// The wall time of a call: what the ring's steps did not take is the all-to-alls'.
  static void account(RunStats& stats, double seconds) {
    stats.alltoall_seconds = seconds;
    for (const auto& s : stats.steps) stats.alltoall_seconds -= s.seconds;
  }
  static constexpr const char* fn = "HybridAttention::forward";
  static constexpr const char* bfn = "HybridAttention::backward";
  template <class T>
  using Buf4 = typename Base::template Buf4<T>;
  template <class T>
  using Buf3 = typename Base::template Buf3<T>;

  HybridGrid m_grid;
  Communicator m_group;  // the P_a ranks of this rank's group
  ring_type m_ring;      // the P_r ranks of this rank's member index

  /// Per-rank checks, one consensus over all P ranks, then the checks that
  /// follow from the agreed configuration (they throw on every rank or none).
  /// Returns this rank's extents and the global length (the sum of the
  /// local lengths, which the consensus gathers).
  template <class QV, class KV, class VV, class OV, class LV, class Extra = void (*)()>
  std::pair<BlockExtents, index_type> validate(
      const char* name, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
      const DistributedOptions& opts, Extra extra = [] {}) {
    const int ulysses = m_grid.ulysses;
    std::vector<std::int64_t> lengths;
    const BlockExtents e = this->agree(
        name, q, k, v, o, lse, opts, std::string("hybrid (ulysses x ") + Schedule::name() + ")",
        [ulysses](impl::Fingerprint& f) {
          f.number("ranks per all-to-all group (ulysses)", ulysses);
        },
        extra, lengths);
    const HybridGrid& g = m_grid;
    const index_type N = impl::agreed_length(
        name, lengths,
        [&](index_type n, int r) {
          impl::require_hybrid_layout<Partition>(name, n, g, this->m_comm.rank());
          return hybrid_length<Partition>(n, g, r);
        },
        [&](index_type n) {
          std::ostringstream s;
          s << "the hybrid layout (" << Partition::name() << " partition over " << g.ring
            << " ring groups of " << g.ulysses << ") of N = " << n
            << " tokens (the sum over the ranks)";
          return s.str();
        },
        "hybrid_length<Partition>(N, grid, rank)");
    this->require_heads(name, e, m_grid.ulysses, " (here: ranks per all-to-all group)");
    return {e, N};
  }

  /// Moves the all-to-all accounting into the ring's stats: its peak adds
  /// what the phases around the ring hold (as ulysses_forward_volume()).
  static void merge(RunStats& stats, const RunStats& ring, impl::UlyssesLive& live) {
    live.add(ring.workspace_bytes);
    live.sub(ring.workspace_bytes);
    stats.steps = ring.steps;
    stats.block_q = ring.block_q;
    stats.block_k = ring.block_k;
    stats.fused_workspace_bytes = ring.fused_workspace_bytes;
  }

  /// The ranks' rows as a partition over all P ranks (the invariant
  /// backward's rings): member a of group g holds the a-th piece of the
  /// group's tokens.
  struct RankLayout {
    using position_map = HybridPositions<typename Partition::position_map>;
    HybridGrid grid;
    static constexpr const char* name() { return "hybrid"; }
    index_type multiple_of(int) const { return 1; }
    index_type length(index_type N, int, int rank) const {
      return hybrid_length<Partition>(N, grid, rank);
    }
    position_map positions(index_type N, int, int rank) const {
      return hybrid_position_map<Partition>(N, grid, rank);
    }
  };
  RankLayout rank_layout(index_type) const { return RankLayout{m_grid}; }

  /// The group's all-to-alls (impl::HeadExchange, as UlyssesAttention's over
  /// the group's ranks): the group's tokens in concatenated order.
  impl::HeadExchange<Communicator, ExecSpace> exchange(const BlockExtents& e, index_type Ng) {
    return impl::HeadExchange<Communicator, ExecSpace>(
        m_group, this->m_exec, impl::concatenated_index(this->m_exec, m_grid.ulysses, Ng),
        UlyssesHeads::make(e.heads, e.kv_heads, m_grid.ulysses));
  }
  index_type group_length(index_type N) const {
    return hybrid_group_length<Partition>(N, m_grid, m_grid.group(this->m_comm.rank()));
  }

  template <class QV, class KV, class VV, class OV, class LV>
  void run_forward(const BlockExtents& e, index_type N, const QV& q, const KV& k, const VV& v,
                   const OV& o, const LV& lse, const DistributedOptions& opts, RunStats& stats) {
    using V = typename OV::non_const_value_type;
    using C = compute_t<V>;
    const index_type Ng = group_length(N);  // the group's tokens
    auto x = exchange(e, Ng);
    const Buf4<V> qf = x.template in<V>(q, false), kf = x.template in<V>(k, true),
                  vf = x.template in<V>(v, true);
    const Buf4<V> of = x.template buffer<V>("blockattn::hybrid_o", e.batch, Ng, x.hl, e.dim);
    const Buf3<C> lf = x.template lse_buffer<C>("blockattn::hybrid_lse", e.batch, Ng);
    // The ring computes this rank's heads of the group (global from x.first_q);
    // the sinks are folded in by the caller, on the whole heads.
    m_ring.set_mask(impl::shift_heads(this->m_mask, x.first_q));
    const RunStats ring = m_ring.forward(qf, kf, vf, of, lf, impl::without_sinks(opts));
    merge(stats, ring, x.live);
    x.template out<C>(of, o, false);
    x.out_lse(lf, lse);
    stats.alltoall_bytes = x.sent;
    stats.workspace_bytes = x.live.peak;
  }

  template <class QV, class KV, class VV, class OV, class LV, class DOV, class DQV, class DKV,
            class DVV>
  void run_backward(const BlockExtents& e, index_type N, const QV& q, const KV& k, const VV& v,
                    const OV& o, const LV& lse, const DOV& dout, const DQV& dq, const DKV& dk,
                    const DVV& dv, const DistributedOptions& opts, RunStats& stats) {
    using V = typename OV::non_const_value_type;
    using C = compute_t<V>;
    const index_type Ng = group_length(N);
    auto x = exchange(e, Ng);
    const auto in = x.template backward_in<V>(q, k, v, o, dout);
    const auto lf = x.in_lse(lse);
    // The ring's gradients are in the storage type (DistributedAttention's
    // contract); a replicated K/V head's partials are summed in the compute
    // type on the way back, so 16-bit storage rounds them once more than
    // UlyssesAttention does.
    const Buf4<V> dqf = x.template buffer<V>("blockattn::hybrid_dq", e.batch, Ng, x.hl, e.dim),
                  dkf = x.template buffer<V>("blockattn::hybrid_dk", e.batch, Ng, x.kl, e.dim),
                  dvf = x.template buffer<V>("blockattn::hybrid_dv", e.batch, Ng, x.kl, e.dim);
    m_ring.set_mask(impl::shift_heads(this->m_mask, x.first_q));
    const RunStats ring = m_ring.backward(in.q, in.k, in.v, in.o, lf, in.dout, dqf, dkf, dvf,
                                          impl::without_sinks(opts));
    merge(stats, ring, x.live);
    x.template gradients_out<C>(dqf, dkf, dvf, dq, dk, dv);
    stats.alltoall_bytes = x.sent;
    stats.workspace_bytes = x.live.peak;
  }
};

}  // namespace blockattn
