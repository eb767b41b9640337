// SPDX-License-Identifier: Apache-2.0
// Head-parallel distributed attention (DeepSpeed-Ulysses, arXiv:2309.14509):
// the ranks hold the sequence split by a partition (any built-in or user
// partition, as for DistributedAttention); one all-to-all turns that into the
// whole sequence for H / P heads on every rank, attention runs on one device
// over global positions (so every mask, custom ones included, just works),
// and one all-to-all brings O (and LSE) back to the sequence split. The
// backward does the same with Q, K, V, O, dO, LSE in and dQ, dK, dV out
// (with options.invariant it runs the invariant rings over every rank
// instead: distributed/impl/invariant_ring.hpp, no all-to-all).
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
#include <blockattn/distributed/impl/head_exchange.hpp>
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

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace blockattn {

template <class Partition, class Mask, class Communicator,
          class ExecSpace = Kokkos::DefaultExecutionSpace>
class UlyssesAttention
    : public impl::HeadParallelCalls<UlyssesAttention<Partition, Mask, Communicator, ExecSpace>,
                                     Communicator, Mask, ExecSpace>,
      public impl::DriverTypes<Partition, Mask, Communicator, ExecSpace> {
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
  explicit UlyssesAttention(Communicator comm, const Mask& mask = {}, const ExecSpace& exec = {})
      : Base(std::move(comm), mask, exec) {}

 private:
  using Base = impl::HeadParallelCalls<UlyssesAttention, Communicator, Mask, ExecSpace>;
  friend Base;
  /// The wall time of a call: its one step's seconds.
  static void account(RunStats& stats, double seconds) { stats.steps.back().seconds = seconds; }
  static constexpr const char* fn = "UlyssesAttention::forward";
  static constexpr const char* bfn = "UlyssesAttention::backward";
  using mem = typename ExecSpace::memory_space;
  template <class T>
  using Buf4 = typename Base::template Buf4<T>;
  template <class T>
  using Buf3 = typename Base::template Buf3<T>;

  /// Per-rank checks, then one consensus step (as DistributedAttention; it
  /// also gathers every rank's local length). Returns this rank's extents
  /// and the global length.
  template <class QV, class KV, class VV, class OV, class LV, class Extra = void (*)()>
  std::pair<BlockExtents, index_type> validate(
      const char* name, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
      const DistributedOptions& opts, Extra extra = [] {}) {
    std::vector<std::int64_t> lengths;
    const BlockExtents e = this->agree(
        name, q, k, v, o, lse, opts, "ulysses", [](impl::Fingerprint&) {}, extra, lengths);
    // Every rank holds the same configuration now: these throw on all or none.
    const int P = this->m_comm.size();
    const index_type N = impl::agreed_length<Partition>(name, lengths);
    check_partition_contract<Partition>(name, N, P);
    this->require_heads(name, e, P, "");
    if (impl::check_policies_always || opts.check_policies)
      impl::check_mask_contract(name, this->m_exec, this->m_mask, 0, N, 0, N);
    return {e, N};
  }

  /// The ranks' rows as a partition (the invariant backward's rings): the partition's.
  static Partition rank_layout(index_type) { return Partition{}; }

  /// The all-to-alls over every rank (impl::HeadExchange): the whole sequence
  /// in global order on each rank, for its heads.
  impl::HeadExchange<Communicator, ExecSpace> exchange(const BlockExtents& e, index_type N) {
    const int P = this->m_comm.size();
    return impl::HeadExchange<Communicator, ExecSpace>(
        this->m_comm, this->m_exec, impl::ulysses_index<Partition>(this->m_exec, N, P),
        UlyssesHeads::make(e.heads, e.kv_heads, P));
  }

  /// The single-device options of the local attention.
  static ForwardOptions local_options(const DistributedOptions& opts, BlockPathCounts& paths) {
    ForwardOptions f;
    static_cast<ImplementationOptions&>(f) = opts;
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
    const BlockLayout layout = forward_layout<C, ExecSpace>(e.dim);
    // One single-device call over the whole sequence for this rank's heads:
    // the dispatcher's choice of implementation (kernel/dispatch.hpp), as
    // attention_forward's; the sinks are folded in by the caller. Counted
    // alive: the kernels' packed K/V block (the planner's `packed`, whichever
    // implementation runs: ulysses_forward_volume()).
    BlockPathCounts paths;
    const std::int64_t tiles = (std::int64_t(N) + layout.block_k - 1) / layout.block_k;
    const std::int64_t packed = 2 * std::int64_t(e.batch) * x.kl * tiles * layout.block_k *
                                layout.dim_padded * std::int64_t(sizeof(C));
    const double busy = x.run_local(packed, [&] {
      impl::forward_call(this->m_exec, x.local_extents(e, N), qf, kf, vf, of, lf,
                         impl::shift_heads(this->m_mask, x.first_q), OffsetPositions{},
                         OffsetPositions{}, impl::softmax_scale<C>(opts.scale, e.dim),
                         local_options(opts, paths));
    });
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
    const auto in = x.template backward_in<V>(q, k, v, o, dout);
    const auto lf = x.in_lse(lse);
    // dQ in the storage type (one rank computes each head); dK, dV in the
    // compute type: a replicated K/V head's partials are summed on the way back.
    const Buf4<V> dqf = x.template buffer<V>("blockattn::ulysses_dq", e.batch, N, x.hl, e.dim);
    const Buf4<C> dkf = x.template buffer<C>("blockattn::ulysses_dk", e.batch, N, x.kl, e.dim),
                  dvf = x.template buffer<C>("blockattn::ulysses_dv", e.batch, N, x.kl, e.dim);
    const BlockLayout layout = backward_layout<C, ExecSpace>(e.dim);
    BlockPathCounts paths;
    // Counted alive: the kernels' packed keys and rows (the planner's
    // `packed`: ulysses_backward_volume()).
    const std::int64_t ktiles = (std::int64_t(N) + layout.block_k - 1) / layout.block_k;
    const std::int64_t qrows =
        (std::int64_t(N) + layout.block_q - 1) / layout.block_q * layout.block_q;
    const std::int64_t packed = std::int64_t(sizeof(C)) * e.batch *
                                (3 * x.kl * ktiles * layout.block_k * layout.dim_padded +
                                 x.hl * qrows * (2 * std::int64_t(layout.dim_padded) + 2));
    const double busy = x.run_local(packed, [&] {
      impl::backward_call(this->m_exec, x.local_extents(e, N), in.q, in.k, in.v, in.o, lf, in.dout,
                          dqf, dkf, dvf, impl::shift_heads(this->m_mask, x.first_q),
                          OffsetPositions{}, OffsetPositions{},
                          impl::softmax_scale<C>(opts.scale, e.dim), local_options(opts, paths));
    });
    x.template gradients_out<C>(dqf, dkf, dvf, dq, dk, dv);
    finish_stats(layout, N, opts, x, busy, paths, stats);
  }

  /// The one "step" of RunStats: the local attention's tiles (per batch and
  /// head, over the whole sequence), the bytes of the all-to-alls, the peak
  /// workspace and the busy time (packing and the local attention).
  void finish_stats(const BlockLayout& layout, index_type N, const DistributedOptions& opts,
                    const impl::HeadExchange<Communicator, ExecSpace>& x, double busy,
                    const BlockPathCounts& paths, RunStats& stats) const {
    const int rank = this->m_comm.rank();
    StepStats st;
    st.step = 0;
    st.source = rank;
    st.query_source = rank;
    st.computed = true;
    st.tiles = count_tiles(this->m_mask, N, N, layout.block_q, layout.block_k, OffsetPositions{},
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
