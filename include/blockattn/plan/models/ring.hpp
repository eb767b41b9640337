// SPDX-License-Identifier: Apache-2.0
// The KV ring's forward (RingSchedule, BurstSchedule) without a message list:
// O(P) memory, and O(1) per rank where the links repeat.
#pragma once

#include <blockattn/plan/impl/pair_work.hpp>
#include <blockattn/schedule/ring.hpp>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace blockattn {
namespace plan {
namespace detail {

/// Sets the totals of rank r over a ring of S steps from its row totals.
template <class Partition, class Mask>
void ring_totals(RankPlan& rp, const Problem& p, const Hardware& hw,
                 const PairWork<Partition, Mask>& w, int r, int S) {
  const RowTotals t = w.rows(r, S);
  rp.step_count = S;
  rp.idle_step_count = int(S - t.busy_steps);
  rp.compute_s = tile_seconds(p, hw, t.tiles) + double(t.busy_steps) * hw.step_overhead;
}

/// ring_model() where the links bound every step (no pair computes longer
/// than the shorter of a rank's two transfers, so compute never decides an
/// end) and the links repeat with period p: the ends of the steps with
/// transfers repeat with period p too, so p ranks carry them; the last step
/// (compute only) and the totals (PairWork::rows) take O(1) per rank. The
/// same numbers as the step-by-step loop; false when it does not apply.
template <class Partition, class Mask>
bool ring_fast(Prediction& pr, const Problem& p, const Hardware& hw,
               const PairWork<Partition, Mask>& w, int S, int stride) {
  const int P = p.P, per = link_period(hw, P, stride);
  if (!w.has_rows() || per <= 0) return false;
  const std::int64_t kv = payload_bytes(p, Payload::kv);
  std::vector<double> out(static_cast<std::size_t>(per)), e(static_cast<std::size_t>(per), 0.0),
      next(static_cast<std::size_t>(per));
  for (int r = 0; r < per; ++r)
    out[std::size_t(r)] = hw.transfer_seconds(r * stride, (r + 1) % P * stride, double(kv));
  const double bound = pair_seconds_bound(p, hw);
  if (S > 1)
    for (int r = 0; r < per; ++r)
      if (bound > std::max(out[std::size_t(r)], out[std::size_t((r + per - 1) % per)]))
        return false;
  for (int s = 0; s + 1 < S; ++s) {
    for (int r = 0; r < per; ++r) {
      const std::size_t i = std::size_t(r), up = std::size_t((r + 1) % per),
                        down = std::size_t((r + per - 1) % per);
      next[i] = std::max(std::max(e[i], e[up]) + out[i], std::max(e[down], e[i]) + out[down]);
    }
    e.swap(next);
  }
  for (int r = 0; r < P; ++r) {
    const int j = ring_source(r, S - 1, P);
    const double end = e[std::size_t(r % per)] + step_work(p, hw, {r, j}, w(r, j)).compute_s;
    pr.makespan_s = std::max(pr.makespan_s, end);
    RankPlan& rp = pr.ranks[std::size_t(r)];
    ring_totals(rp, p, hw, w, r, S);
    rp.sent = std::int64_t(S - 1) * kv;
    rp.network = hw.same_node(r * stride, (r + 1) % P * stride) ? 0 : rp.sent;
  }
  return true;
}

/// The KV ring forward (RingSchedule, BurstSchedule) without a message list:
/// every step, each rank sends one K/V block to the next and receives one
/// from the previous, posted by both at the start of the step; the links
/// carry one message each per step, so a transfer starts when both ends have
/// started the step, and rank r ends step s at
///   max(start + compute, max(start, start of r + 1) + link r -> r + 1,
///       max(start of r - 1, start) + link r - 1 -> r).
/// The same numbers as predict_reference() in O(P) memory.
template <class Partition, class Mask>
void ring_model(Prediction& pr, const Problem& p, const Hardware& hw, PairWork<Partition, Mask>& w,
                int S, int stride, bool keep) {
  const int P = p.P;
  const std::int64_t kv = payload_bytes(p, Payload::kv);
  if (!keep && ring_fast(pr, p, hw, w, S, stride)) return;
  std::vector<double> e(std::size_t(P), 0.0), next(std::size_t(P), 0.0),
      out(static_cast<std::size_t>(P));
  std::vector<char> remote(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) {
    const int to = (r + 1) % P;
    out[std::size_t(r)] = hw.transfer_seconds(r * stride, to * stride, double(kv));
    remote[std::size_t(r)] = !hw.same_node(r * stride, to * stride);
  }
  for (int s = 0; s < S; ++s) {
    const bool send = s + 1 < S;
    for (int r = 0; r < P; ++r) {
      const int prev = (r + P - 1) % P, to = (r + 1) % P;
      const double start = e[std::size_t(r)];
      StepPlan st = step_work(p, hw, {r, ring_source(r, s, P)}, w(r, ring_source(r, s, P)));
      double end = start + st.compute_s;
      if (send) {
        const double dout = out[std::size_t(r)], din = out[std::size_t(prev)];
        end = std::max({end, std::max(start, e[std::size_t(to)]) + dout,
                        std::max(e[std::size_t(prev)], start) + din});
        st.bytes_sent = st.bytes_received = kv;
        st.network_bytes = remote[std::size_t(r)] ? kv : 0;
        st.comm_s = dout + din;
      }
      st.start_s = start;
      st.end_s = end;
      next[std::size_t(r)] = end;
      pr.ranks[std::size_t(r)].add(st, keep);
    }
    e.swap(next);
  }
  for (int r = 0; r < P; ++r) pr.makespan_s = std::max(pr.makespan_s, e[std::size_t(r)]);
}

/// The KV ring's forward (RingSchedule and BurstSchedule, whose forwards are one).
template <class Schedule>
struct forward_model<Schedule, std::enable_if_t<impl::is_kv_ring_forward<Schedule>::value>> {
  static constexpr bool available = true;
  template <class Partition, class Mask>
  static void run(Prediction& pr, const Problem& p, const Hardware& hw,
                  PairWork<Partition, Mask>& w, int rank_stride, bool keep_steps) {
    const int S = w.ring_reach() + 1;
    ring_model(pr, p, hw, w, S, rank_stride, keep_steps);
    ScheduleContext c{p.P, {}};
    c.reach = S - 1;
    const std::int64_t ws = forward_workspace_bytes(forward_slots<Schedule>(c, 0), buffer_bytes(p));
    for (auto& rp : pr.ranks) rp.workspace_bytes = ws;
  }
};

}  // namespace detail
}  // namespace plan
}  // namespace blockattn
