// SPDX-License-Identifier: Apache-2.0
// The all-gather (AllGatherSchedule, Llama 3) without a message list: the
// forward's model and the backward's steps in O(1) each.
#pragma once

#include <blockattn/plan/impl/pair_work.hpp>
#include <blockattn/schedule/allgather.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace blockattn {
namespace plan {
namespace detail {

/// The all-gather forward (AllGatherSchedule) without a message list: all
/// transfers are posted at step 0; the block rank r needs at step s >= 1
/// (its pair with rank r - s is not empty) comes from rank r - s and
/// completes by the end of step s - 1. At each step a rank sends at most one
/// block (to r + s) and receives at most one, so a transfer starts when both
/// links are free.
template <class Partition, class Mask>
void allgather_model(Prediction& pr, const Problem& p, const Hardware& hw,
                     PairWork<Partition, Mask>& w, int S, int stride, bool keep) {
  const int P = p.P;
  const std::int64_t kv = payload_bytes(p, Payload::kv);
  if (!keep && allgather_fast(pr, p, hw, w, S, stride)) return;
  std::vector<double> e(std::size_t(P), 0.0), next(std::size_t(P), 0.0);
  std::vector<double> out_free(std::size_t(P), 0.0), in_free(std::size_t(P), 0.0);
  std::vector<int> slots(std::size_t(P), 1);  // K/V slots: its own + the blocks it gathers
  std::vector<StepPlan> first(static_cast<std::size_t>(P)),
      now(static_cast<std::size_t>(P));  // step 0 holds every transfer
  for (int s = 0; s < S; ++s) {
    for (int r = 0; r < P; ++r) {
      const int j = ring_source(r, s, P);
      StepPlan& st = s == 0 ? first[std::size_t(r)] : now[std::size_t(r)];
      st = s == 0 || !w.empty(r, j) ? step_work(p, hw, {r, j}, w(r, j)) : step_work(p, hw, {}, {});
      st.start_s = e[std::size_t(r)];
      next[std::size_t(r)] = st.start_s + st.compute_s;
    }
    if (const int u = s + 1; u < S)  // the transfers of step u complete at step s
      for (int r = 0; r < P; ++r) {
        const int src = ring_source(r, u, P);
        if (w.empty(r, src)) continue;
        ++slots[std::size_t(r)];
        const double dt = hw.transfer_seconds(src * stride, r * stride, double(kv));
        const double fin = std::max(out_free[std::size_t(src)], in_free[std::size_t(r)]) + dt;
        out_free[std::size_t(src)] = in_free[std::size_t(r)] = fin;
        next[std::size_t(src)] = std::max(next[std::size_t(src)], fin);
        next[std::size_t(r)] = std::max(next[std::size_t(r)], fin);
        StepPlan& a = first[std::size_t(src)];
        a.bytes_sent += kv;
        if (!hw.same_node(src * stride, r * stride)) a.network_bytes += kv;
        a.comm_s += dt;
        StepPlan& b = first[std::size_t(r)];
        b.bytes_received += kv;
        b.comm_s += dt;
      }
    for (int r = 0; r < P; ++r) {
      StepPlan& st = s == 0 ? first[std::size_t(r)] : now[std::size_t(r)];
      st.end_s = next[std::size_t(r)];
      if (s > 0) pr.ranks[std::size_t(r)].add(st, keep);
    }
    e.swap(next);
  }
  const ForwardBufferBytes bytes = buffer_bytes(p);
  for (int r = 0; r < P; ++r) {
    RankPlan& rp = pr.ranks[std::size_t(r)];
    rp.add(first[std::size_t(r)], false);
    if (keep) rp.steps.insert(rp.steps.begin(), first[std::size_t(r)]);
    pr.makespan_s = std::max(pr.makespan_s, e[std::size_t(r)]);
    ForwardSlots u;
    u.kv = slots[std::size_t(r)];
    rp.workspace_bytes = forward_workspace_bytes(u, bytes);
  }
}

/// allgather_model() where every block pair within the ring's reach has
/// work to gather (each rank sends and receives one block at every step),
/// no pair computes longer than the shortest transfer (so a rank ends every
/// step with transfers when its last transfer does) and the links repeat
/// with period p: the links' free times repeat with period p, so p ranks
/// carry them. The same numbers as the step-by-step loop; false when it does
/// not apply.
template <class Partition, class Mask>
bool allgather_fast(Prediction& pr, const Problem& p, const Hardware& hw,
                    const PairWork<Partition, Mask>& w, int S, int stride) {
  const int P = p.P, per = link_period(hw, P, stride);
  if (!w.has_rows() || !w.empty_tabled() || per <= 0) return false;
  for (int s = 1; s < S; ++s)
    if (w.empty(s, 0) || w.empty(0, P - s)) return false;  // by difference
  if (!w.by_difference())
    for (int x = 0; x < P; ++x)
      for (int y : {0, P - 1})
        if (w.empty(x, y)) return false;  // by sum: every q + k in 0 .. 2P - 2
  const std::int64_t kv = payload_bytes(p, Payload::kv);
  const double shortest = hw.ranks_per_node > 0
                              ? std::min(hw.transfer_seconds(0, 0, double(kv)),
                                         hw.transfer_seconds(0, hw.ranks_per_node, double(kv)))
                              : hw.transfer_seconds(0, 0, double(kv));
  if (S > 1 && pair_seconds_bound(p, hw) > shortest) return false;
  const std::size_t n = static_cast<std::size_t>(per);
  std::vector<double> out_free(n, 0.0), in_free(n, 0.0), out_next(n), in_next(n);
  std::vector<std::int64_t> network(n, 0);
  for (int u = 1; u < S; ++u) {  // completes at step u - 1
    for (int r = 0; r < per; ++r) {
      const int src = ring_source(r, u, P);
      const double fin = std::max(out_free[std::size_t(src % per)], in_free[std::size_t(r)]) +
                         hw.transfer_seconds(src * stride, r * stride, double(kv));
      out_next[std::size_t(src % per)] = in_next[std::size_t(r)] = fin;
      if (!hw.same_node(r * stride, (r + u) % P * stride)) network[std::size_t(r)] += kv;
    }
    out_free.swap(out_next);
    in_free.swap(in_next);
  }
  const ForwardBufferBytes bytes = buffer_bytes(p);
  ForwardSlots slots;
  slots.kv = S;
  const std::int64_t ws = forward_workspace_bytes(slots, bytes);
  for (int r = 0; r < P; ++r) {
    const int j = ring_source(r, S - 1, P);
    const double c = step_work(p, hw, {r, j}, w(r, j)).compute_s;
    const std::size_t i = std::size_t(r % per);
    const double end = S > 1 ? std::max(out_free[i], in_free[i]) + c : c;
    pr.makespan_s = std::max(pr.makespan_s, end);
    RankPlan& rp = pr.ranks[std::size_t(r)];
    ring_totals(rp, p, hw, w, r, S);
    rp.sent = std::int64_t(S - 1) * kv;
    rp.network = network[i];
    rp.workspace_bytes = ws;
  }
  return true;
}

/// AllGatherSchedule::Backward::step() in O(P) at step 0 and O(1) after:
/// `used` counts the K/V slots `rank` filled at steps 1 .. s - 1 (call it for
/// s = 0, 1, ... in turn); the description's slot() recounts them (O(s) per
/// call, O(P^3) over a prediction). A send's dst_slot (the receiver's slot,
/// which no count of the sender's buffers reads) is left 0.
inline void allgather_backward_step(const ScheduleContext& c, int rank, int s, int& used,
                                    BackwardStep& out) {
  const int P = c.P, j = AllGatherSchedule::source(rank, s, P);
  const int in = s == 0 ? 0 : c.empty(rank, j) ? -1 : ++used;
  if (in >= 0) {
    out.task = {rank, j};
    out.kv_slot = in;
    if (s > 0) out.dkv_slot = s % 2;
  }
  if (s == 0) {
    int n = 0;
    for (int t = 1; t < P; ++t) {
      const int from = AllGatherSchedule::source(rank, t, P), to = (rank + t) % P;
      if (!c.empty(rank, from))
        out.transfers.push_back({from, rank, Payload::kv, 0, 0, false, t - 1, 0, ++n});
      if (!c.empty(to, rank))
        out.transfers.push_back({rank, to, Payload::kv, 0, 0, false, t - 1, 0, 0});
    }
    return;
  }
  const int i = s % 2;
  if (in >= 0) out.transfers.push_back({rank, j, Payload::dkv, s, s, true, s + 1, i, i, -1});
  const int from = (rank + s) % P;  // uses our block at its step s
  if (!c.empty(from, rank))
    out.transfers.push_back({from, rank, Payload::dkv, s, s, true, s + 1, i, i, -1});
}

template <>
struct forward_model<AllGatherSchedule> {
  static constexpr bool available = true;
  template <class Partition, class Mask>
  static void run(Prediction& pr, const Problem& p, const Hardware& hw,
                  PairWork<Partition, Mask>& w, int rank_stride, bool keep_steps) {
    allgather_model(pr, p, hw, w, w.ring_reach() + 1, rank_stride, keep_steps);
  }
};

}  // namespace detail
}  // namespace plan
}  // namespace blockattn
