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

#include <blockattn/attention_forward.hpp>
#include <blockattn/communicator.hpp>
#include <blockattn/config.hpp>
#include <blockattn/errors.hpp>
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
  int source = 0;         // rank whose K/V block was used
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
                "(RingSchedule; see blockattn/ring_schedule.hpp)");
  static_assert(is_communicator_v<Communicator>,
                "BlockAttn: DistributedAttention: the fourth parameter must be a communicator "
                "(MpiCommunicator<>, SelfCommunicator; see blockattn/communicator.hpp)");
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
      const impl::ForwardExtents e = validate(q, k, v, o, lse, opts);
      using T = typename OV::non_const_value_type;
      using Shape = DefaultTileShape<T, impl::is_host_space_v<ExecSpace>>;
      RunStats stats;
      impl::with_shape_for<Shape>(e.dim, [&](auto static_d, auto shape) {
        run_ring<decltype(static_d)::value, decltype(shape)>(e, q, k, v, o, lse, opts, stats);
      });
      return stats;
    } else {
      return RunStats{};
    }
  }

 private:
  Communicator m_comm;
  Mask m_mask;
  ExecSpace m_exec;
  static constexpr const char* fn = "DistributedAttention::forward";
  static constexpr int progress_chunks = 8;  // compute launches per step with a transfer in flight

  template <class QV, class KV, class VV, class OV, class LV>
  impl::ForwardExtents validate(const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                                const DistributedOptions& opts) {
    // Each rank checks its own arguments, then all ranks agree, so that a bad
    // argument on one rank never leaves the others waiting in the ring.
    std::string error;
    impl::ForwardExtents e;
    try {
      e = impl::validate_forward<ExecSpace>(fn, q, k, v, o, lse, opts.scale);
      if (k.extent(1) != q.extent(1))
        impl::fail(fn, "argument 'k' has extent(1) (seq) = ", k.extent(1), ", expected ",
                   q.extent(1),
                   " (the local length of q: each rank holds N / P tokens of q, k, v)");
    } catch (const invalid_argument& ex) {
      error = ex.what();
    }
    const int P = m_comm.size();
    const int bad_rank = static_cast<int>(
        m_comm.allreduce(std::int64_t(error.empty() ? P : m_comm.rank()), ReduceOp::min));
    if (bad_rank < P) {
      if (!error.empty()) throw invalid_argument(error);
      impl::fail(fn, "invalid arguments on rank ", bad_rank,
                 " (its exception names them); this rank ", m_comm.rank(), " stops too");
    }
    // Same shapes on every rank.
    const std::int64_t mine[6] = {e.batch, e.queries, e.heads, e.kv_heads, e.dim, 0};
    const char* names[5] = {"batch (q.extent(0))", "local length (q.extent(1))",
                            "heads (q.extent(2))", "kv heads (k.extent(2))",
                            "head_dim (q.extent(3))"};
    for (int i = 0; i < 5; ++i) {
      const std::int64_t lo = m_comm.allreduce(mine[i], ReduceOp::min);
      const std::int64_t hi = m_comm.allreduce(mine[i], ReduceOp::max);
      if (lo != hi)
        impl::fail(fn, names[i], " differs between ranks (from ", lo, " to ", hi, ", this rank ",
                   mine[i], "); expected the same value on every rank");
    }
    require_partitionable<Partition>(fn, index_type(e.queries) * P, P);
    return e;
  }

  template <int SD, class Shape, class QV, class KV, class VV, class OV, class LV>
  void run_ring(const impl::ForwardExtents& e, const QV& q, const KV& k, const VV& v, const OV& o,
                const LV& lse, const DistributedOptions& opts, RunStats& stats) {
    using T = typename OV::non_const_value_type;
    using mem = typename ExecSpace::memory_space;
    using Kernel =
        impl::ForwardKernel<ExecSpace, T, SD, Shape, Mask, typename Partition::position_map,
                            typename Partition::position_map>;
    const int P = m_comm.size(), rank = m_comm.rank();
    const index_type N = index_type(e.queries) * P;
    const T scale = std::isnan(opts.scale) ? T(1) / std::sqrt(T(e.dim)) : T(opts.scale);
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
    bool resumed = false;
    int cur = 0;
    for (int s = 0; s < P; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      // The block of this rank's predecessor s steps back; without
      // communication the local data stand in for it (same tiles, same work).
      const int src_positions = ring_source(rank, s, P);
      const bool more = s + 1 < P;
      std::vector<typename Communicator::request_type> reqs;
      if (more && opts.communicate) {
        // Post the transfer of the next block before computing on this one.
        const int tag = 2 * s;
        reqs.push_back(m_comm.irecv(buf[1 - cur].kt, ring_prev(m_comm), tag));
        reqs.push_back(m_comm.irecv(buf[1 - cur].v, ring_prev(m_comm), tag + 1));
        reqs.push_back(m_comm.isend(buf[cur].kt, ring_next(m_comm), tag));
        reqs.push_back(m_comm.isend(buf[cur].v, ring_next(m_comm), tag + 1));
      }
      const auto kpos = Partition::positions(N, P, src_positions);
      const bool computed = !block_is_empty<Partition>(m_mask, N, P, rank, src_positions);
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
            for (auto& r : reqs) m_comm.test(r);
          }
        }
        resumed = resumed || computed;
      }
      m_exec.fence();
      for (auto& r : reqs) m_comm.wait(r);
      StepStats st;
      st.step = s;
      st.source = src_positions;
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
};

}  // namespace blockattn
