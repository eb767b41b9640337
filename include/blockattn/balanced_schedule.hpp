// SPDX-License-Identifier: Apache-2.0
// DistFlashAttn's load-balanced schedule (arXiv:2310.03294, §3.2, Algorithm 2)
// and its host-side task model: which (query block, key block) pair each rank
// computes at each step. The run and its accounting both use this model.
#pragma once

#include <blockattn/config.hpp>
#include <blockattn/mask.hpp>
#include <blockattn/partition.hpp>
#include <blockattn/ring_schedule.hpp>
#include <blockattn/work.hpp>

#include <type_traits>

namespace blockattn {

/// Backward of the balanced schedule: the same (query block, key block) pairs
/// as its forward; an owner sends the dK, dV partial of the remote key block
/// back, a helper sends the dQ partial of the remote query block back.
struct BalancedBackward {
  static constexpr const char* name() { return "balanced"; }
};

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
struct BalancedSchedule {
  using schedule_type = BalancedSchedule;
  using backward_type = BalancedBackward;
  static constexpr const char* name() { return "balanced"; }
  /// Contiguous partition only (striped and zigzag are balanced by their
  /// layout); the mask must not let a block attend to a later block, which
  /// DistributedAttention checks at run time for masks other than CausalMask.
  template <class Partition, class Mask>
  static constexpr bool supports =
      std::is_same<Partition, ContiguousPartition>::value && !std::is_same<Mask, FullMask>::value;
};

/// One step of one rank: attention of the queries of rank `q_rank` against the
/// keys of rank `k_rank`, or nothing (idle) when q_rank < 0.
struct BlockTask {
  int q_rank = -1;
  int k_rank = -1;
  bool idle() const { return q_rank < 0; }
};

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

/// The task of `rank` at `step` of a schedule (ring or balanced), as a block pair.
template <class Schedule>
BlockTask schedule_task(int rank, int step, int P) {
  if constexpr (std::is_same<Schedule, BalancedSchedule>::value)
    return balanced_task(rank, step, P);
  else
    return {rank, ring_source(rank, step, P)};
}

/// Number of steps of a schedule over P ranks.
template <class Schedule>
int schedule_steps(int P) {
  if constexpr (std::is_same<Schedule, BalancedSchedule>::value)
    return balanced_steps(P);
  else
    return P;
}

/// Tiles of `task` for a global sequence of N tokens split by Partition over
/// P ranks (per batch and head); an idle task has none.
template <class Partition, class Mask>
TileCounts task_work(const Mask& mask, index_type N, int P, const BlockTask& task, int block_q,
                     int block_k, bool count_pairs = true) {
  if (task.idle()) return {};
  const index_type n = N / P;
  return count_tiles(mask, n, n, block_q, block_k, Partition::positions(N, P, task.q_rank),
                     Partition::positions(N, P, task.k_rank), count_pairs);
}

}  // namespace blockattn
