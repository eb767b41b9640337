// SPDX-License-Identifier: Apache-2.0
// What every schedule, driver and the planner ask of a run: which block pairs
// the mask leaves empty under the partition (block_is_empty, the
// ScheduleContext of a description) and the tiles of one block pair
// (task_work, the kernels' own classifier).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/work.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/partition.hpp>
#include <blockattn/schedule/schedule.hpp>

namespace blockattn {

/// True when the whole block of `source` is masked out for the queries of
/// `rank`, or when one of the two ranks holds no token.
template <class Partition, class Mask>
bool block_is_empty(const Partition& partition, const Mask& mask, index_type N, int P, int rank,
                    int source) {
  const index_type nq = local_length(partition, N, P, rank),
                   nk = local_length(partition, N, P, source);
  if (nq == 0 || nk == 0) return true;
  const auto qp = partition.positions(N, P, rank);
  const auto kp = partition.positions(N, P, source);
  return mask.classify(qp(0), qp(nq - 1) + 1, kp(0), kp(nk - 1) + 1) == TileKind::empty;
}
template <class Partition, class Mask>
bool block_is_empty(const Mask& mask, index_type N, int P, int rank, int source) {
  return block_is_empty(Partition{}, mask, N, P, rank, source);
}

/// The context of a schedule's description for a run: P and the block pairs
/// that `mask` leaves empty under the partition (block_is_empty), with the
/// ring reach computed once (O(P^2) block classifications at most).
template <class Partition, class Mask>
ScheduleContext schedule_context(const Partition& partition, const Mask& mask, index_type N,
                                 int P) {
  ScheduleContext c;
  c.P = P;
  c.empty_pair = [partition, mask, N, P](int q_rank, int k_rank) {
    return block_is_empty(partition, mask, N, P, q_rank, k_rank);
  };
  c.reach = c.ring_reach();
  return c;
}
template <class Partition, class Mask>
ScheduleContext schedule_context(const Mask& mask, index_type N, int P) {
  return schedule_context(Partition{}, mask, N, P);
}

/// Tiles of `task` for a global sequence of N tokens split by the partition
/// over P ranks (per batch and head); an idle task has none.
template <class Partition, class Mask>
TileCounts task_work(const Partition& partition, const Mask& mask, index_type N, int P,
                     const BlockTask& task, int block_q, int block_k, bool count_pairs = true) {
  if (task.idle()) return {};
  return count_tiles(mask, local_length(partition, N, P, task.q_rank),
                     local_length(partition, N, P, task.k_rank), block_q, block_k,
                     partition.positions(N, P, task.q_rank), partition.positions(N, P, task.k_rank),
                     count_pairs);
}
/// The same for a stateless partition (the type alone).
template <class Partition, class Mask>
TileCounts task_work(const Mask& mask, index_type N, int P, const BlockTask& task, int block_q,
                     int block_k, bool count_pairs = true) {
  return task_work(Partition{}, mask, N, P, task, block_q, block_k, count_pairs);
}

}  // namespace blockattn
