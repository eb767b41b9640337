// SPDX-License-Identifier: Apache-2.0
// Schedules (empty tag types) and the host-side work model of the KV ring:
// which key/value block a rank holds at each step and what the tile classifier
// makes of it. The ring's run and its accounting both use this model.
#pragma once

#include <blockattn/config.hpp>
#include <blockattn/mask.hpp>
#include <blockattn/partition.hpp>
#include <blockattn/work.hpp>

#include <type_traits>

namespace blockattn {

/// Backward variants of the ring schedules:
/// KV ring (Ring Attention, arXiv:2310.01889, `_ring_attention_bwd`): K, V and their dK, dV
/// accumulators travel; dQ stays home.
struct KVRingBackward {
  static constexpr const char* name() { return "kv-ring"; }
};
/// Q ring (BurstAttention, arXiv:2403.09347, Algorithm 2, GAO backward): Q, dO, LSE, D and the
/// dQ accumulator travel; K, V, dK, dV stay home.
struct QRingBackward {
  static constexpr const char* name() { return "q-ring"; }
};

/// The KV ring forward (Ring Attention, arXiv:2310.01889, Algorithm 1;
/// Striped Attention uses it with the striped partition): Q stays, K/V blocks
/// travel to the next rank each step; step s on rank r holds the block of rank
/// (r - s) mod P. Communication of the next block is posted before a step's
/// compute and completed after it (double buffering). `Backward` picks the
/// backward's ring.
template <class Backward>
struct BasicRingSchedule {
  using schedule_type = BasicRingSchedule;
  using backward_type = Backward;
  static constexpr const char* name() {
    return std::is_same<Backward, KVRingBackward>::value ? "ring" : "burst";
  }
  /// Every partition and mask work with the ring.
  template <class Partition, class Mask>
  static constexpr bool supports = true;
};

/// Ring Attention: KV ring forward and backward.
using RingSchedule = BasicRingSchedule<KVRingBackward>;
/// BurstAttention: KV ring forward, Q ring backward.
using BurstSchedule = BasicRingSchedule<QRingBackward>;

template <class S, class = void>
struct is_schedule : std::false_type {};
template <class S>
struct is_schedule<S, std::void_t<typename S::schedule_type, decltype(S::name())>>
    : std::is_same<typename S::schedule_type, S> {};
template <class S>
inline constexpr bool is_schedule_v = is_schedule<S>::value;

namespace impl {
/// Schedules whose forward is the KV ring (RingSchedule, BurstSchedule).
template <class S>
struct is_kv_ring_forward : std::false_type {};
template <class B>
struct is_kv_ring_forward<BasicRingSchedule<B>>
    : std::bool_constant<std::is_same<B, KVRingBackward>::value ||
                         std::is_same<B, QRingBackward>::value> {};
}  // namespace impl

/// The rank whose K/V block `rank` holds at `step` of the ring.
inline int ring_source(int rank, int step, int P) {
  return ((rank - step) % P + P) % P;
}

/// Tiles and (optionally) allowed pairs that `rank` computes at `step` of the
/// ring for a global sequence of N tokens split by Partition over P ranks.
template <class Partition, class Mask>
TileCounts ring_step_work(const Mask& mask, index_type N, int P, int rank, int step, int block_q,
                          int block_k, bool count_pairs = true) {
  const index_type n = N / P;
  return count_tiles(mask, n, n, block_q, block_k, Partition::positions(N, P, rank),
                     Partition::positions(N, P, ring_source(rank, step, P)), count_pairs);
}

/// True when the whole block of `source` is masked out for the queries of `rank`.
template <class Partition, class Mask>
bool block_is_empty(const Mask& mask, index_type N, int P, int rank, int source) {
  const index_type n = N / P;
  const auto qp = Partition::positions(N, P, rank);
  const auto kp = Partition::positions(N, P, source);
  return mask.classify(qp(0), qp(n - 1) + 1, kp(0), kp(n - 1) + 1) == TileKind::empty;
}

}  // namespace blockattn
