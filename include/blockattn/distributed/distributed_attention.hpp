// SPDX-License-Identifier: Apache-2.0
// Distributed attention over one sequence split across the ranks of a
// communicator: partition x mask x schedule x communicator x execution space,
// chosen at compile time.
//
//   blockattn::DistributedAttention<blockattn::StripedPartition, blockattn::CausalMask,
//                                   blockattn::RingSchedule, blockattn::MpiCommunicator<>,
//                                   Kokkos::OpenMP> attn(comm);
//   auto stats = attn.forward(q, k, v, o, lse);   // local Views: this rank's tokens
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/distributed/impl/backward_steps.hpp>
#include <blockattn/distributed/impl/buffers.hpp>
#include <blockattn/distributed/impl/consensus.hpp>
#include <blockattn/distributed/impl/forward_steps.hpp>
#include <blockattn/distributed/impl/invariant_ring.hpp>
#include <blockattn/distributed/impl/sinks.hpp>
#include <blockattn/distributed/impl/step_loop.hpp>
#include <blockattn/distributed/impl/transfer.hpp>
#include <blockattn/distributed/impl/validate.hpp>
#include <blockattn/distributed/options.hpp>
#include <blockattn/kernel/attention_backward.hpp>
#include <blockattn/kernel/attention_forward.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/work.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/partition.hpp>
#include <blockattn/schedule/balanced.hpp>
#include <blockattn/schedule/ring.hpp>

#include <array>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace blockattn {

template <class Partition, class Mask, class Schedule, class Communicator,
          class ExecSpace = Kokkos::DefaultExecutionSpace>
class DistributedAttention : public impl::DriverTypes<Partition, Mask, Communicator, ExecSpace> {
  static_assert(Kokkos::is_execution_space<ExecSpace>::value,
                "BlockAttn: DistributedAttention<Partition, Mask, Schedule, Communicator, "
                "ExecSpace>: ExecSpace must be a Kokkos execution space (e.g. Kokkos::OpenMP)");
  static_assert(is_partition_policy_v<Partition>,
                "BlockAttn: DistributedAttention: the first parameter must be a partition policy "
                "(ContiguousPartition, StripedPartition, ZigzagPartition, or your own; see "
                "blockattn/policy/partition.hpp)");
  static_assert(
      is_mask_policy_v<Mask>,
      "BlockAttn: DistributedAttention: the second parameter must be a mask policy "
      "(FullMask, CausalMask, SlidingWindowMask, or your own; see blockattn/policy/mask.hpp)");
  static_assert(is_schedule_v<Schedule>,
                "BlockAttn: DistributedAttention: the third parameter must be a schedule "
                "(RingSchedule, BurstSchedule, BalancedSchedule, AllGatherSchedule, or your "
                "own; see blockattn/schedule/ring.hpp, blockattn/schedule/balanced.hpp, "
                "blockattn/schedule/allgather.hpp)");
  // A complete description: one static_assert per missing member
  // (impl::check_schedule), for a schedule only (a type that is not one has
  // had its message above); this assertion itself always holds.
  static_assert(sizeof(impl::schedule_complete<Schedule>) > 0, "");
  static_assert(is_communicator_v<Communicator>,
                "BlockAttn: DistributedAttention: the fourth parameter must be a communicator "
                "(MpiCommunicator<>, SelfCommunicator; see blockattn/comm/communicator.hpp)");
  static_assert(!std::is_same<Schedule, BalancedSchedule>::value ||
                    std::is_same<Partition, ContiguousPartition>::value,
                "BlockAttn: BalancedSchedule (DistFlashAttn) balances the causal work of a "
                "ContiguousPartition; striped and zigzag partitions are balanced by their layout: "
                "use RingSchedule or BurstSchedule with them");
  static_assert(!std::is_same<Schedule, BalancedSchedule>::value ||
                    !std::is_same<Mask, FullMask>::value,
                "BlockAttn: BalancedSchedule needs a causal mask (no block attends to a later "
                "block); with FullMask every rank has the same work: use RingSchedule");
  static_assert(impl::partition_accessible_from<Partition, ExecSpace>(),
                "BlockAttn: DistributedAttention: the partition's table lives in a memory space "
                "this execution space cannot read (TablePartition<MemorySpace>: use the "
                "execution space's memory space)");
  // BalancedSchedule's limits have their own messages above.
  static_assert(std::is_same<Schedule, BalancedSchedule>::value ||
                    impl::schedule_supports<Schedule, Partition, Mask>::value,
                "BlockAttn: DistributedAttention: this schedule does not support this partition "
                "and mask");

 public:
  using schedule_type = Schedule;

  /// A stateless partition (the built-ins): the type says it all.
  explicit DistributedAttention(Communicator comm, const Mask& mask = {},
                                const ExecSpace& exec = {})
      : DistributedAttention(std::move(comm), Partition{}, mask, exec) {}
  /// A partition object (e.g. a TablePartition computed at run time): every
  /// rank passes the same layout (compared in the consensus through its
  /// parameters()).
  DistributedAttention(Communicator comm, const Partition& partition, const Mask& mask = {},
                       const ExecSpace& exec = {})
      : m_comm(std::move(comm)), m_part(partition), m_mask(mask), m_exec(exec) {}

  Communicator& communicator() { return m_comm; }
  const Partition& partition() const { return m_part; }
  const Mask& mask() const { return m_mask; }
  /// Replaces the mask (e.g. the document layout of the next batch). Every
  /// rank must make the same change before its next call (the consensus
  /// compares the masks).
  void set_mask(const Mask& mask) { m_mask = mask; }

  /// O and LSE of this rank's queries. q, k, v, o, lse are this rank's local
  /// Views, in the partition's local order (see to_local()): the
  /// local_length(partition(), N, P, rank) tokens the partition gives this rank
  /// (N is the sum over the ranks; a rank may hold none), same shapes as
  /// attention_forward. Collective: every rank of the communicator calls it;
  /// bad arguments on any rank throw on every rank.
  template <class QV, class KV, class VV, class OV, class LV>
  RunStats forward(const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                   const DistributedOptions& opts = {}) {
    impl::check_forward_view_types<QV, KV, VV, OV, LV>();
    if constexpr (impl::forward_views_ok<QV, KV, VV, OV, LV>()) {
      const Call c = validate(fn, q, k, v, o, lse, opts);
      using T = compute_t<typename OV::non_const_value_type>;
      RunStats stats;
      if (opts.invariant) {  // its own two-pass ring, whatever the schedule
        impl::invariant_ring_forward(m_comm, m_exec, fn, m_part, m_mask, c.e, c.N, c.lengths, q, k,
                                     v, o, lse, opts, stats);
        return stats;
      }
      run_forward(c, forward_layout<T, ExecSpace>(c.e.dim), q, k, v, o, lse, opts, stats);
      impl::apply_sinks(m_exec, opts.sinks, o, lse);
      return stats;
    } else {
      return RunStats{};
    }
  }

  /// dQ, dK, dV of this rank's local rows, from the local q, k, v, the o and
  /// lse that forward() returned, and dout = dL/dO. Collective, like forward().
  /// The schedule's backward_type picks the ring: KV ring (RingSchedule) or
  /// Q ring (BurstSchedule). RunStats reports the bytes each step sends.
  template <class QV, class KV, class VV, class OV, class LV, class DOV, class DQV, class DKV,
            class DVV>
  RunStats backward(const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                    const DOV& dout, const DQV& dq, const DKV& dk, const DVV& dv,
                    const DistributedOptions& opts = {}) {
    RunStats stats;
    if constexpr (impl::check_backward_view_types<QV, KV, VV, OV, LV, DOV, DQV, DKV, DVV>()) {
      using V = typename OV::non_const_value_type;
      const Call c = validate(bfn, q, k, v, o, lse, opts, [&] {
        impl::validate_backward<ExecSpace>(bfn, q, k, v, o, lse, dout, dq, dk, dv, opts.scale,
                                           true);
      });
      using T = compute_t<V>;
      if (opts.invariant) {  // its own two rings, whatever the schedule
        impl::invariant_ring_backward(m_comm, m_exec, bfn, m_part, m_mask, c.e, c.N, c.lengths, q,
                                      k, v, o, lse, dout, dq, dk, dv, opts, stats);
        return stats;
      }
      impl::distributed_sink_gradient(m_comm, m_exec, opts, o, dout, lse);
      run_backward(c, backward_layout<T, ExecSpace>(c.e.dim), q, k, v, o, lse, dout, dq, dk, dv,
                   opts, stats);
    }
    return stats;
  }

 private:
  static constexpr const char* fn = "DistributedAttention::forward";
  static constexpr const char* bfn = "DistributedAttention::backward";
  using Call = impl::CallExtents;

  Communicator m_comm;
  Partition m_part;
  Mask m_mask;
  ExecSpace m_exec;

  /// The checks of one collective call, then the consensus step: each rank
  /// checks its own arguments, then ONE allreduce tells every rank whether any
  /// rank failed, whether all ranks are about to run the same configuration
  /// (impl/consensus.hpp), and every rank's local length. A failure or a
  /// mismatch throws the same error on every rank before any transfer is
  /// posted.
  template <class QV, class KV, class VV, class OV, class LV, class Extra = void (*)()>
  Call validate(
      const char* name, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
      const DistributedOptions& opts, Extra extra = [] {}) {
    std::vector<std::int64_t> lengths;
    Call c;
    c.e = impl::agree_on_call<ExecSpace>(
        m_comm, name, m_mask, q, k, v, o, lse, opts, true,
        [this](impl::Fingerprint& f) {
          f.text("schedule",
                 std::string(Schedule::name()) + " (" + impl::type_name<Schedule>() + ")")
              .text("partition",
                    std::string(Partition::name()) + " (" + impl::type_name<Partition>() + ")");
          impl::add_partition(f, m_part);
        },
        extra, &lengths);

    // From here on every rank holds the same configuration and the same
    // lengths, so the checks below throw on every rank or on none, without
    // communication.
    const int P = m_comm.size();
    c.N = impl::agreed_length(m_part, name, lengths);
    for (const std::int64_t n : lengths) {
      c.lengths.push_back(n);
      c.most = int(n > c.most ? n : c.most);
    }
    check_partition_contract(m_part, name, c.N, P);
    if (impl::check_policies_always || opts.check_policies)
      impl::check_mask_contract(name, m_exec, m_mask, 0, c.N, 0, c.N);
    if (const std::string why = Schedule::template can_implement<Partition>(m_mask, c.N, P);
        !why.empty())
      impl::fail(name, "argument 'mask': ", why);
    return c;
  }

  /// The forward of any schedule: the step loop (impl/step_loop.hpp) over
  /// the schedule's description (Schedule::step, blockattn/schedule/schedule.hpp),
  /// with the forward's buffers and compute (impl/forward_steps.hpp). The last
  /// compute on the own queries normalises in the kernel, unless results still
  /// arrive; then the state is normalised after the last merge.
  template <class QV, class KV, class VV, class OV, class LV>
  void run_forward(const Call& c, const BlockLayout& layout, const QV& q, const KV& k, const VV& v,
                   const OV& o, const LV& lse, const DistributedOptions& opts, RunStats& stats) {
    using Xfer = impl::Transfers<Communicator, ExecSpace>;
    Xfer x(m_comm, m_exec, fn, opts.timeout_seconds);
    const int P = m_comm.size(), rank = m_comm.rank();
    const ScheduleContext ctx = schedule_context(m_part, m_mask, c.N, P);
    std::vector<ForwardStep> desc(static_cast<std::size_t>(Schedule::steps(ctx)));
    int last_own = -1;  // the last step that computes on this rank's queries
    for (std::size_t s = 0; s < desc.size(); ++s) {
      Schedule::step(ctx, rank, int(s), desc[s]);
      if (desc[s].task.q_rank == rank) last_own = int(s);
    }
    const ForwardSlots slots = forward_slots<Schedule>(ctx, rank);
    impl::ForwardSteps<Partition, Mask, ExecSpace, Xfer, QV, OV, LV> dir(
        m_exec, x, m_part, m_mask, c, layout, P, rank, slots, q, k, v, o, lse, opts, stats);
    dir.set_plan(int(desc.size()), last_own, opts.communicate && slots.merges);
    const double tail = impl::run_step_loop(x, desc, rank, opts.communicate, dir, stats);
    const auto t0 = std::chrono::steady_clock::now();
    if (dir.finish() && !stats.steps.empty())
      stats.steps.back().seconds += tail + impl::seconds_since(t0);
  }

  /// The backward of any schedule: the same step loop over the description of
  /// its backward_type (BackwardStep), with the backward's buffers and compute
  /// (impl/backward_steps.hpp).
  template <class QV, class KV, class VV, class OV, class LV, class DOV, class DQV, class DKV,
            class DVV>
  void run_backward(const Call& c, const BlockLayout& layout, const QV& q, const KV& k, const VV& v,
                    const OV& o, const LV& lse, const DOV& dout, const DQV& dq, const DKV& dk,
                    const DVV& dv, const DistributedOptions& opts, RunStats& stats) {
    using B = typename Schedule::backward_type;
    using V = typename OV::non_const_value_type;
    using Xfer = impl::Transfers<Communicator, ExecSpace>;
    Xfer x(m_comm, m_exec, bfn, opts.timeout_seconds);
    const int P = m_comm.size(), rank = m_comm.rank();
    const ScheduleContext ctx = schedule_context(m_part, m_mask, c.N, P);
    std::vector<BackwardStep> desc(static_cast<std::size_t>(B::steps(ctx)));
    for (std::size_t s = 0; s < desc.size(); ++s) B::step(ctx, rank, int(s), desc[s]);
    impl::BackwardSteps<Partition, Mask, ExecSpace, Xfer, V, KV, VV> dir(
        m_exec, x, m_part, m_mask, c, layout, P, rank, backward_slots<B>(ctx, rank), q, k, v, o,
        lse, dout, dq, dk, dv, opts, stats);
    dir.set_plan(int(desc.size()));
    impl::run_step_loop(x, desc, rank, true, dir, stats);
    dir.finish(dq, dk, dv);
  }
};

}  // namespace blockattn
