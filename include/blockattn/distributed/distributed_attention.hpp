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
#include <blockattn/distributed/impl/accumulate.hpp>
#include <blockattn/distributed/impl/consensus.hpp>
#include <blockattn/distributed/impl/transfer.hpp>
#include <blockattn/distributed/impl/validate.hpp>
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

/// What one rank did at one step of a schedule.
struct StepStats {
  int step = 0;
  int source = 0;         // rank whose K/V block was used (Q ring: whose queries)
  int query_source = -1;  // rank whose queries were used (-1: idle step)
  bool computed = false;  // false: the whole block was masked out (no kernel)
  TileCounts tiles;       // per (batch, head); pairs only with count_pairs
  std::int64_t bytes_sent = 0;
  std::int64_t bytes_received = 0;
  double seconds = 0.0;  // wall time of the step on this rank (compute + wait)
  /// The part of `seconds` from the first launch of the step's compute to
  /// its fence (the transfers in flight are tested in between; the waits
  /// that complete them are not in it): this rank's busy time.
  double compute_seconds = 0.0;
};

/// What one rank did in one forward call.
struct RunStats {
  std::vector<StepStats> steps;
  int block_q = 0, block_k = 0;      // tile sizes used
  std::int64_t workspace_bytes = 0;  // memory the schedule allocated on this rank
  /// HybridAttention: bytes this rank sent in the all-to-alls inside its group
  /// (the steps hold the ring's across groups), and their wall time.
  std::int64_t alltoall_bytes = 0;
  double alltoall_seconds = 0.0;
  std::int64_t bytes_sent() const {
    std::int64_t b = alltoall_bytes;
    for (const auto& s : steps) b += s.bytes_sent;
    return b;
  }
  TileCounts tiles() const {
    TileCounts t;
    for (const auto& s : steps) t += s.tiles;
    return t;
  }
  double compute_seconds() const {
    double c = 0.0;
    for (const auto& s : steps) c += s.compute_seconds;
    return c;
  }
};

/// Run-time options of a distributed forward call.
struct DistributedOptions {
  double scale = std::numeric_limits<double>::quiet_NaN();  // NaN: 1 / sqrt(head_dim)
  bool count_pairs = false;  // also count allowed pairs (host cost ~ pairs of partial tiles)
  bool communicate = true;   // false: compute the same steps on the local block only
                             // (measures compute time without communication; wrong result)
  /// > 0: a transfer that has not completed after this many seconds throws
  /// blockattn::timeout_error naming the step, the peer and the message
  /// (instead of waiting forever for a rank that failed or never posts).
  double timeout_seconds = 0.0;
  /// Check the mask's classify() against allowed() on a sample of boxes of
  /// the global sequence before the work (every rank the same sample);
  /// always on with -DBLOCKATTN_CHECK_POLICIES.
  bool check_policies = false;
};

template <class Partition, class Mask, class Schedule, class Communicator,
          class ExecSpace = Kokkos::DefaultExecutionSpace>
class DistributedAttention {
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
                "(RingSchedule, BurstSchedule, BalancedSchedule; see "
                "blockattn/schedule/ring.hpp, blockattn/schedule/balanced.hpp)");
  // A complete description (one static_assert per missing member), and a
  // backward that a driver below runs: never a silent fallback.
  static_assert(!is_schedule_v<Schedule> || impl::check_schedule<Schedule>(),
                "BlockAttn: DistributedAttention: the schedule's description is incomplete");
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
  static_assert(Schedule::template supports<Partition, Mask>,
                "BlockAttn: DistributedAttention: this schedule does not support this partition "
                "and mask");

 public:
  using partition_type = Partition;
  using mask_type = Mask;
  using schedule_type = Schedule;
  using communicator_type = Communicator;
  using execution_space = ExecSpace;

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
      run_forward(c, forward_layout<T, ExecSpace>(c.e.dim), q, k, v, o, lse, opts, stats);
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
    impl::check_forward_view_types<QV, KV, VV, OV, LV>();
    static_assert(impl::backward_grad_views_ok<DOV, DQV, DKV, DVV>(),
                  "BlockAttn: dout, dq, dk and dv must be rank-4 Kokkos::Views "
                  "(batch, seq, heads, head_dim)");
    RunStats stats;
    if constexpr (impl::forward_views_ok<QV, KV, VV, OV, LV>() &&
                  impl::backward_grad_views_ok<DOV, DQV, DKV, DVV>()) {
      using V = typename OV::non_const_value_type;
      impl::check_backward_grad_types<V, DOV, DQV, DKV, DVV>();
      const Call c = validate(bfn, q, k, v, o, lse, opts, [&] {
        impl::validate_backward<ExecSpace>(bfn, q, k, v, o, lse, dout, dq, dk, dv, opts.scale,
                                           true);
      });
      using T = compute_t<V>;
      run_backward(c, backward_layout<T, ExecSpace>(c.e.dim), q, k, v, o, lse, dout, dq, dk, dv,
                   opts, stats);
    }
    return stats;
  }

 private:
  static constexpr const char* bfn = "DistributedAttention::backward";

  /// What every rank knows of a call once validate() passed: this rank's
  /// extents, the global length N (the sum of the local lengths) and every
  /// rank's local length.
  struct Call {
    BlockExtents e;
    index_type N = 0;
    std::vector<index_type> lengths;
    int most = 0;  // the longest local length: the size of every buffer that travels
    /// The extents of the block pair (queries of q_rank, keys of k_rank).
    BlockExtents task(int q_rank, int k_rank) const {
      BlockExtents t = e;
      t.queries = int(lengths[std::size_t(q_rank)]);
      t.keys = int(lengths[std::size_t(k_rank)]);
      return t;
    }
  };

  template <class T>
  using Buffer4 = Kokkos::View<T****, Kokkos::LayoutRight, typename ExecSpace::memory_space>;

  template <class T>
  void add_into(const Buffer4<T>& a, const Buffer4<T>& b) {
    impl::add_into(m_exec, a, b);
  }

  template <class V>
  static std::int64_t bytes_of(const V& v) {
    return std::int64_t(v.span()) * std::int64_t(sizeof(typename V::value_type));
  }

  /// The View that holds the unnormalised O: the caller's o, or the fp32
  /// accumulator of 16-bit storage.
  template <bool Half, class OV, class A>
  static const auto& accumulator(const OV& o, const A& acc) {
    if constexpr (Half)
      return acc;
    else
      return o;
  }

  template <class A, class B>
  static bool same_memory(const A& a, const B& b) {
    return static_cast<const void*>(a.data()) == static_cast<const void*>(b.data());
  }

  /// A buffer of x's shape, with `rows` rows (sequence extent) when >= 0.
  template <class T, class DKV>
  static Buffer4<T> buffer_like(const DKV& x, const char* label, int rows = -1) {
    return Buffer4<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)),
                      x.extent(0), rows < 0 ? x.extent(1) : std::size_t(rows), x.extent(2),
                      x.extent(3));
  }

  /// The first n rows (sequence positions) of a buffer: a block of another
  /// length lives in a buffer sized for the longest rank.
  template <class B>
  static auto rows_of(const B& b, index_type n) {
    return Kokkos::subview(b, Kokkos::ALL, Kokkos::make_pair(std::size_t(0), std::size_t(n)),
                           Kokkos::ALL, Kokkos::ALL);
  }

  /// A rank's own gradient as a LayoutRight View of the memory space: the
  /// caller's View itself when it is one (LayoutRight, contiguous, of the
  /// compute type), else a workspace buffer copied out after the loop (for
  /// bf16 / fp16 gradients: an fp32 sum over the steps, rounded once). One View type for every
  /// gradient target keeps one instantiation of the backward kernels.
  template <class T, class G>
  static Buffer4<T> own_gradient(const G& g, const char* label) {
    if constexpr (std::is_same<typename G::array_layout, Kokkos::LayoutRight>::value &&
                  std::is_same<typename G::non_const_value_type, T>::value) {
      if (g.span_is_contiguous())
        return Buffer4<T>(g.data(), g.extent(0), g.extent(1), g.extent(2), g.extent(3));
    }
    return buffer_like<T>(g, label);
  }

  /// The backward of any schedule: the step loop over the description of
  /// its backward_type (BackwardStep, blockattn/schedule/schedule.hpp). At each step
  /// it posts the step's transfers (inputs of later steps; receives of
  /// partial gradients), computes the task's gradients (dQ into the own dq
  /// or a dQ partial slot, dK, dV into the own dk, dv or a partial slot; a
  /// partial of a task without work is zeroed), completes the transfers due
  /// at this step and adds the partials that arrived where the description
  /// says, then posts the partials this step produced.
  template <class QV, class KV, class VV, class OV, class LV, class DOV, class DQV, class DKV,
            class DVV>
  void run_backward(const Call& c, const BlockLayout& layout, const QV& q, const KV& k, const VV& v,
                    const OV& o, const LV& lse, const DOV& dout, const DQV& dq, const DKV& dk,
                    const DVV& dv, const DistributedOptions& opts, RunStats& stats) {
    using B = typename Schedule::backward_type;
    // V: the storage type (what travels: K, V, Q, dO); T: the compute type
    // (the kernels, LSE, D, and the gradient partials and sums).
    using V = typename OV::non_const_value_type;
    using T = compute_t<V>;
    constexpr bool half = !std::is_same<V, T>::value;
    using mem = typename ExecSpace::memory_space;
    using request = typename impl::Transfers<Communicator, ExecSpace>::transfer_type;
    impl::Transfers<Communicator, ExecSpace> x(m_comm, m_exec, bfn, opts.timeout_seconds);
    const int P = m_comm.size(), rank = m_comm.rank();
    const BlockExtents& e = c.e;  // this rank's
    const index_type N = c.N;
    const int most = c.most;  // rows of every buffer that travels
    const T scale = impl::softmax_scale<T>(opts.scale, e.dim);
    const ScheduleContext ctx = schedule_context(m_part, m_mask, N, P);
    const int steps = B::steps(ctx);
    std::vector<BackwardStep> desc(static_cast<std::size_t>(steps));
    for (int s = 0; s < steps; ++s) B::step(ctx, rank, s, desc[std::size_t(s)]);
    const BackwardSlots slots = backward_slots<B>(ctx, rank);

    // Buffers: K/V slots (slot 0 a copy of k, v when it travels), packed
    // query slots (slot 0: ours), one packed key block, partial gradients.
    std::vector<std::array<Buffer4<V>, 2>> kv(std::size_t(slots.kv));
    for (std::size_t i = (slots.kv_copy ? 0 : 1); i < kv.size(); ++i) {
      kv[i][0] = buffer_like<V>(k, "blockattn::k_slot", most);
      kv[i][1] = buffer_like<V>(v, "blockattn::v_slot", most);
    }
    if (slots.kv_copy) {
      Kokkos::deep_copy(m_exec, rows_of(kv[0][0], e.keys), k);
      Kokkos::deep_copy(m_exec, rows_of(kv[0][1], e.keys), v);
    }
    // Query slots hold Q and dO in the storage type (what the Q ring moves);
    // with 16-bit storage the kernels read `wide`, widened from the slot in use.
    std::vector<PackedQueries<T, mem, V>> qs(std::size_t(slots.q));
    for (auto& b : qs)
      b = allocate_backward_queries<T, ExecSpace, V>(layout, e.batch, e.heads, most);
    qs[0].queries = e.queries;  // ours: the rest of the slot is zero padding
    pack_backward_queries(m_exec, q, dout, o, lse, qs[0]);
    PackedQueries<T, mem> wide;
    if constexpr (half) {
      wide = allocate_backward_queries<T, ExecSpace>(layout, e.batch, e.heads, most);
      wide.lse2 = {};
      wide.drow = {};
    }
    int widened = -1;  // the query slot whose rows `wide` holds (-1: none)
    auto keys = allocate_backward_keys<T, ExecSpace>(layout, e.batch, e.kv_heads, most);
    int packed = -1;  // the K/V slot whose block `keys` holds (-1: none)
    const auto slot_buffers = [&](int n, const auto& like, const char* label) {
      std::vector<Buffer4<T>> b(static_cast<std::size_t>(n));
      for (auto& y : b) y = buffer_like<T>(like, label, most);
      return b;
    };
    std::vector<Buffer4<T>> dq_out = slot_buffers(slots.dq_out, dq, "blockattn::dq_partial"),
                            dq_in = slot_buffers(slots.dq_in, dq, "blockattn::dq_in");
    std::vector<std::array<Buffer4<T>, 2>> dkv_out(std::size_t(slots.dkv_out)),
        dkv_in(std::size_t(slots.dkv_in));
    for (auto* list : {&dkv_out, &dkv_in})
      for (auto& y : *list) {
        y[0] = buffer_like<T>(dk, "blockattn::dk_partial", most);
        y[1] = buffer_like<T>(dv, "blockattn::dv_partial", most);
      }
    const Buffer4<T> own_dq = own_gradient<T>(dq, "blockattn::dq"),
                     own_dk = own_gradient<T>(dk, "blockattn::dk"),
                     own_dv = own_gradient<T>(dv, "blockattn::dv");
    bool dq_written = false, dkv_written = false;
    // Bytes of the (contiguous) blocks that travel: the caller's Views may be
    // strided. K, V in the storage type; their gradient partials in T.
    const std::int64_t kv_elems = 2 * std::int64_t(e.batch) * most * e.kv_heads * e.dim;
    const std::int64_t kv_bytes = kv_elems * std::int64_t(sizeof(V)),
                       dkv_bytes = kv_elems * std::int64_t(sizeof(T));
    const std::int64_t q_bytes =
        bytes_of(qs[0].q) + bytes_of(qs[0].dout) + bytes_of(qs[0].lse2) + bytes_of(qs[0].drow);
    const std::int64_t dq_bytes =
        std::int64_t(e.batch) * most * e.heads * e.dim * std::int64_t(sizeof(T));
    const std::int64_t own_dq_bytes =
        std::int64_t(e.batch) * e.queries * e.heads * e.dim * std::int64_t(sizeof(T));
    const std::int64_t own_dkv_bytes =
        2 * std::int64_t(e.batch) * e.keys * e.kv_heads * e.dim * std::int64_t(sizeof(T));
    stats.block_q = layout.block_q;
    stats.block_k = layout.block_k;
    stats.workspace_bytes = std::int64_t(kv.size() - (slots.kv_copy ? 0 : 1)) * kv_bytes +
                            std::int64_t(qs.size()) * q_bytes +
                            (half ? bytes_of(wide.q) + bytes_of(wide.dout) : 0) +
                            bytes_of(keys.kt) + bytes_of(keys.vt) + bytes_of(keys.k) +
                            std::int64_t(dq_out.size() + dq_in.size()) * dq_bytes +
                            std::int64_t(dkv_out.size() + dkv_in.size()) * dkv_bytes +
                            (same_memory(own_dq, dq) ? 0 : own_dq_bytes) +
                            (same_memory(own_dk, dk) ? 0 : own_dkv_bytes / 2) +
                            (same_memory(own_dv, dv) ? 0 : own_dkv_bytes / 2);

    struct Arrival {
      Payload what;
      int slot, add_to;
    };
    std::vector<std::vector<request>> due(static_cast<std::size_t>(steps) + 1);
    std::vector<std::vector<Arrival>> arrive(static_cast<std::size_t>(steps) + 1);
    const auto post = [&](const ScheduledTransfer& t, StepStats& st) {
      const bool send = t.src == rank;
      const int peer = send ? t.dst : t.src, slot = send ? t.src_slot : t.dst_slot;
      auto& list = due[std::size_t(t.done_step)];
      const auto go = [&](const auto& view, impl::Message m) {
        const int named = transfer_step(t);
        list.push_back(send ? x.send(view, peer, named, m) : x.receive(view, peer, named, m));
      };
      std::int64_t b = 0;
      switch (t.payload) {
        case Payload::kv:
          go(kv[std::size_t(slot)][0], impl::Message::k);
          go(kv[std::size_t(slot)][1], impl::Message::v);
          b = kv_bytes;
          break;
        case Payload::q: {
          const auto& y = qs[std::size_t(slot)];
          go(y.q, impl::Message::q);
          go(y.dout, impl::Message::dout);
          go(y.lse2, impl::Message::q_lse);
          go(y.drow, impl::Message::q_drow);
          b = q_bytes;
          break;
        }
        case Payload::dq:
          go(send ? dq_out[std::size_t(slot)] : dq_in[std::size_t(slot)], impl::Message::dq);
          b = dq_bytes;
          break;
        case Payload::dkv: {
          const auto& y = send ? dkv_out[std::size_t(slot)] : dkv_in[std::size_t(slot)];
          go(y[0], impl::Message::dk);
          go(y[1], impl::Message::dv);
          b = dkv_bytes;
          break;
        }
        case Payload::result:
          break;
      }
      if (!send) arrive[std::size_t(t.done_step)].push_back({t.payload, slot, t.add_to});
      (send ? st.bytes_sent : st.bytes_received) += b;
    };
    // Completes the transfers due at `s` and adds the partials that arrived.
    const auto complete = [&](int s) {
      for (auto& r : due[std::size_t(s)]) x.wait(r);
      for (const Arrival& a : arrive[std::size_t(s)]) {
        if (a.what == Payload::kv && a.slot == packed) packed = -1;  // a new block in the slot
        if (a.what == Payload::q && a.slot == widened) widened = -1;
        if (a.what == Payload::dq) {
          const auto& in = dq_in[std::size_t(a.slot)];
          if (a.add_to >= 0) {
            add_into<T>(dq_out[std::size_t(a.add_to)], in);
          } else {
            if (dq_written)
              impl::add_into(m_exec, own_dq, rows_of(in, e.queries));
            else
              Kokkos::deep_copy(m_exec, own_dq, rows_of(in, e.queries));
            dq_written = true;
          }
        } else if (a.what == Payload::dkv) {
          const auto& in = dkv_in[std::size_t(a.slot)];
          for (int j = 0; j < 2; ++j) {
            const Buffer4<T>& own = j == 0 ? own_dk : own_dv;
            if (a.add_to >= 0)
              add_into<T>(dkv_out[std::size_t(a.add_to)][j], in[j]);
            else if (dkv_written)
              impl::add_into(m_exec, own, rows_of(in[j], e.keys));
            else
              Kokkos::deep_copy(m_exec, own, rows_of(in[j], e.keys));
          }
          if (a.add_to < 0) dkv_written = true;
        }
      }
      m_exec.fence();
    };

    const auto pos = [&](int r) { return m_part.positions(N, P, r); };
    for (int s = 0; s < steps; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      const BackwardStep& f = desc[std::size_t(s)];
      const BlockTask task = f.task;
      StepStats st;
      for (const auto& t : f.transfers)  // inputs of later steps; receives of partials
        if (!t.after_compute || t.dst == rank) post(t, st);
      st.computed = !task.idle() && !block_is_empty(m_part, m_mask, N, P, task.q_rank, task.k_rank);
      const auto c0 = std::chrono::steady_clock::now();
      const Buffer4<T> dqt = f.dq_slot >= 0 ? dq_out[std::size_t(f.dq_slot)] : own_dq;
      const Buffer4<T> dkt = f.dkv_slot >= 0 ? dkv_out[std::size_t(f.dkv_slot)][0] : own_dk;
      const Buffer4<T> dvt = f.dkv_slot >= 0 ? dkv_out[std::size_t(f.dkv_slot)][1] : own_dv;
      if (st.computed) {
        if (packed != f.kv_slot) {
          keys.keys = int(c.lengths[std::size_t(task.k_rank)]);
          if (f.kv_slot == 0 && !slots.kv_copy)
            pack_backward_keys(m_exec, k, v, keys);
          else
            pack_backward_keys(m_exec, kv[std::size_t(f.kv_slot)][0], kv[std::size_t(f.kv_slot)][1],
                               keys);
          packed = f.kv_slot;
        }
        BackwardBlockOptions blk;
        blk.accumulate_dq = f.dq_slot < 0 && dq_written;
        blk.accumulate_dkv = f.dkv_slot < 0 && dkv_written;
        const PackedQueries<T, mem>* rows = nullptr;
        if constexpr (half) {
          if (widened != f.q_slot) widen_backward_queries(m_exec, qs[std::size_t(f.q_slot)], wide);
          widened = f.q_slot;
          rows = &wide;
        } else {
          rows = &qs[std::size_t(f.q_slot)];
        }
        backward_block(m_exec, c.task(task.q_rank, task.k_rank), *rows, keys, dqt, dkt, dvt, m_mask,
                       pos(task.q_rank), pos(task.k_rank), scale, blk);
        dq_written = dq_written || f.dq_slot < 0;
        dkv_written = dkv_written || f.dkv_slot < 0;
      } else if (!task.idle()) {
        if (f.dq_slot >= 0) Kokkos::deep_copy(m_exec, dqt, T(0));
        if (f.dkv_slot >= 0) {
          Kokkos::deep_copy(m_exec, dkt, T(0));
          Kokkos::deep_copy(m_exec, dvt, T(0));
        }
      }
      for (auto& r : due[std::size_t(s)]) x.test(r);
      m_exec.fence();
      st.compute_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
      complete(s);
      for (const auto& t : f.transfers)  // the partials of this step
        if (t.after_compute && t.src == rank) post(t, st);
      st.step = s;
      st.source = task.k_rank;
      st.query_source = task.q_rank;
      st.tiles =
          task_work(m_part, m_mask, N, P, task, layout.block_q, layout.block_k, opts.count_pairs);
      st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      stats.steps.push_back(st);
    }
    complete(steps);
    if (!dq_written) Kokkos::deep_copy(m_exec, own_dq, T(0));
    if (!dkv_written) {
      Kokkos::deep_copy(m_exec, own_dk, T(0));
      Kokkos::deep_copy(m_exec, own_dv, T(0));
    }
    // The caller's gradients from the sums: copied, or rounded once to 16 bits.
    const auto out = [&](const auto& target, const Buffer4<T>& sum) {
      if (same_memory(sum, target)) return;
      if constexpr (half)
        impl::convert_into(m_exec, target, sum);
      else
        Kokkos::deep_copy(m_exec, target, sum);
    };
    out(dq, own_dq);
    out(dk, own_dk);
    out(dv, own_dv);
    m_exec.fence();
  }
  Communicator m_comm;
  Partition m_part;
  Mask m_mask;
  ExecSpace m_exec;
  static constexpr const char* fn = "DistributedAttention::forward";
  static constexpr int progress_chunks = 8;  // compute launches per step with a transfer in flight

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

  template <class T>
  using LseBuffer = Kokkos::View<T***, Kokkos::LayoutRight, typename ExecSpace::memory_space>;

  /// The forward of any schedule: the step loop. The schedule's description
  /// (Schedule::step, blockattn/schedule/schedule.hpp) says, for this rank and each
  /// step, which block pair to compute from which buffers and which
  /// transfers to post; the loop allocates the buffers the description
  /// names (forward_slots), and at each step
  ///   posts the step's transfers (inputs of later steps) on the instance,
  ///   computes its task in chunks of query tiles, testing the transfers in
  ///     flight between chunks (MPI moves large messages only inside MPI
  ///     calls): its own queries resume the softmax state, another rank's
  ///     queries (a helper's task) start a fresh state whose normalised
  ///     result is posted to that rank after the compute,
  ///   completes the transfers due at this step and merges the results that
  ///     arrived into the state (SoftmaxState::merge_partial),
  ///   accounts the step (tiles, bytes, time) in RunStats.
  /// The last compute on the own queries normalises in the kernel, unless
  /// results still arrive, then SoftmaxState::finalize does after the merge.
  /// Without communication (opts.communicate = false) every remote buffer is
  /// the local one: the same steps and work, no transfers, a wrong result.
  template <class QV, class KV, class VV, class OV, class LV>
  void run_forward(const Call& c, const BlockLayout& layout, const QV& q, const KV& k, const VV& v,
                   const OV& o, const LV& lse, const DistributedOptions& opts, RunStats& stats) {
    // V: the storage type (what travels: K, V, Q); T: the compute type (the
    // kernels, the softmax state, the unnormalised O, partial results).
    using V = typename OV::non_const_value_type;
    using T = compute_t<V>;
    constexpr bool half = !std::is_same<V, T>::value;
    using mem = typename ExecSpace::memory_space;
    using request = typename impl::Transfers<Communicator, ExecSpace>::transfer_type;
    impl::Transfers<Communicator, ExecSpace> x(m_comm, m_exec, fn, opts.timeout_seconds);
    const int P = m_comm.size(), rank = m_comm.rank();
    const BlockExtents& e = c.e;  // this rank's
    const index_type N = c.N;
    const int most = c.most;  // rows of every buffer that travels
    const T scale = impl::softmax_scale<T>(opts.scale, e.dim);
    const bool comm = opts.communicate;
    const ScheduleContext ctx = schedule_context(m_part, m_mask, N, P);
    const int steps = Schedule::steps(ctx);
    std::vector<ForwardStep> desc(static_cast<std::size_t>(steps));
    int last_own = -1;  // the last step that computes on this rank's queries
    for (int s = 0; s < steps; ++s) {
      Schedule::step(ctx, rank, s, desc[std::size_t(s)]);
      if (desc[std::size_t(s)].task.q_rank == rank) last_own = s;
    }
    const ForwardSlots slots = forward_slots<Schedule>(ctx, rank);
    const bool merges = comm && slots.merges;

    // Buffers: the packed K/V slots (slot 0: own) in the storage type, query
    // copies, results (fp32 for 16-bit storage). With 16-bit storage the
    // kernels read `wide`, the slot in use widened to T.
    std::vector<PackedKV<V, mem>> kv(std::size_t(slots.kv));
    for (auto& b : kv) b = allocate_forward_block<V, ExecSpace>(layout, e.batch, e.kv_heads, most);
    kv[0].keys = e.keys;  // ours: the rest of the slot is zero padding
    pack_forward_block(m_exec, k, v, kv[0]);
    PackedKV<T, mem> wide;
    if constexpr (half)
      wide = allocate_forward_block<T, ExecSpace>(layout, e.batch, e.kv_heads, most);
    int widened = -1;  // the K/V slot whose block `wide` holds (-1: none)
    std::vector<Buffer4<V>> qs(std::size_t(slots.q));
    std::vector<Buffer4<T>> rout(std::size_t(slots.results_in)),
        hout(std::size_t(slots.results_out));
    std::vector<LseBuffer<T>> rlse(rout.size()), hlse(hout.size());
    for (std::size_t i = 1; i < qs.size(); ++i) qs[i] = buffer_like<V>(q, "blockattn::q_in", most);
    if (slots.q_copy) {
      qs[0] = buffer_like<V>(q, "blockattn::q_copy", most);
      Kokkos::deep_copy(m_exec, rows_of(qs[0], e.queries), q);
    }
    const auto lse_buffer = [&](const char* label) {
      return LseBuffer<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)),
                          e.batch, e.heads, most);
    };
    for (std::size_t i = 0; i < hout.size(); ++i) {
      hout[i] = buffer_like<T>(o, "blockattn::result_out", most);
      hlse[i] = lse_buffer("blockattn::result_out_lse");
    }
    for (std::size_t i = 0; i < rout.size(); ++i) {
      rout[i] = buffer_like<T>(o, "blockattn::result_in", most);
      rlse[i] = lse_buffer("blockattn::result_in_lse");
    }
    ForwardBlockState<T, mem> state;
    // Rows of the longest rank: a helper's task on another rank's queries uses it too.
    state.state = SoftmaxState<T, mem>(e.batch, e.heads, most, "blockattn::forward");
    // 16-bit o: the unnormalised O between steps lives in an fp32 accumulator.
    Buffer4<T> acc;
    if constexpr (half) {
      acc = buffer_like<T>(o, "blockattn::o_accumulator");
      state.o_acc = acc;
    }
    const std::int64_t kv_bytes = bytes_of(kv[0].kt) + bytes_of(kv[0].v);
    const std::int64_t q_elems = std::int64_t(e.batch) * most * e.heads * e.dim;
    const std::int64_t q_bytes = q_elems * std::int64_t(sizeof(V));
    const std::int64_t res_bytes =
        (q_elems + std::int64_t(e.batch) * e.heads * most) * std::int64_t(sizeof(T));
    stats.block_q = layout.block_q;
    stats.block_k = layout.block_k;
    stats.workspace_bytes = slots.kv * kv_bytes + state.state.bytes() +
                            (slots.q - 1 + (slots.q_copy ? 1 : 0)) * q_bytes +
                            std::int64_t(hout.size() + rout.size()) * res_bytes +
                            (half ? bytes_of(wide.kt) + bytes_of(wide.v) + bytes_of(acc) : 0);

    // A transfer of the description, posted: the buffer of its payload and slot.
    std::vector<std::vector<request>> due(static_cast<std::size_t>(steps) + 1);   // by done_step
    std::vector<std::vector<int>> merge_at(static_cast<std::size_t>(steps) + 1);  // result-in slots
    const auto post = [&](const ScheduledTransfer& t, StepStats& st) {
      const bool send = t.src == rank;
      const int peer = send ? t.dst : t.src, slot = send ? t.src_slot : t.dst_slot;
      auto& list = due[std::size_t(t.done_step)];
      const auto go = [&](const auto& view, impl::Message m) {
        const int named = transfer_step(t);
        list.push_back(send ? x.send(view, peer, named, m) : x.receive(view, peer, named, m));
      };
      if (t.payload == Payload::kv) {
        if (!send && slot == widened) widened = -1;  // a new block in the slot
        go(kv[std::size_t(slot)].kt, impl::Message::k);
        go(kv[std::size_t(slot)].v, impl::Message::v);
      } else if (t.payload == Payload::q) {
        go(qs[std::size_t(slot)], impl::Message::q);
      } else {
        go(send ? hout[std::size_t(slot)] : rout[std::size_t(slot)], impl::Message::o);
        go(send ? hlse[std::size_t(slot)] : rlse[std::size_t(slot)], impl::Message::o_lse);
        if (!send) merge_at[std::size_t(t.done_step)].push_back(slot);
      }
      const std::int64_t b = t.payload == Payload::kv  ? kv_bytes
                             : t.payload == Payload::q ? q_bytes
                                                       : res_bytes;
      (send ? st.bytes_sent : st.bytes_received) += b;
    };

    const auto pos = [&](int r) { return m_part.positions(N, P, r); };
    bool opened = false;  // the own queries' state holds keys or was initialised
    const auto& o_sum = accumulator<half>(o, acc);  // where the unnormalised O lives
    const auto open_state = [&] {
      if (!opened) state.state.init(m_exec, o_sum, e.dim);
      opened = true;
    };
    for (int s = 0; s < steps; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      const ForwardStep& f = desc[std::size_t(s)];
      const BlockTask task = f.task;
      StepStats st;
      if (comm)  // inputs of later steps, and receives of results (posted early)
        for (const auto& t : f.transfers)
          if (!t.after_compute || t.dst == rank) post(t, st);
      std::vector<request*> in_flight;  // tested between compute chunks
      for (std::size_t d = std::size_t(s); d < due.size(); ++d)
        for (auto& r : due[d]) in_flight.push_back(&r);
      const auto c0 = std::chrono::steady_clock::now();
      st.computed = !task.idle() && !block_is_empty(m_part, m_mask, N, P, task.q_rank, task.k_rank);
      const int kv_slot = comm ? f.kv_slot : 0;
      const PackedKV<T, mem>* kp = nullptr;
      if constexpr (half) {
        if (st.computed && widened != kv_slot) {
          widen_forward_block(m_exec, kv[std::size_t(kv_slot)], wide);
          widened = kv_slot;
        }
        kp = &wide;
      } else {
        kp = &kv[std::size_t(kv_slot)];
      }
      const auto& keys = *kp;
      // The block pair's extents; without communication the queries are ours.
      BlockExtents te = task.idle() ? e : c.task(task.q_rank, task.k_rank);
      if (!comm && te.queries > e.queries) te.queries = e.queries;
      if (task.q_rank == rank) {
        const bool finish = s == last_own && !merges;
        if (st.computed || finish) {
          ForwardBlockState<T, mem> b = state;
          b.resume = opened;
          b.finish = finish;
          b.skip_keys = !st.computed;
          launch_chunked(layout, x, te, q, keys, o, lse, pos(rank), pos(task.k_rank), scale, b,
                         in_flight);
          opened = true;
        }
      } else if (!task.idle()) {
        // A helper's task: fresh state, normalised result to its slot.
        ForwardBlockState<T, mem> b = state;
        b.resume = false;
        b.finish = true;
        b.skip_keys = !st.computed;
        b.o_acc = {};  // a fresh, finished result: no accumulator
        const std::size_t out = std::size_t(f.result_slot);
        if (comm)
          launch_chunked(layout, x, te, qs[std::size_t(f.q_slot)], keys, hout[out], hlse[out],
                         pos(task.q_rank), pos(task.k_rank), scale, b, in_flight);
        else
          launch_chunked(layout, x, te, q, keys, hout[out], hlse[out], pos(task.q_rank),
                         pos(task.k_rank), scale, b, in_flight);
      }
      m_exec.fence();
      st.compute_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
      if (comm)  // results computed at this step, to the rank whose queries they are
        for (const auto& t : f.transfers)
          if (t.after_compute && t.src == rank) post(t, st);
      // Complete what is due at this step; merge the results that arrived.
      for (auto& r : due[std::size_t(s)]) x.wait(r);
      if (!merge_at[std::size_t(s)].empty()) {
        open_state();
        for (const int i : merge_at[std::size_t(s)])
          state.state.merge_partial(m_exec, o_sum, rout[std::size_t(i)], rlse[std::size_t(i)],
                                    e.dim);
        m_exec.fence();
      }
      st.step = s;
      st.source = task.k_rank;
      st.query_source = task.q_rank;
      st.tiles =
          task_work(m_part, m_mask, N, P, task, layout.block_q, layout.block_k, opts.count_pairs);
      st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      stats.steps.push_back(st);
    }
    if (merges) {
      // Results due after the last step, then the normalisation.
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& r : due[std::size_t(steps)]) x.wait(r);
      open_state();
      for (const int i : merge_at[std::size_t(steps)])
        state.state.merge_partial(m_exec, o_sum, rout[std::size_t(i)], rlse[std::size_t(i)], e.dim);
      state.state.finalize(m_exec, o_sum, o, lse, e.dim);
      m_exec.fence();
      stats.steps.back().seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } else {
      for (auto& r : due[std::size_t(steps)]) x.wait(r);
    }
  }

  /// Compute launches of one step in chunks of query tiles, testing the
  /// transfers in flight between them (see run_forward).
  template <class QV, class OV, class LV, class Pos, class T, class Reqs, class Xfer>
  void launch_chunked(const BlockLayout& layout, Xfer& x, const BlockExtents& e, const QV& q,
                      const PackedKV<T, typename ExecSpace::memory_space>& kv, const OV& o,
                      const LV& lse, const Pos& qpos, const Pos& kpos, T scale,
                      ForwardBlockState<T, typename ExecSpace::memory_space> state, Reqs& reqs) {
    const int league = layout.forward_league(e);
    const int chunks = reqs.empty() ? 1 : (league < progress_chunks ? league : progress_chunks);
    for (int c = 0; c < chunks; ++c) {
      state.league_begin = int(std::int64_t(league) * c / chunks);
      state.league_end = int(std::int64_t(league) * (c + 1) / chunks);
      forward_block(m_exec, e, q, kv, o, lse, m_mask, qpos, kpos, scale, state);
      if (!reqs.empty()) {
        m_exec.fence();
        for (auto* r : reqs) x.test(*r);
      }
    }
  }
};

}  // namespace blockattn
