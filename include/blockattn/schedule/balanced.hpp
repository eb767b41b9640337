// SPDX-License-Identifier: Apache-2.0
// DistFlashAttn's load-balanced schedule (arXiv:2310.03294, §3.2, Algorithm 2)
// and its host-side task model: which (query block, key block) pair each rank
// computes at each step. The run and its accounting both use this model.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/work.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/partition.hpp>
#include <blockattn/schedule/context.hpp>
#include <blockattn/schedule/ring.hpp>
#include <blockattn/schedule/schedule.hpp>

#include <string>
#include <type_traits>
#include <vector>

namespace blockattn {

/// DistFlashAttn's balanced schedule for causal attention over a contiguous
/// partition. Rank p first computes its diagonal block; then, for
/// t = 1 .. floor(P / 2):
///   p >= t:           owner:  attn(q_p, k_{p-t}, v_{p-t}), K/V fetched from p - t;
///   p <  t, 2t < P:   helper: attn(q_r, k_p, v_p) for r = p - t + P, Q fetched
///                     from r, the partial O and LSE sent back to r, which
///                     merges them with the rescale rule;
///   otherwise idle (only at t = P / 2 for even P).
/// Every block pair (i, j), j <= i, is computed exactly once: by its owner i
/// when i - j <= floor(P / 2), else by the helper j at t = P - (i - j).
/// (DistFlashAttn's Algorithm 2, arXiv:2310.03294, prints the helper condition as
/// t != floor(P / 2), which for odd P drops the pairs at distance
/// ceil(P / 2); 2t < P is the condition that covers them.)
struct BalancedSchedule;

/// Steps of the balanced schedule: the diagonal, then floor(P / 2).
inline int balanced_steps(int P) {
  return 1 + P / 2;
}

/// What `rank` computes at `step` of the balanced schedule over P ranks.
inline BlockTask balanced_task(int rank, int step, int P) {
  if (step == 0) return {rank, rank};
  if (rank >= step) return {rank, rank - step};      // owner
  if (2 * step < P) return {rank - step + P, rank};  // helper
  return {};
}

/// The rank whose queries `rank` helps at `step`, or -1.
inline int balanced_helps(int rank, int step, int P) {
  const BlockTask t = balanced_task(rank, step, P);
  return (!t.idle() && t.q_rank != rank) ? t.q_rank : -1;
}

/// The rank that helps `rank` at `step` (sends it a partial result), or -1.
inline int balanced_helper_of(int rank, int step, int P) {
  if (step == 0 || 2 * step >= P || rank + step < P) return -1;
  return rank + step - P;
}

/// The inputs of step t + 1 that `rank` posts at step t of both directions,
/// done by the end of step t: K/V from the owner of the remote block to the
/// rank that owns its queries (K/V slot 1 + (t + 1) mod 2); Q (with dO, LSE,
/// D backward) to the helper (query slot 1 + (t + 1) mod 2).
inline void balanced_inputs(int rank, int t, int P, std::vector<ScheduledTransfer>& x) {
  const int u = t + 1;
  if (u >= balanced_steps(P)) return;
  const int slot = 1 + u % 2;
  if (rank >= u) x.push_back({rank - u, rank, Payload::kv, t, t, false, t, 0, slot});
  if (rank + u < P) x.push_back({rank, rank + u, Payload::kv, t, t, false, t, 0, slot});
  if (const int r = balanced_helps(rank, u, P); r >= 0)
    x.push_back({r, rank, Payload::q, t, t, false, t, 0, slot});
  if (const int h = balanced_helper_of(rank, u, P); h >= 0)
    x.push_back({rank, h, Payload::q, t, t, false, t, 0, slot});
}

/// What `rank` does over a whole balanced run (decides which buffers it needs).
struct BalancedRoles {
  bool owns_remote = false;  // computes its queries against another rank's keys
  bool sends_kv = false;     // sends its K/V to an owner
  bool helps = false;        // computes for another rank's queries
  bool helped = false;       // another rank computes for its queries (it sends Q)
};
inline BalancedRoles balanced_roles(int rank, int P) {
  BalancedRoles r;
  for (int t = 1; t < balanced_steps(P); ++t) {
    r.owns_remote = r.owns_remote || rank >= t;
    r.sends_kv = r.sends_kv || rank + t < P;
    r.helps = r.helps || balanced_helps(rank, t, P) >= 0;
    r.helped = r.helped || balanced_helper_of(rank, t, P) >= 0;
  }
  return r;
}

/// Backward of the balanced schedule, described for the schedule concept:
/// the forward's block pairs, step by step. An owner (pair (p, p - t))
/// receives the K, V of rank p - t (slot 1 + t mod 2), adds into its own dQ
/// and sends the dK, dV partial of those keys back; a helper (pair (r, p))
/// receives the packed Q, dO, LSE, D of rank r, adds into its own dK, dV and
/// sends the dQ partial back. Inputs are posted a step ahead; partials
/// travel during the next step and are added at its end.
struct BalancedBackward {
  static constexpr const char* name() { return "balanced"; }
  static int steps(const ScheduleContext& c) { return balanced_steps(c.P); }
  static void step(const ScheduleContext& c, int rank, int t, BackwardStep& out) {
    const int P = c.P;
    const BlockTask task = balanced_task(rank, t, P);
    out.task = task;
    const bool owner = t > 0 && task.q_rank == rank;
    const bool helper = !task.idle() && task.q_rank != rank;
    if (owner) out.kv_slot = 1 + t % 2, out.dkv_slot = t % 2;
    if (helper) out.q_slot = 1 + t % 2, out.dq_slot = t % 2;
    auto& x = out.transfers;
    balanced_inputs(rank, t, P, x);
    // Partials of step t: into the own gradients of the block's rank.
    const int i = t % 2;
    if (owner) x.push_back({rank, task.k_rank, Payload::dkv, t, t, true, t + 1, i, i, -1});
    if (t > 0 && rank + t < P)
      x.push_back({rank + t, rank, Payload::dkv, t, t, true, t + 1, i, i, -1});
    if (helper) x.push_back({rank, task.q_rank, Payload::dq, t, t, true, t + 1, i, i, -1});
    if (const int h = balanced_helper_of(rank, t, P); h >= 0)
      x.push_back({h, rank, Payload::dq, t, t, true, t + 1, i, i, -1});
  }
};

/// DistFlashAttn's balanced schedule, described for the schedule concept
/// (see the comment at the top of this file and blockattn/schedule/schedule.hpp).
/// Slots: K/V slot 0 is the rank's own packed K/V, slots 1 and 2 receive an
/// owner's remote K/V at odd and even steps; query slot 0 is the caller's q
/// (sent to the helper as a contiguous copy), slots 1 and 2 receive the
/// queries a helper works on; result slots t mod 2 hold a helper's result of
/// step t (out) and the result it sends (in).
struct BalancedSchedule {
  using schedule_type = BalancedSchedule;
  using backward_type = BalancedBackward;
  static constexpr const char* name() { return "balanced"; }
  /// Contiguous partition only (striped and zigzag are balanced by their
  /// layout); the mask must not let a block attend to a later block, which
  /// can_implement checks at run time for masks other than CausalMask.
  template <class Partition, class Mask>
  static constexpr bool supports =
      std::is_same<Partition, ContiguousPartition>::value && !std::is_same<Mask, FullMask>::value;
  template <class Partition, class Mask>
  static std::string can_implement(const Mask& mask, index_type N, int P) {
    for (int i = 0; i < P; ++i)
      for (int j = i + 1; j < P; ++j)
        if (!block_is_empty<Partition>(mask, N, P, i, j)) return reaches_later(i, j);
    return {};
  }
  /// can_implement()'s reason when the queries of rank i see keys of rank j > i.
  static std::string reaches_later(int i, int j) {
    return "the queries of rank " + std::to_string(i) + " attend to keys of the later rank " +
           std::to_string(j) +
           "; BalancedSchedule expects a causal mask (no query attends to a later block): "
           "use RingSchedule for this mask";
  }
  static int steps(const ScheduleContext& c) { return balanced_steps(c.P); }
  static void step(const ScheduleContext& c, int rank, int t, ForwardStep& out) {
    const int P = c.P;
    const BlockTask task = balanced_task(rank, t, P);
    out.task = task;
    const bool helper = !task.idle() && task.q_rank != rank;
    out.kv_slot = task.idle() || task.k_rank == rank ? 0 : 1 + t % 2;
    out.q_slot = helper ? 1 + t % 2 : 0;
    out.result_slot = helper ? t % 2 : -1;
    auto& x = out.transfers;
    balanced_inputs(rank, t, P, x);
    // Results of step t travel during step t + 1 and merge at its end.
    if (const int h = balanced_helper_of(rank, t, P); h >= 0)
      x.push_back({h, rank, Payload::result, t, t, true, t + 1, t % 2, t % 2});
    if (helper) x.push_back({rank, task.q_rank, Payload::result, t, t, true, t + 1, t % 2, t % 2});
  }
};

}  // namespace blockattn
