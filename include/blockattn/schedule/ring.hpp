// SPDX-License-Identifier: Apache-2.0
// The ring schedules (Ring Attention, BurstAttention), described for the
// schedule concept (blockattn/schedule/schedule.hpp), and the host-side work model of
// the KV ring: which key/value block a rank holds at each step and what the
// tile classifier makes of it. The run, the planner and the tests all read
// this description.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/work.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/partition.hpp>
#include <blockattn/schedule/context.hpp>
#include <blockattn/schedule/schedule.hpp>

#include <string>
#include <type_traits>
#include <vector>

namespace blockattn {

/// The rank whose K/V block `rank` holds at `step` of the ring.
inline int ring_source(int rank, int step, int P) {
  return ((rank - step) % P + P) % P;
}

/// Steps of a ring in context c: ring_reach() + 1. Step s computes the block
/// pairs at ring distance s, (x, x - s mod P); beyond the reach they are all
/// empty, so K/V (or queries) travel only as far as the mask needs them
/// (a causal window of w tokens on a contiguous partition of c tokens per
/// rank: at most ceil(w / c) + 1 steps and that many - 1 hops instead of P).
inline int ring_steps(const ScheduleContext& c) {
  return c.ring_reach() + 1;
}

/// Backward variants of the ring schedules, described for the schedule
/// concept (BackwardStep, blockattn/schedule/schedule.hpp).
///
/// KV ring (Ring Attention, arXiv:2310.01889, `_ring_attention_bwd`): K, V
/// travel as in the forward (slot s mod 2), each step writes the dK, dV of the
/// keys it holds into a fresh partial (slot s mod 2), adds the partial of the
/// same keys that the previous rank summed one step earlier, and passes the
/// sum on; after the last step (S = ring_steps()) the complete dK, dV go
/// straight home: one hop when S = P, S - 1 ranks back when the mask stops
/// the ring early. dQ stays home.
struct KVRingBackward {
  static constexpr const char* name() { return "kv-ring"; }
  static int steps(const ScheduleContext& c) { return ring_steps(c); }
  static void step(const ScheduleContext& c, int rank, int s, BackwardStep& out) {
    const int P = c.P, S = steps(c);
    out.task = {rank, ring_source(rank, s, P)};
    if (S == 1) return;  // the own block only: straight into the own gradients
    out.kv_slot = s % 2;
    out.dkv_slot = s % 2;
    ring_partials(rank, s, S, P, +1, Payload::kv, Payload::dkv, out.transfers);
  }
  /// The transfers of both rings over S steps: `block` (K/V or packed Q)
  /// moves `dir` ranks on each step (+1: to rank + 1) like the forward's K/V;
  /// the partial gradient `partial` of the block held at step s is summed
  /// along the ring and goes home after the last step.
  static void ring_partials(int rank, int s, int S, int P, int dir, Payload block, Payload partial,
                            std::vector<ScheduledTransfer>& x) {
    const auto at = [P, rank](int offset) { return ((rank + offset) % P + P) % P; };
    const int next = at(dir), prev = at(-dir);
    if (s + 1 < S) {
      x.push_back({rank, next, block, s, s, false, s, s % 2, (s + 1) % 2});
      x.push_back({prev, rank, block, s, s, false, s, s % 2, (s + 1) % 2});
    }
    // The partial the previous rank summed at step s - 1 is for the block we
    // hold now: add it into ours (in-slot 0) once both are there.
    if (s > 0) x.push_back({prev, rank, partial, s - 1, s, true, s, (s - 1) % 2, 0, s % 2});
    if (s + 1 < S) {
      x.push_back({rank, next, partial, s, s + 1, true, s + 1, s % 2, 0, (s + 1) % 2});
    } else {
      // Last step: we hold the block of the rank S - 1 places back; its
      // complete partial goes home, ours arrives from the rank S - 1 places
      // on (in-slot 1). S = P: the next and the previous rank.
      x.push_back({rank, at(-dir * (S - 1)), partial, s, s, true, S, s % 2, 1, -1});
      x.push_back({at(dir * (S - 1)), rank, partial, s, s, true, S, s % 2, 1, -1});
    }
  }
};
/// Q ring (BurstAttention, arXiv:2403.09347, Algorithm 2, GAO backward): the
/// packed Q, dO, LSE, D travel (slot s mod 2, slot 0 starts with our own) and
/// the dQ partial is summed along the ring like the KV ring's dK, dV; K, V,
/// dK, dV stay home. The queries travel the other way round (to rank - 1),
/// so that step s holds the same block pairs as the KV ring's step s — the
/// queries of rank x + s against our keys — and a mask that stops the KV ring
/// early stops this one as early.
struct QRingBackward {
  static constexpr const char* name() { return "q-ring"; }
  static int steps(const ScheduleContext& c) { return ring_steps(c); }
  static void step(const ScheduleContext& c, int rank, int s, BackwardStep& out) {
    const int P = c.P, S = steps(c);
    out.task = {(rank + s) % P, rank};
    if (S == 1) return;
    out.q_slot = s % 2;
    out.dq_slot = s % 2;
    KVRingBackward::ring_partials(rank, s, S, P, -1, Payload::q, Payload::dq, out.transfers);
  }
};

/// The KV ring forward (Ring Attention, arXiv:2310.01889, Algorithm 1;
/// Striped Attention uses it with the striped partition): Q stays, K/V blocks
/// travel to the next rank each step; step s on rank r holds the block of rank
/// (r - s) mod P in K/V slot s mod 2. The transfer of the next block (into the
/// other slot) is posted before a step's compute and completed after it
/// (double buffering). The ring stops after ring_steps() steps: the block
/// pairs further round are empty under the mask. `Backward` picks the
/// backward's ring.
template <class Backward>
struct BasicRingSchedule : AnyPartitionAndMask {  // every partition and mask
  using schedule_type = BasicRingSchedule;
  using backward_type = Backward;
  static constexpr const char* name() {
    return std::is_same<Backward, KVRingBackward>::value ? "ring" : "burst";
  }
  static int steps(const ScheduleContext& c) { return ring_steps(c); }
  static void step(const ScheduleContext& c, int rank, int s, ForwardStep& out) {
    const int P = c.P;
    out.task = {rank, ring_source(rank, s, P)};
    out.kv_slot = s % 2;
    if (s + 1 >= steps(c)) return;
    const int next = (rank + 1) % P, prev = (rank + P - 1) % P;
    // Send the block held now to the next rank; receive the next step's
    // block from the previous one. Both done by the end of this step.
    out.transfers.push_back({rank, next, Payload::kv, s, s, false, s, s % 2, (s + 1) % 2});
    out.transfers.push_back({prev, rank, Payload::kv, s, s, false, s, s % 2, (s + 1) % 2});
  }
};

/// Ring Attention: KV ring forward and backward.
using RingSchedule = BasicRingSchedule<KVRingBackward>;
/// BurstAttention: KV ring forward, Q ring backward.
using BurstSchedule = BasicRingSchedule<QRingBackward>;

namespace impl {
/// Schedules whose forward is the KV ring (RingSchedule, BurstSchedule).
template <class S>
struct is_kv_ring_forward : std::false_type {};
template <class B>
struct is_kv_ring_forward<BasicRingSchedule<B>>
    : std::bool_constant<std::is_same<B, KVRingBackward>::value ||
                         std::is_same<B, QRingBackward>::value> {};
}  // namespace impl

/// Tiles and (optionally) allowed pairs that `rank` computes at `step` of the
/// ring for a global sequence of N tokens split by the partition over P ranks.
template <class Partition, class Mask>
TileCounts ring_step_work(const Partition& partition, const Mask& mask, index_type N, int P,
                          int rank, int step, int block_q, int block_k, bool count_pairs = true) {
  const int source = ring_source(rank, step, P);
  return count_tiles(
      mask, local_length(partition, N, P, rank), local_length(partition, N, P, source), block_q,
      block_k, partition.positions(N, P, rank), partition.positions(N, P, source), count_pairs);
}
/// The same for a stateless partition (the type alone).
template <class Partition, class Mask>
TileCounts ring_step_work(const Mask& mask, index_type N, int P, int rank, int step, int block_q,
                          int block_k, bool count_pairs = true) {
  return ring_step_work(Partition{}, mask, N, P, rank, step, block_q, block_k, count_pairs);
}

}  // namespace blockattn
