// SPDX-License-Identifier: Apache-2.0
// Distributed attention over one sequence split across the ranks of a
// communicator: partition x mask x schedule x communicator x execution space,
// chosen at compile time.
//
//   blockattn::DistributedAttention<blockattn::StripedPartition, blockattn::CausalMask,
//                                   blockattn::RingSchedule, blockattn::MpiCommunicator<>,
//                                   Kokkos::OpenMP> attn(comm);
//   auto stats = attn.forward(q, k, v, o, lse);   // local Views: N / P tokens each
#pragma once

#include <blockattn/attention_backward.hpp>
#include <blockattn/attention_forward.hpp>
#include <blockattn/balanced_schedule.hpp>
#include <blockattn/communicator.hpp>
#include <blockattn/config.hpp>
#include <blockattn/errors.hpp>
#include <blockattn/impl/consensus.hpp>
#include <blockattn/impl/merge.hpp>
#include <blockattn/impl/transfer.hpp>
#include <blockattn/mask.hpp>
#include <blockattn/partition.hpp>
#include <blockattn/ring_schedule.hpp>
#include <blockattn/tile_shape.hpp>
#include <blockattn/work.hpp>

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
};

/// What one rank did in one forward call.
struct RunStats {
  std::vector<StepStats> steps;
  int block_q = 0, block_k = 0;      // tile sizes used
  std::int64_t workspace_bytes = 0;  // memory the schedule allocated on this rank
  std::int64_t bytes_sent() const {
    std::int64_t b = 0;
    for (const auto& s : steps) b += s.bytes_sent;
    return b;
  }
  TileCounts tiles() const {
    TileCounts t;
    for (const auto& s : steps) t += s.tiles;
    return t;
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
                "blockattn/partition.hpp)");
  static_assert(is_mask_policy_v<Mask>,
                "BlockAttn: DistributedAttention: the second parameter must be a mask policy "
                "(FullMask, CausalMask, SlidingWindowMask, or your own; see blockattn/mask.hpp)");
  static_assert(is_schedule_v<Schedule>,
                "BlockAttn: DistributedAttention: the third parameter must be a schedule "
                "(RingSchedule, BurstSchedule, BalancedSchedule; see "
                "blockattn/ring_schedule.hpp, blockattn/balanced_schedule.hpp)");
  // Every schedule must have a driver below; a schedule type that merely looks
  // like one must not fall back to another schedule's driver.
  static_assert(!is_schedule_v<Schedule> || impl::is_kv_ring_forward<Schedule>::value ||
                    std::is_same<Schedule, BalancedSchedule>::value,
                "BlockAttn: DistributedAttention: no driver runs this schedule: the drivers "
                "are the KV ring (RingSchedule, BurstSchedule) and BalancedSchedule");
  static_assert(is_communicator_v<Communicator>,
                "BlockAttn: DistributedAttention: the fourth parameter must be a communicator "
                "(MpiCommunicator<>, SelfCommunicator; see blockattn/communicator.hpp)");
  static_assert(!std::is_same<Schedule, BalancedSchedule>::value ||
                    std::is_same<Partition, ContiguousPartition>::value,
                "BlockAttn: BalancedSchedule (DistFlashAttn) balances the causal work of a "
                "ContiguousPartition; striped and zigzag partitions are balanced by their layout: "
                "use RingSchedule or BurstSchedule with them");
  static_assert(!std::is_same<Schedule, BalancedSchedule>::value ||
                    !std::is_same<Mask, FullMask>::value,
                "BlockAttn: BalancedSchedule needs a causal mask (no block attends to a later "
                "block); with FullMask every rank has the same work: use RingSchedule");
  static_assert(Schedule::template supports<Partition, Mask>,
                "BlockAttn: DistributedAttention: this schedule does not support this partition "
                "and mask");

 public:
  using partition_type = Partition;
  using mask_type = Mask;
  using schedule_type = Schedule;
  using communicator_type = Communicator;
  using execution_space = ExecSpace;

  explicit DistributedAttention(Communicator comm, const Mask& mask = {},
                                const ExecSpace& exec = {})
      : m_comm(std::move(comm)), m_mask(mask), m_exec(exec) {}

  Communicator& communicator() { return m_comm; }
  const Mask& mask() const { return m_mask; }

  /// O and LSE of this rank's queries. q, k, v, o, lse are this rank's local
  /// Views, in the partition's local order (see to_local()): N / P tokens each,
  /// same shapes as attention_forward. Collective: every rank of the
  /// communicator calls it; bad arguments on any rank throw on every rank.
  template <class QV, class KV, class VV, class OV, class LV>
  RunStats forward(const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                   const DistributedOptions& opts = {}) {
    impl::check_forward_view_types<QV, KV, VV, OV, LV>();
    if constexpr (impl::forward_views_ok<QV, KV, VV, OV, LV>()) {
      const impl::ForwardExtents e = validate(fn, q, k, v, o, lse, opts);
      using T = typename OV::non_const_value_type;
      using Shape = DefaultTileShape<T, impl::is_host_space_v<ExecSpace>>;
      RunStats stats;
      impl::with_shape_for<Shape>(e.dim, [&](auto static_d, auto shape) {
        if constexpr (std::is_same<Schedule, BalancedSchedule>::value)
          run_balanced<decltype(static_d)::value, decltype(shape)>(e, q, k, v, o, lse, opts, stats);
        else if constexpr (impl::is_kv_ring_forward<Schedule>::value)
          run_kv_ring_forward<decltype(static_d)::value, decltype(shape)>(e, q, k, v, o, lse, opts,
                                                                          stats);
      });
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
      const impl::ForwardExtents e = validate(bfn, q, k, v, o, lse, opts, [&] {
        impl::validate_backward<ExecSpace>(bfn, q, k, v, o, lse, dout, dq, dk, dv, opts.scale);
      });
      using T = typename OV::non_const_value_type;
      using Shape = BackwardTileShape<T, impl::is_host_space_v<ExecSpace>>;
      impl::with_shape_for<Shape>(e.dim, [&](auto static_d, auto shape) {
        constexpr int SD = decltype(static_d)::value;
        using S = decltype(shape);
        if constexpr (std::is_same<typename Schedule::backward_type, KVRingBackward>::value)
          run_backward_kv<SD, S>(e, q, k, v, o, lse, dout, dq, dk, dv, opts, stats);
        else if constexpr (std::is_same<typename Schedule::backward_type, BalancedBackward>::value)
          run_backward_balanced<SD, S>(e, q, k, v, o, lse, dout, dq, dk, dv, opts, stats);
        else if constexpr (std::is_same<typename Schedule::backward_type, QRingBackward>::value)
          run_backward_q<SD, S>(e, q, k, v, o, lse, dout, dq, dk, dv, opts, stats);
      });
    }
    return stats;
  }

 private:
  static constexpr const char* bfn = "DistributedAttention::backward";

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

  template <class T, class DKV>
  static Buffer4<T> buffer_like(const DKV& x, const char* label) {
    return Buffer4<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)),
                      x.extent(0), x.extent(1), x.extent(2), x.extent(3));
  }

  /// KV ring backward. Step s on rank r holds K, V of rank src = r - s and the
  /// partial dK, dV of src's keys summed by the ranks before it; adds its own
  /// contribution and passes the partial on. K, V of the next step are posted
  /// before the compute; the partial from the predecessor arrives during it
  /// (each step computes into a fresh buffer and adds the incoming partial
  /// afterwards). After P steps the complete dK, dV travel one hop home.
  template <int SD, class Shape, class QV, class KV, class VV, class OV, class LV, class DOV,
            class DQV, class DKV, class DVV>
  void run_backward_kv(const impl::ForwardExtents& e, const QV& q, const KV& k, const VV& v,
                       const OV& o, const LV& lse, const DOV& dout, const DQV& dq, const DKV& dk,
                       const DVV& dv, const DistributedOptions& opts, RunStats& stats) {
    using T = typename OV::non_const_value_type;
    using mem = typename ExecSpace::memory_space;
    const int P = m_comm.size(), rank = m_comm.rank();
    const index_type N = index_type(e.queries) * P;
    const T scale = impl::softmax_scale<T>(opts.scale, e.dim);
    const int dp = impl::padded_head_dim<Shape, SD>(e.dim);
    auto queries =
        impl::allocate_packed_queries<T, mem>(e.batch, e.heads, e.queries, dp, Shape::block_q);
    impl::pack_queries(m_exec, q, dout, o, lse, queries);
    auto keys = impl::allocate_packed_keys<T, mem>(e.batch, e.kv_heads, e.keys, dp, Shape::block_k);
    Buffer4<T> kv[2][2], acc[2][2], inc[2];
    for (int i = 0; i < 2; ++i) {
      kv[i][0] = buffer_like<T>(k, "blockattn::ring_k");
      kv[i][1] = buffer_like<T>(v, "blockattn::ring_v");
      acc[i][0] = buffer_like<T>(dk, "blockattn::ring_dk");
      acc[i][1] = buffer_like<T>(dv, "blockattn::ring_dv");
      inc[i] = buffer_like<T>(i == 0 ? dk : dv, "blockattn::ring_dkv_in");
    }
    Kokkos::deep_copy(m_exec, kv[0][0], k);
    Kokkos::deep_copy(m_exec, kv[0][1], v);
    stats.block_q = Shape::block_q;
    stats.block_k = Shape::block_k;
    stats.workspace_bytes = 2 * (bytes_of(queries.q) + bytes_of(queries.lse2)) + bytes_of(keys.kt) +
                            bytes_of(keys.vt) + bytes_of(keys.k) + 4 * bytes_of(kv[0][0]) +
                            6 * bytes_of(acc[0][0]);
    const auto qpos = Partition::positions(N, P, rank);
    impl::Transfers<Communicator, ExecSpace> x(m_comm, m_exec, bfn, opts.timeout_seconds);
    using request = typename impl::Transfers<Communicator, ExecSpace>::transfer_type;
    const impl::Message kv_msg[2] = {impl::Message::k, impl::Message::v};
    const impl::Message dkv_msg[2] = {impl::Message::dk, impl::Message::dv};
    std::vector<request> pending_send[2];
    bool dq_written = false;
    int cur = 0;
    for (int s = 0; s < P; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      const int src = ring_source(rank, s, P);
      const bool more = s + 1 < P;
      StepStats st;
      std::vector<request> kv_reqs, in_reqs;
      if (more) {
        for (int t = 0; t < 2; ++t) {
          kv_reqs.push_back(x.receive(kv[1 - cur][t], ring_prev(m_comm), s + 1, kv_msg[t]));
          kv_reqs.push_back(x.send(kv[cur][t], ring_next(m_comm), s + 1, kv_msg[t]));
          st.bytes_sent += bytes_of(kv[cur][t]);
        }
      }
      if (s > 0)
        for (int t = 0; t < 2; ++t)
          in_reqs.push_back(x.receive(inc[t], ring_prev(m_comm), s, dkv_msg[t]));
      auto& a = acc[s % 2];
      for (auto& r : pending_send[s % 2]) x.wait(r);  // a was sent two steps ago
      pending_send[s % 2].clear();
      st.computed = !block_is_empty<Partition>(m_mask, N, P, rank, src);
      if (st.computed) {
        impl::pack_keys(m_exec, kv[cur][0], kv[cur][1], keys);
        impl::BackwardBlock blk;
        blk.accumulate_dq = dq_written;
        blk.accumulate_dkv = false;
        impl::launch_backward<ExecSpace, T, SD, Shape>(m_exec, e, queries, keys, dq, a[0], a[1],
                                                       m_mask, qpos,
                                                       Partition::positions(N, P, src), scale, blk);
        dq_written = true;
      } else {
        Kokkos::deep_copy(m_exec, a[0], T(0));
        Kokkos::deep_copy(m_exec, a[1], T(0));
      }
      for (auto& r : kv_reqs) x.test(r);
      m_exec.fence();
      for (auto& r : in_reqs) x.wait(r);
      if (s > 0) {
        add_into<T>(a[0], inc[0]);
        add_into<T>(a[1], inc[1]);
        m_exec.fence();
      }
      // Pass the partial on; after the last step it is complete and goes home.
      for (int t = 0; t < 2; ++t) {
        pending_send[s % 2].push_back(x.send(a[t], ring_next(m_comm), s + 1, dkv_msg[t]));
        st.bytes_sent += bytes_of(a[t]);
      }
      if (!more) {
        std::vector<request> home;
        for (int t = 0; t < 2; ++t)
          home.push_back(x.receive(inc[t], ring_prev(m_comm), P, dkv_msg[t]));
        for (auto& r : home) x.wait(r);
        Kokkos::deep_copy(m_exec, dk, inc[0]);
        Kokkos::deep_copy(m_exec, dv, inc[1]);
      }
      for (auto& r : kv_reqs) x.wait(r);
      st.step = s;
      st.source = src;
      st.query_source = rank;
      st.tiles = ring_step_work<Partition>(m_mask, N, P, rank, s, Shape::block_q, Shape::block_k,
                                           opts.count_pairs);
      st.bytes_received = st.bytes_sent;
      st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      stats.steps.push_back(st);
      if (more) cur = 1 - cur;
    }
    for (auto& v2 : pending_send)
      for (auto& r : v2) x.wait(r);
    if (!dq_written) Kokkos::deep_copy(m_exec, dq, T(0));
    m_exec.fence();
  }

  /// Q ring backward (BurstAttention's GAO): step s on rank r holds the packed
  /// Q, dO, LSE, D of rank src = r - s and the partial dQ of src's queries;
  /// it accumulates its own dK, dV (they never move) and passes dQ on, which
  /// after P steps travels one hop home.
  template <int SD, class Shape, class QV, class KV, class VV, class OV, class LV, class DOV,
            class DQV, class DKV, class DVV>
  void run_backward_q(const impl::ForwardExtents& e, const QV& q, const KV& k, const VV& v,
                      const OV& o, const LV& lse, const DOV& dout, const DQV& dq, const DKV& dk,
                      const DVV& dv, const DistributedOptions& opts, RunStats& stats) {
    using T = typename OV::non_const_value_type;
    using mem = typename ExecSpace::memory_space;
    const int P = m_comm.size(), rank = m_comm.rank();
    const index_type N = index_type(e.queries) * P;
    const T scale = impl::softmax_scale<T>(opts.scale, e.dim);
    const int dp = impl::padded_head_dim<Shape, SD>(e.dim);
    auto keys = impl::allocate_packed_keys<T, mem>(e.batch, e.kv_heads, e.keys, dp, Shape::block_k);
    impl::pack_keys(m_exec, k, v, keys);
    impl::PackedQueries<T, mem> qb[2] = {
        impl::allocate_packed_queries<T, mem>(e.batch, e.heads, e.queries, dp, Shape::block_q),
        impl::allocate_packed_queries<T, mem>(e.batch, e.heads, e.queries, dp, Shape::block_q)};
    impl::pack_queries(m_exec, q, dout, o, lse, qb[0]);
    Buffer4<T> acc[2] = {buffer_like<T>(dq, "blockattn::ring_dq"),
                         buffer_like<T>(dq, "blockattn::ring_dq")};
    Buffer4<T> inc = buffer_like<T>(dq, "blockattn::ring_dq_in");
    stats.block_q = Shape::block_q;
    stats.block_k = Shape::block_k;
    stats.workspace_bytes = bytes_of(keys.kt) + bytes_of(keys.vt) + bytes_of(keys.k) +
                            4 * (bytes_of(qb[0].q) + bytes_of(qb[0].lse2)) + 3 * bytes_of(inc);
    const auto kpos = Partition::positions(N, P, rank);
    impl::Transfers<Communicator, ExecSpace> x(m_comm, m_exec, bfn, opts.timeout_seconds);
    using request = typename impl::Transfers<Communicator, ExecSpace>::transfer_type;
    std::vector<request> pending_send[2];
    bool dkv_written = false;
    int cur = 0;
    for (int s = 0; s < P; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      const int src = ring_source(rank, s, P);
      const bool more = s + 1 < P;
      StepStats st;
      std::vector<request> q_reqs, in_reqs;
      if (more) {
        auto post = [&](const auto& next_view, const auto& cur_view, impl::Message m) {
          q_reqs.push_back(x.receive(next_view, ring_prev(m_comm), s + 1, m));
          q_reqs.push_back(x.send(cur_view, ring_next(m_comm), s + 1, m));
          st.bytes_sent += bytes_of(cur_view);
        };
        post(qb[1 - cur].q, qb[cur].q, impl::Message::q);
        post(qb[1 - cur].dout, qb[cur].dout, impl::Message::dout);
        post(qb[1 - cur].lse2, qb[cur].lse2, impl::Message::q_lse);
        post(qb[1 - cur].drow, qb[cur].drow, impl::Message::q_drow);
      }
      if (s > 0) in_reqs.push_back(x.receive(inc, ring_prev(m_comm), s, impl::Message::dq));
      auto& a = acc[s % 2];
      for (auto& r : pending_send[s % 2]) x.wait(r);
      pending_send[s % 2].clear();
      st.computed = !block_is_empty<Partition>(m_mask, N, P, src, rank);
      if (st.computed) {
        impl::BackwardBlock blk;
        blk.accumulate_dq = false;
        blk.accumulate_dkv = dkv_written;
        impl::launch_backward<ExecSpace, T, SD, Shape>(m_exec, e, qb[cur], keys, a, dk, dv, m_mask,
                                                       Partition::positions(N, P, src), kpos, scale,
                                                       blk);
        dkv_written = true;
      } else {
        Kokkos::deep_copy(m_exec, a, T(0));
      }
      for (auto& r : q_reqs) x.test(r);
      m_exec.fence();
      for (auto& r : in_reqs) x.wait(r);
      if (s > 0) {
        add_into<T>(a, inc);
        m_exec.fence();
      }
      pending_send[s % 2].push_back(x.send(a, ring_next(m_comm), s + 1, impl::Message::dq));
      st.bytes_sent += bytes_of(a);
      if (!more) {
        auto home = x.receive(inc, ring_prev(m_comm), P, impl::Message::dq);
        x.wait(home);
        Kokkos::deep_copy(m_exec, dq, inc);
      }
      for (auto& r : q_reqs) x.wait(r);
      st.step = s;
      st.source = src;
      st.query_source = src;
      st.tiles = count_tiles(m_mask, e.queries, e.keys, Shape::block_q, Shape::block_k,
                             Partition::positions(N, P, src), kpos, opts.count_pairs);
      st.bytes_received = st.bytes_sent;
      st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      stats.steps.push_back(st);
      if (more) cur = 1 - cur;
    }
    for (auto& v2 : pending_send)
      for (auto& r : v2) x.wait(r);
    if (!dkv_written) {
      Kokkos::deep_copy(m_exec, dk, T(0));
      Kokkos::deep_copy(m_exec, dv, T(0));
    }
    m_exec.fence();
  }

  Communicator m_comm;
  Mask m_mask;
  ExecSpace m_exec;
  static constexpr const char* fn = "DistributedAttention::forward";
  static constexpr int progress_chunks = 8;  // compute launches per step with a transfer in flight

  /// The checks of one collective call, then the consensus step: each rank
  /// checks its own arguments, then ONE allreduce tells every rank whether any
  /// rank failed and whether all ranks are about to run the same configuration
  /// (impl/consensus.hpp). A failure or a mismatch throws the same error on
  /// every rank before any transfer is posted.
  template <class QV, class KV, class VV, class OV, class LV, class Extra = void (*)()>
  impl::ForwardExtents validate(
      const char* name, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
      const DistributedOptions& opts, Extra extra = [] {}) {
    using T = typename OV::non_const_value_type;
    std::string error;
    impl::ForwardExtents e;
    try {
      e = impl::validate_forward<ExecSpace>(name, q, k, v, o, lse, opts.scale);
      if (k.extent(1) != q.extent(1))
        impl::fail(name, "argument 'k' has extent(1) (seq) = ", k.extent(1), ", expected ",
                   q.extent(1),
                   " (the local length of q: each rank holds N / P tokens of q, k, v)");
      extra();
    } catch (const invalid_argument& ex) {
      error = ex.what();
    }
    impl::Fingerprint f;
    f.text("call", name)
        .text("schedule", std::string(Schedule::name()) + " (" + impl::type_name<Schedule>() + ")")
        .text("partition",
              std::string(Partition::name()) + " (" + impl::type_name<Partition>() + ")");
    impl::add_mask(f, m_mask);
    f.text("value type", impl::type_name<T>())
        .number("batch (q.extent(0))", e.batch)
        .number("local length (q.extent(1))", e.queries)
        .number("heads (q.extent(2))", e.heads)
        .number("kv heads (k.extent(2))", e.kv_heads)
        .number("head_dim (q.extent(3))", e.dim)
        .real("options.scale", opts.scale,
              std::isnan(opts.scale) ? std::string("default (1/sqrt(head_dim))")
                                     : impl::to_text(opts.scale))
        .number("options.communicate", opts.communicate ? 1 : 0)
        .number("options.check_policies (or BLOCKATTN_CHECK_POLICIES)",
                impl::check_policies_always || opts.check_policies ? 1 : 0);
    impl::reach_consensus(m_comm, name, error, f);

    // From here on every rank holds the same configuration, so the checks
    // below throw on every rank or on none, without communication.
    const int P = m_comm.size();
    const index_type N = index_type(e.queries) * P;
    require_partitionable<Partition>(name, N, P);
    check_partition_contract<Partition>(name, N, P);
    if (impl::check_policies_always || opts.check_policies)
      impl::check_mask_contract(name, m_exec, m_mask, 0, N, 0, N);
    if constexpr (std::is_same<Schedule, BalancedSchedule>::value) {
      for (int i = 0; i < P; ++i)
        for (int j = i + 1; j < P; ++j)
          if (!block_is_empty<Partition>(m_mask, N, P, i, j))
            impl::fail(name, "argument 'mask' lets the queries of rank ", i,
                       " attend to keys of the later rank ", j,
                       "; BalancedSchedule expects a causal mask (no query attends to a later "
                       "block): use RingSchedule for this mask");
    }
    return e;
  }

  template <int SD, class Shape, class QV, class KV, class VV, class OV, class LV>
  void run_kv_ring_forward(const impl::ForwardExtents& e, const QV& q, const KV& k, const VV& v,
                           const OV& o, const LV& lse, const DistributedOptions& opts,
                           RunStats& stats) {
    using T = typename OV::non_const_value_type;
    using mem = typename ExecSpace::memory_space;
    using Kernel =
        impl::ForwardKernel<ExecSpace, T, SD, Shape, Mask, typename Partition::position_map,
                            typename Partition::position_map>;
    const int P = m_comm.size(), rank = m_comm.rank();
    const index_type N = index_type(e.queries) * P;
    const T scale = impl::softmax_scale<T>(opts.scale, e.dim);
    const int dp = Kernel::pad_dim(e.dim);

    // Two K/V buffers (double buffering) and the softmax state of the local queries.
    impl::PackedKV<T, mem> buf[2] = {
        impl::allocate_packed_kv<T, mem>(e.batch, e.kv_heads, e.keys, dp, Shape::block_k),
        impl::allocate_packed_kv<T, mem>(e.batch, e.kv_heads, e.keys, dp, Shape::block_k)};
    impl::BlockStep<T, mem> state;
    state.m_state = decltype(state.m_state)(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::ring_m"), e.batch, e.heads,
        e.queries);
    state.l_state = decltype(state.l_state)(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::ring_l"), e.batch, e.heads,
        e.queries);
    impl::pack_kv(m_exec, k, v, buf[0]);
    const std::int64_t block_bytes =
        std::int64_t(buf[0].kt.span() + buf[0].v.span()) * std::int64_t(sizeof(T));
    stats.block_q = Shape::block_q;
    stats.block_k = Shape::block_k;
    stats.workspace_bytes =
        2 * block_bytes + 2 * std::int64_t(state.m_state.span()) * std::int64_t(sizeof(T));

    const auto qpos = Partition::positions(N, P, rank);
    impl::Transfers<Communicator, ExecSpace> x(m_comm, m_exec, fn, opts.timeout_seconds);
    using request = typename impl::Transfers<Communicator, ExecSpace>::transfer_type;
    bool resumed = false;
    int cur = 0;
    for (int s = 0; s < P; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      // The block of this rank's predecessor s steps back; without
      // communication the local data stand in for it (same tiles, same work).
      const int src_rank = ring_source(rank, s, P);
      const bool more = s + 1 < P;
      std::vector<request> reqs;
      if (more && opts.communicate) {
        // Post the transfer of the next block before computing on this one.
        reqs.push_back(x.receive(buf[1 - cur].kt, ring_prev(m_comm), s + 1, impl::Message::k));
        reqs.push_back(x.receive(buf[1 - cur].v, ring_prev(m_comm), s + 1, impl::Message::v));
        reqs.push_back(x.send(buf[cur].kt, ring_next(m_comm), s + 1, impl::Message::k));
        reqs.push_back(x.send(buf[cur].v, ring_next(m_comm), s + 1, impl::Message::v));
      }
      const auto kpos = Partition::positions(N, P, src_rank);
      const bool computed = !block_is_empty<Partition>(m_mask, N, P, rank, src_rank);
      if (computed || !more) {
        state.resume = resumed;
        state.finish = !more;
        state.skip_keys = !computed;
        // In chunks of query tiles, testing the transfers in between: MPI
        // libraries move large messages only inside MPI calls, so without
        // these tests the transfer would wait for the end of the compute.
        const int league = impl::forward_league_size<Shape>(e);
        const int chunks = reqs.empty() ? 1 : (league < progress_chunks ? league : progress_chunks);
        for (int c = 0; c < chunks; ++c) {
          state.league_begin = int(std::int64_t(league) * c / chunks);
          state.league_end = int(std::int64_t(league) * (c + 1) / chunks);
          impl::launch_forward<ExecSpace, T, SD, Shape>(m_exec, e, q, buf[cur], o, lse, m_mask,
                                                        qpos, kpos, scale, state);
          if (!reqs.empty()) {
            m_exec.fence();
            for (auto& r : reqs) x.test(r);
          }
        }
        resumed = resumed || computed;
      }
      m_exec.fence();
      for (auto& r : reqs) x.wait(r);
      StepStats st;
      st.step = s;
      st.source = src_rank;
      st.query_source = rank;
      st.computed = computed;
      st.tiles = ring_step_work<Partition>(m_mask, N, P, rank, s, Shape::block_q, Shape::block_k,
                                           opts.count_pairs);
      st.bytes_sent = reqs.empty() ? 0 : block_bytes;
      st.bytes_received = st.bytes_sent;
      st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      stats.steps.push_back(st);
      if (more && opts.communicate) cur = 1 - cur;
    }
  }
  template <class T>
  using LseBuffer = Kokkos::View<T***, Kokkos::LayoutRight, typename ExecSpace::memory_space>;

  /// Compute launches of one step in chunks of query tiles, testing the
  /// transfers in flight between them (see run_kv_ring_forward).
  template <int SD, class Shape, class QV, class OV, class LV, class QPos, class KPos, class T,
            class Reqs, class Xfer>
  void launch_chunked(Xfer& x, const impl::ForwardExtents& e, const QV& q,
                      const impl::PackedKV<T, typename ExecSpace::memory_space>& kv, const OV& o,
                      const LV& lse, const QPos& qpos, const KPos& kpos, T scale,
                      impl::BlockStep<T, typename ExecSpace::memory_space> state, Reqs& reqs) {
    const int league = impl::forward_league_size<Shape>(e);
    const int chunks = reqs.empty() ? 1 : (league < progress_chunks ? league : progress_chunks);
    for (int c = 0; c < chunks; ++c) {
      state.league_begin = int(std::int64_t(league) * c / chunks);
      state.league_end = int(std::int64_t(league) * (c + 1) / chunks);
      impl::launch_forward<ExecSpace, T, SD, Shape>(m_exec, e, q, kv, o, lse, m_mask, qpos, kpos,
                                                    scale, state);
      if (!reqs.empty()) {
        m_exec.fence();
        for (auto* r : reqs) x.test(*r);
      }
    }
  }

  /// DistFlashAttn's balanced forward (see BalancedSchedule). Step t on rank p
  /// runs balanced_task(p, t, P). The transfers a step needs (K/V from the
  /// block's owner, Q from the rank being helped) are posted at the start of
  /// the step before and complete at its end; a helper's partial (O, LSE)
  /// travels during the next step and is merged into the owner's state at that
  /// step's end. Buffers: own packed K/V + two received, and only on ranks with
  /// that role: a contiguous copy of q, two received Q, two helper results,
  /// two received results.
  template <int SD, class Shape, class QV, class KV, class VV, class OV, class LV>
  void run_balanced(const impl::ForwardExtents& e, const QV& q, const KV& k, const VV& v,
                    const OV& o, const LV& lse, const DistributedOptions& opts, RunStats& stats) {
    using T = typename OV::non_const_value_type;
    using mem = typename ExecSpace::memory_space;
    using request = typename impl::Transfers<Communicator, ExecSpace>::transfer_type;
    impl::Transfers<Communicator, ExecSpace> x(m_comm, m_exec, fn, opts.timeout_seconds);
    const int P = m_comm.size(), rank = m_comm.rank();
    const index_type N = index_type(e.queries) * P;
    const T scale = impl::softmax_scale<T>(opts.scale, e.dim);
    const int dp = impl::padded_head_dim<Shape, SD>(e.dim);
    const int steps = balanced_steps(P);
    const bool comm = opts.communicate;

    const BalancedRoles roles = balanced_roles(rank, P);
    const bool sends_q = roles.helped, helps = roles.helps, helped = roles.helped;
    auto kv_buffer = [&] {
      return impl::allocate_packed_kv<T, mem>(e.batch, e.kv_heads, e.keys, dp, Shape::block_k);
    };
    impl::PackedKV<T, mem> own = kv_buffer(), recv[2];
    impl::pack_kv(m_exec, k, v, own);
    if (steps > 1) recv[0] = kv_buffer(), recv[1] = kv_buffer();
    impl::BlockStep<T, mem> state;
    state.m_state = LseBuffer<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::m"),
                                 e.batch, e.heads, e.queries);
    state.l_state = LseBuffer<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::l"),
                                 e.batch, e.heads, e.queries);
    Buffer4<T> qsend, qrecv[2], hout[2], rout[2];
    LseBuffer<T> hlse[2], rlse[2];
    auto lse_buffer = [&](const char* label) {
      return LseBuffer<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)),
                          e.batch, e.heads, e.queries);
    };
    if (sends_q) {
      qsend = buffer_like<T>(q, "blockattn::balanced_q");
      Kokkos::deep_copy(m_exec, qsend, q);
    }
    for (int i = 0; i < 2; ++i) {
      if (helps) {
        qrecv[i] = buffer_like<T>(q, "blockattn::balanced_q_in");
        hout[i] = buffer_like<T>(o, "blockattn::balanced_o_out");
        hlse[i] = lse_buffer("blockattn::balanced_lse_out");
      }
      if (helped) {
        rout[i] = buffer_like<T>(o, "blockattn::balanced_o_in");
        rlse[i] = lse_buffer("blockattn::balanced_lse_in");
      }
    }
    const std::int64_t kv_bytes =
        std::int64_t(own.kt.span() + own.v.span()) * std::int64_t(sizeof(T));
    const std::int64_t q_bytes =
        std::int64_t(e.batch) * e.queries * e.heads * e.dim * std::int64_t(sizeof(T));
    const std::int64_t res_bytes =
        q_bytes + std::int64_t(e.batch) * e.heads * e.queries * std::int64_t(sizeof(T));
    stats.block_q = Shape::block_q;
    stats.block_k = Shape::block_k;
    stats.workspace_bytes = (steps > 1 ? 3 : 1) * kv_bytes + 2 * bytes_of(state.m_state) +
                            (sends_q ? q_bytes : 0) + (helps ? 2 * (q_bytes + res_bytes) : 0) +
                            (helped ? 2 * res_bytes : 0);

    const auto pos = [&](int r) { return Partition::positions(N, P, r); };
    std::vector<request> res_send[2], res_recv[2];
    auto finish_results = [&](int t) {  // results of step t: complete and merge
      for (auto& r : res_send[t % 2]) x.wait(r);
      res_send[t % 2].clear();
      if (res_recv[t % 2].empty()) return;
      for (auto& r : res_recv[t % 2]) x.wait(r);
      res_recv[t % 2].clear();
      impl::merge_partial(m_exec, o, state.m_state, state.l_state, rout[t % 2], rlse[t % 2], e.dim);
      m_exec.fence();
    };
    for (int t = 0; t < steps; ++t) {
      const auto t0 = std::chrono::steady_clock::now();
      const BlockTask task = balanced_task(rank, t, P);
      StepStats st;
      std::vector<request> reqs;
      if (t + 1 < steps && comm) {
        // Inputs of step u = t + 1: our K/V to the owner that needs it, the
        // K/V we need as owner; our Q to our helper, the Q we help with.
        const int u = t + 1;
        if (rank >= u) {
          reqs.push_back(x.receive(recv[u % 2].kt, rank - u, u, impl::Message::k));
          reqs.push_back(x.receive(recv[u % 2].v, rank - u, u, impl::Message::v));
          st.bytes_received += kv_bytes;
        }
        if (rank + u < P) {
          reqs.push_back(x.send(own.kt, rank + u, u, impl::Message::k));
          reqs.push_back(x.send(own.v, rank + u, u, impl::Message::v));
          st.bytes_sent += kv_bytes;
        }
        if (const int r = balanced_helps(rank, u, P); r >= 0) {
          reqs.push_back(x.receive(qrecv[u % 2], r, u, impl::Message::q));
          st.bytes_received += q_bytes;
        }
        if (const int h = balanced_helper_of(rank, u, P); h >= 0) {
          reqs.push_back(x.send(qsend, h, u, impl::Message::q));
          st.bytes_sent += q_bytes;
        }
      }
      if (const int h = balanced_helper_of(rank, t, P); h >= 0 && comm) {
        res_recv[t % 2].push_back(x.receive(rout[t % 2], h, t, impl::Message::o));
        res_recv[t % 2].push_back(x.receive(rlse[t % 2], h, t, impl::Message::o_lse));
        st.bytes_received += res_bytes;
      }
      std::vector<request*> in_flight;  // tested between compute chunks
      for (auto& r : reqs) in_flight.push_back(&r);
      for (auto& r : res_recv[(t + 1) % 2]) in_flight.push_back(&r);
      for (auto& r : res_send[(t + 1) % 2]) in_flight.push_back(&r);
      st.computed =
          !task.idle() && !block_is_empty<Partition>(m_mask, N, P, task.q_rank, task.k_rank);
      if (task.q_rank == rank) {
        // Own queries: the diagonal (always launched: it initialises the
        // state) or, as owner, the K/V block of rank p - t.
        if (t == 0 || st.computed) {
          impl::BlockStep<T, mem> s = state;
          s.resume = t > 0;
          s.finish = P == 1;
          s.skip_keys = !st.computed;
          launch_chunked<SD, Shape>(x, e, q, (t == 0 || !comm) ? own : recv[t % 2], o, lse,
                                    pos(rank), pos(task.k_rank), scale, s, in_flight);
        }
      } else if (!task.idle()) {
        // Helper: the queries of rank r against our K/V, fresh state,
        // normalised result sent back to r.
        impl::BlockStep<T, mem> s = state;
        s.resume = false;
        s.finish = true;
        s.skip_keys = !st.computed;
        if (comm)
          launch_chunked<SD, Shape>(x, e, qrecv[t % 2], own, hout[t % 2], hlse[t % 2],
                                    pos(task.q_rank), pos(rank), scale, s, in_flight);
        else
          launch_chunked<SD, Shape>(x, e, q, own, hout[t % 2], hlse[t % 2], pos(task.q_rank),
                                    pos(rank), scale, s, in_flight);
        m_exec.fence();
        if (comm) {
          res_send[t % 2].push_back(x.send(hout[t % 2], task.q_rank, t, impl::Message::o));
          res_send[t % 2].push_back(x.send(hlse[t % 2], task.q_rank, t, impl::Message::o_lse));
          st.bytes_sent += res_bytes;
        }
      }
      m_exec.fence();
      for (auto& r : reqs) x.wait(r);
      if (t > 0) finish_results(t - 1);  // the previous step's partial arrived meanwhile
      st.step = t;
      st.source = task.k_rank;
      st.query_source = task.q_rank;
      st.tiles = task_work<Partition>(m_mask, N, P, task, Shape::block_q, Shape::block_k,
                                      opts.count_pairs);
      st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      stats.steps.push_back(st);
    }
    if (steps > 1) {
      const auto t0 = std::chrono::steady_clock::now();
      finish_results(steps - 1);
      // Normalise the merged state into o and lse.
      impl::BlockStep<T, mem> s = state;
      s.resume = true;
      s.finish = true;
      s.skip_keys = true;
      impl::launch_forward<ExecSpace, T, SD, Shape>(m_exec, e, q, own, o, lse, m_mask, pos(rank),
                                                    pos(rank), scale, s);
      m_exec.fence();
      stats.steps.back().seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  }
  /// Backward of the balanced schedule: the forward's block pairs, step by
  /// step. An owner (pair (p, p - t)) receives K, V of rank p - t, adds into
  /// its own dQ and sends the dK, dV partial of those keys back; a helper
  /// (pair (r, p)) receives the packed Q, dO, LSE, D of rank r, adds into its
  /// own dK, dV and sends the dQ partial back. Inputs are posted a step ahead;
  /// partials travel during the next step and are added at its end.
  template <int SD, class Shape, class QV, class KV, class VV, class OV, class LV, class DOV,
            class DQV, class DKV, class DVV>
  void run_backward_balanced(const impl::ForwardExtents& e, const QV& q, const KV& k, const VV& v,
                             const OV& o, const LV& lse, const DOV& dout, const DQV& dq,
                             const DKV& dk, const DVV& dv, const DistributedOptions& opts,
                             RunStats& stats) {
    using T = typename OV::non_const_value_type;
    using mem = typename ExecSpace::memory_space;
    using request = typename impl::Transfers<Communicator, ExecSpace>::transfer_type;
    impl::Transfers<Communicator, ExecSpace> x(m_comm, m_exec, bfn, opts.timeout_seconds);
    const int P = m_comm.size(), rank = m_comm.rank();
    const index_type N = index_type(e.queries) * P;
    const T scale = impl::softmax_scale<T>(opts.scale, e.dim);
    const int dp = impl::padded_head_dim<Shape, SD>(e.dim);
    const int steps = balanced_steps(P);
    const BalancedRoles roles = balanced_roles(rank, P);
    const bool owns_remote = roles.owns_remote, sends_kv = roles.sends_kv, helps = roles.helps,
               helped = roles.helped;
    auto queries_buffer = [&] {
      return impl::allocate_packed_queries<T, mem>(e.batch, e.heads, e.queries, dp, Shape::block_q);
    };
    auto keys_buffer = [&] {
      return impl::allocate_packed_keys<T, mem>(e.batch, e.kv_heads, e.keys, dp, Shape::block_k);
    };
    impl::PackedQueries<T, mem> own_q = queries_buffer(), q_in[2];
    impl::PackedKeys<T, mem> own_k = keys_buffer(), remote_k;
    impl::pack_queries(m_exec, q, dout, o, lse, own_q);
    impl::pack_keys(m_exec, k, v, own_k);
    Buffer4<T> kv_send[2], kv_in[2][2], dkv_out[2][2], dkv_add[2][2], dq_out[2], dq_add[2];
    if (sends_kv) {
      kv_send[0] = buffer_like<T>(k, "blockattn::balanced_k");
      kv_send[1] = buffer_like<T>(v, "blockattn::balanced_v");
      Kokkos::deep_copy(m_exec, kv_send[0], k);
      Kokkos::deep_copy(m_exec, kv_send[1], v);
    }
    if (owns_remote) remote_k = keys_buffer();
    for (int i = 0; i < 2; ++i) {
      if (owns_remote)
        for (int j = 0; j < 2; ++j) {
          kv_in[i][j] = buffer_like<T>(j == 0 ? k : v, "blockattn::balanced_kv_in");
          dkv_out[i][j] = buffer_like<T>(j == 0 ? dk : dv, "blockattn::balanced_dkv_out");
        }
      if (sends_kv)
        for (int j = 0; j < 2; ++j)
          dkv_add[i][j] = buffer_like<T>(j == 0 ? dk : dv, "blockattn::balanced_dkv_in");
      if (helps) {
        q_in[i] = queries_buffer();
        dq_out[i] = buffer_like<T>(dq, "blockattn::balanced_dq_out");
      }
      if (helped) dq_add[i] = buffer_like<T>(dq, "blockattn::balanced_dq_in");
    }
    const std::int64_t kv_bytes = bytes_of(k) + bytes_of(v);
    const std::int64_t dkv_bytes = bytes_of(dk) + bytes_of(dv);
    const std::int64_t q_bytes =
        bytes_of(own_q.q) + bytes_of(own_q.dout) + bytes_of(own_q.lse2) + bytes_of(own_q.drow);
    const std::int64_t dq_bytes = bytes_of(dq);
    const std::int64_t keys_bytes = bytes_of(own_k.kt) + bytes_of(own_k.vt) + bytes_of(own_k.k);
    stats.block_q = Shape::block_q;
    stats.block_k = Shape::block_k;
    stats.workspace_bytes = q_bytes + keys_bytes + (sends_kv ? kv_bytes + 2 * dkv_bytes : 0) +
                            (owns_remote ? keys_bytes + 2 * (kv_bytes + dkv_bytes) : 0) +
                            (helps ? 2 * (q_bytes + dq_bytes) : 0) + (helped ? 2 * dq_bytes : 0);

    const auto pos = [&](int r) { return Partition::positions(N, P, r); };
    std::vector<request> out_send[2], in_recv[2];
    bool in_dkv[2] = {false, false}, in_dq[2] = {false, false};
    auto finish_partials = [&](int t) {  // partials of step t: complete and add
      const int i = t % 2;
      for (auto& r : out_send[i]) x.wait(r);
      for (auto& r : in_recv[i]) x.wait(r);
      out_send[i].clear();
      in_recv[i].clear();
      if (in_dkv[i]) {
        impl::add_into(m_exec, dk, dkv_add[i][0]);
        impl::add_into(m_exec, dv, dkv_add[i][1]);
      }
      if (in_dq[i]) impl::add_into(m_exec, dq, dq_add[i]);
      in_dkv[i] = in_dq[i] = false;
      m_exec.fence();
    };
    auto post_queries = [&](auto&& op, const impl::PackedQueries<T, mem>& b, int peer, int step) {
      std::vector<request> r;
      r.push_back(op(b.q, peer, step, impl::Message::q));
      r.push_back(op(b.dout, peer, step, impl::Message::dout));
      r.push_back(op(b.lse2, peer, step, impl::Message::q_lse));
      r.push_back(op(b.drow, peer, step, impl::Message::q_drow));
      return r;
    };
    auto isend = [&](const auto& view, int peer, int step, impl::Message m) {
      return x.send(view, peer, step, m);
    };
    auto irecv = [&](const auto& view, int peer, int step, impl::Message m) {
      return x.receive(view, peer, step, m);
    };
    for (int t = 0; t < steps; ++t) {
      const auto t0 = std::chrono::steady_clock::now();
      const BlockTask task = balanced_task(rank, t, P);
      const int i = t % 2;
      StepStats st;
      std::vector<request> reqs;
      if (t + 1 < steps) {
        const int u = t + 1;
        if (rank >= u) {
          reqs.push_back(irecv(kv_in[u % 2][0], rank - u, u, impl::Message::k));
          reqs.push_back(irecv(kv_in[u % 2][1], rank - u, u, impl::Message::v));
          st.bytes_received += kv_bytes;
        }
        if (rank + u < P) {
          reqs.push_back(isend(kv_send[0], rank + u, u, impl::Message::k));
          reqs.push_back(isend(kv_send[1], rank + u, u, impl::Message::v));
          st.bytes_sent += kv_bytes;
        }
        if (const int r = balanced_helps(rank, u, P); r >= 0) {
          for (auto& y : post_queries(irecv, q_in[u % 2], r, u)) reqs.push_back(y);
          st.bytes_received += q_bytes;
        }
        if (const int h = balanced_helper_of(rank, u, P); h >= 0) {
          for (auto& y : post_queries(isend, own_q, h, u)) reqs.push_back(y);
          st.bytes_sent += q_bytes;
        }
      }
      // Partials of this step's pairs that other ranks compute for us.
      if (t > 0 && rank + t < P) {
        in_recv[i].push_back(irecv(dkv_add[i][0], rank + t, t, impl::Message::dk));
        in_recv[i].push_back(irecv(dkv_add[i][1], rank + t, t, impl::Message::dv));
        in_dkv[i] = true;
        st.bytes_received += dkv_bytes;
      }
      if (const int h = balanced_helper_of(rank, t, P); h >= 0) {
        in_recv[i].push_back(irecv(dq_add[i], h, t, impl::Message::dq));
        in_dq[i] = true;
        st.bytes_received += dq_bytes;
      }
      st.computed =
          !task.idle() && !block_is_empty<Partition>(m_mask, N, P, task.q_rank, task.k_rank);
      impl::BackwardBlock blk;
      if (t == 0) {
        if (st.computed) {
          impl::launch_backward<ExecSpace, T, SD, Shape>(m_exec, e, own_q, own_k, dq, dk, dv,
                                                         m_mask, pos(rank), pos(rank), scale, blk);
        } else {
          Kokkos::deep_copy(m_exec, dq, T(0));
          Kokkos::deep_copy(m_exec, dk, T(0));
          Kokkos::deep_copy(m_exec, dv, T(0));
        }
      } else if (task.q_rank == rank) {
        // Owner: our queries against the keys of rank p - t; their dK, dV go back.
        if (st.computed) {
          impl::pack_keys(m_exec, kv_in[i][0], kv_in[i][1], remote_k);
          blk.accumulate_dq = true;
          impl::launch_backward<ExecSpace, T, SD, Shape>(m_exec, e, own_q, remote_k, dq,
                                                         dkv_out[i][0], dkv_out[i][1], m_mask,
                                                         pos(rank), pos(task.k_rank), scale, blk);
        } else {
          Kokkos::deep_copy(m_exec, dkv_out[i][0], T(0));
          Kokkos::deep_copy(m_exec, dkv_out[i][1], T(0));
        }
        m_exec.fence();
        out_send[i].push_back(isend(dkv_out[i][0], task.k_rank, t, impl::Message::dk));
        out_send[i].push_back(isend(dkv_out[i][1], task.k_rank, t, impl::Message::dv));
        st.bytes_sent += dkv_bytes;
      } else if (!task.idle()) {
        // Helper: the queries of rank r against our keys; their dQ goes back.
        if (st.computed) {
          blk.accumulate_dkv = true;
          impl::launch_backward<ExecSpace, T, SD, Shape>(m_exec, e, q_in[i], own_k, dq_out[i], dk,
                                                         dv, m_mask, pos(task.q_rank), pos(rank),
                                                         scale, blk);
        } else {
          Kokkos::deep_copy(m_exec, dq_out[i], T(0));
        }
        m_exec.fence();
        out_send[i].push_back(isend(dq_out[i], task.q_rank, t, impl::Message::dq));
        st.bytes_sent += dq_bytes;
      }
      for (auto& r : reqs) x.test(r);
      m_exec.fence();
      for (auto& r : reqs) x.wait(r);
      if (t > 0) finish_partials(t - 1);
      st.step = t;
      st.source = task.k_rank;
      st.query_source = task.q_rank;
      st.tiles = task_work<Partition>(m_mask, N, P, task, Shape::block_q, Shape::block_k,
                                      opts.count_pairs);
      st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      stats.steps.push_back(st);
    }
    if (steps > 1) finish_partials(steps - 1);
    m_exec.fence();
  }
};

}  // namespace blockattn
