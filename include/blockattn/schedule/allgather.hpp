// SPDX-License-Identifier: Apache-2.0
// The all-gather schedule (the context parallelism of "The Llama 3 Herd of
// Models", arXiv:2407.21783, §3.3.2: all-gather K and V, then attend
// locally), described for the schedule concept (blockattn/schedule/schedule.hpp) and
// run by DistributedAttention's step loops like every other schedule.
//
// Forward: at step 0 every rank posts, at once, the receives of every remote
// K/V block its queries can reach under the mask (blocks the mask leaves
// empty never travel) and the sends of its own block to every rank that
// needs it; step s computes against the block of rank (r - s) mod P, which
// must have arrived by the end of step s - 1, so the later blocks arrive
// while the earlier ones are computed. A rank holds every block it needs at
// once (up to P K/V blocks: the all-gather's memory).
// Backward: K and V gathered the same way; dQ stays home; the dK, dV partial
// of the remote block used at step s goes straight back to its rank after
// the step (a reduce-scatter, one partial per step and rank), which adds it
// into its own dK, dV.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/schedule/ring.hpp>
#include <blockattn/schedule/schedule.hpp>

#include <string>
#include <vector>

namespace blockattn {

struct AllGatherSchedule : AnyPartitionAndMask {  // every partition and mask
  using schedule_type = AllGatherSchedule;
  static constexpr const char* name() { return "all-gather"; }

  /// Step s computes the block of rank (r - s) mod P; beyond the ring reach
  /// every such pair is empty, so the steps stop there.
  static int steps(const ScheduleContext& c) { return ring_steps(c); }

  /// The rank whose block `rank` attends to at step s.
  static int source(int rank, int s, int P) { return ring_source(rank, s, P); }

  /// The K/V slot `rank` gathers the block of step s into: slot 0 holds its
  /// own, the blocks it needs get slots 1, 2, ... in step order (-1: the
  /// block is not needed).
  static int slot(const ScheduleContext& c, int rank, int s) {
    if (s == 0) return 0;
    if (c.empty(rank, source(rank, s, c.P))) return -1;
    int n = 1;
    for (int t = 1; t < s; ++t) n += c.empty(rank, source(rank, t, c.P)) ? 0 : 1;
    return n;
  }

  /// The gather, posted at step 0: the block of step s arrives by the end of
  /// step s - 1. `block` is the payload (packed K/V forward, K/V backward).
  static void gather(const ScheduleContext& c, int rank, std::vector<ScheduledTransfer>& x) {
    const int P = c.P;
    for (int s = 1; s < P; ++s) {
      // Receive the block of step s from its rank; send ours to the rank
      // that uses it at its step s.
      if (const int in = slot(c, rank, s); in >= 0)
        x.push_back({source(rank, s, P), rank, Payload::kv, 0, 0, false, s - 1, 0, in});
      const int to = (rank + s) % P;  // source(to, s) == rank
      if (const int at = slot(c, to, s); at >= 0)
        x.push_back({rank, to, Payload::kv, 0, 0, false, s - 1, 0, at});
    }
  }

  static void step(const ScheduleContext& c, int rank, int s, ForwardStep& out) {
    const int j = source(rank, s, c.P), in = slot(c, rank, s);
    if (in >= 0) {
      out.task = {rank, j};
      out.kv_slot = in;
    }
    if (s == 0) gather(c, rank, out.transfers);
  }

  struct Backward {
    static constexpr const char* name() { return "all-gather"; }
    static int steps(const ScheduleContext& c) { return ring_steps(c); }
    static void step(const ScheduleContext& c, int rank, int s, BackwardStep& out) {
      const int P = c.P, j = source(rank, s, P), in = slot(c, rank, s);
      if (in >= 0) {
        out.task = {rank, j};
        out.kv_slot = in;
        if (s > 0) out.dkv_slot = s % 2;
      }
      if (s == 0) gather(c, rank, out.transfers);
      if (s == 0) return;
      // dK, dV of the block used at step s go home; the rank that used ours
      // at step s sends its partial of our keys.
      const int i = s % 2;
      if (in >= 0) out.transfers.push_back({rank, j, Payload::dkv, s, s, true, s + 1, i, i, -1});
      const int from = (rank + s) % P;
      if (slot(c, from, s) >= 0)
        out.transfers.push_back({from, rank, Payload::dkv, s, s, true, s + 1, i, i, -1});
    }
  };
  using backward_type = Backward;
};

}  // namespace blockattn
