// SPDX-License-Identifier: Apache-2.0
// The balanced schedule (BalancedSchedule, DistFlashAttn) without a message
// list: its buffers in O(1) per rank, its steps and totals.
#pragma once

#include <blockattn/plan/impl/pair_work.hpp>
#include <blockattn/schedule/balanced.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace blockattn {
namespace plan {
namespace detail {

/// The buffers of `rank` in the balanced schedule (forward_slots() of
/// BalancedSchedule), in O(1): the steps at which it owns a remote pair
/// (1 .. min(rank, P / 2)), helps (rank + 1 .. (P - 1) / 2) and is helped
/// (P - rank .. (P - 1) / 2) decide its slots by their parity.
inline ForwardSlots balanced_slots(int rank, int P) {
  const int last = P / 2, help_last = (P - 1) / 2;
  const auto has_odd = [](int a, int b) { return b >= a && (a % 2 == 1 || b > a); };
  ForwardSlots u;
  if (std::min(rank, last) >= 1) u.kv = 3;  // slot 1 + t mod 2 from t = 1 on
  const int h0 = rank + 1;                  // helps at t = h0 .. help_last
  if (help_last >= h0) {
    u.q = has_odd(h0, help_last) ? 3 : 2;
    u.results_out = has_odd(h0, help_last) ? 2 : 1;
  }
  const int g0 = std::max(1, P - rank);  // helped at t = g0 .. help_last
  if (help_last >= g0) {
    u.q_copy = true;
    u.results_in = has_odd(g0, help_last) ? 2 : 1;
    u.merges = true;
  }
  return u;
}

/// balanced_model() for the totals only (no steps kept): the same
/// arithmetic on arrays, and the order on each link without sorting the
/// step's messages: a message waits for the message before it on its
/// sender's link and on its receiver's (ready time, then the reference's
/// list order), which may wait in turn.
template <class Partition, class Mask>
void balanced_totals(Prediction& pr, const Problem& p, const Hardware& hw,
                     const PairWork<Partition, Mask>& w, int stride) {
  const int P = p.P, T = balanced_steps(P);
  const std::size_t n = static_cast<std::size_t>(P);
  const std::int64_t kv = payload_bytes(p, Payload::kv), qb = payload_bytes(p, Payload::q),
                     res = payload_bytes(p, Payload::result);
  std::vector<double> start(n, 0.0), cend(n, 0.0), prev_start(n, 0.0), prev_cend(n, 0.0),
      out_free(n, 0.0), in_free(n, 0.0), done(n, 0.0), busy(n, 0.0);
  std::vector<int> idle(n, 0);
  // Per pair class (q - k, when PairWork tables them): compute time and whether it has work.
  std::vector<double> cost;
  std::vector<char> works;
  if (w.by_difference() && w.has_rows()) {
    cost.resize(2 * n - 1);
    works.resize(2 * n - 1);
    for (int d = 1 - P; d < P; ++d) {
      const TileCounts tiles = d >= 0 ? w(d, 0) : w(0, -d);
      works[std::size_t(d + P - 1)] = tiles.computed() > 0;
      cost[std::size_t(d + P - 1)] =
          tile_seconds(p, hw, tiles) + (tiles.computed() == 0 ? 0.0 : hw.step_overhead);
    }
  }
  // Links: node of each rank, and the time of each payload within and between nodes.
  std::vector<int> node(n, 0);
  if (hw.ranks_per_node > 0)
    for (int r = 0; r < P; ++r)
      node[std::size_t(r)] = int(std::int64_t(r) * stride / hw.ranks_per_node);
  const auto seconds = [&](std::int64_t bytes, bool near) {
    return hw.ranks_per_node > 0
               ? hw.transfer_seconds(0, near ? 0 : hw.ranks_per_node, double(bytes))
               : hw.transfer_seconds(0, 0, double(bytes));
  };
  const double t_kv[2] = {seconds(kv, false), seconds(kv, true)},
               t_q[2] = {seconds(qb, false), seconds(qb, true)},
               t_res[2] = {seconds(res, false), seconds(res, true)};
  std::vector<std::int64_t> sent(n, 0), network(n, 0);
  // Message 2r: rank r's result of step t - 1; 2r + 1: its input for step t + 1.
  std::vector<double> ready(2 * n), fin(2 * n), dt(2 * n);
  std::vector<int> dst(2 * n), stack;
  std::vector<char> has(2 * n), known(2 * n);
  for (int t = 0; t <= T; ++t) {
    const int u = t + 1, h = t - 1;  // inputs of step u; results of step h
    if (t < T && !cost.empty()) {
      // Pair classes: owners (r >= t) compute q - k = t, helpers (r < t,
      // 2t < P) q - k = P - t, the others nothing (balanced_task()).
      const std::size_t own = std::size_t(t + P - 1), help = std::size_t(2 * P - 1 - t);
      const bool helping = t > 0 && 2 * t < P;
      for (int r = 0; r < P; ++r) {
        const bool owner = r >= t;
        double c = 0;
        if (owner || helping) {
          const std::size_t d = owner ? own : help;
          c = cost[d];
          idle[std::size_t(r)] += works[d] ? 0 : 1;
          busy[std::size_t(r)] += c;
        } else {
          ++idle[std::size_t(r)];
        }
        cend[std::size_t(r)] = start[std::size_t(r)] + c;
        done[std::size_t(r)] = cend[std::size_t(r)];
      }
    } else
      for (int r = 0; r < P; ++r) {
        double c = 0;
        if (t < T) {
          const BlockTask task = balanced_task(r, t, P);
          if (task.idle()) {
            ++idle[std::size_t(r)];
          } else if (!cost.empty()) {
            const std::size_t d = std::size_t(task.q_rank - task.k_rank + P - 1);
            c = cost[d];
            if (!works[d]) ++idle[std::size_t(r)];
            busy[std::size_t(r)] += c;
          } else {
            const TileCounts tiles = w(task.q_rank, task.k_rank);
            c = tile_seconds(p, hw, tiles) + (tiles.computed() == 0 ? 0.0 : hw.step_overhead);
            if (tiles.computed() == 0) ++idle[std::size_t(r)];
            busy[std::size_t(r)] += c;
          }
        }
        cend[std::size_t(r)] = start[std::size_t(r)] + c;
        done[std::size_t(r)] = cend[std::size_t(r)];
      }
    const auto add = [&](std::size_t m, int from, int to, std::int64_t bytes, const double* time,
                         double at) {
      const bool near = hw.ranks_per_node > 0 && node[std::size_t(from)] == node[std::size_t(to)];
      has[m] = 1;
      known[m] = 0;
      dst[m] = to;
      ready[m] = at;
      dt[m] = time[near ? 1 : 0];
      sent[std::size_t(from)] += bytes;
      if (!near) network[std::size_t(from)] += bytes;
    };
    for (int r = 0; r < P; ++r) {
      const std::size_t m = 2 * std::size_t(r);
      has[m] = has[m + 1] = 0;
      if (h >= 1 && r < h && 2 * h < P) {  // it helped rank r - h + P at step h
        const int q = r - h + P;
        add(m, r, q, res, t_res, std::max(prev_cend[std::size_t(r)], prev_start[std::size_t(q)]));
      }
      if (t < T && u < T) {
        const int to = r + u < P ? r + u : balanced_helper_of(r, u, P);
        if (to >= 0)
          add(m + 1, r, to, r + u < P ? kv : qb, r + u < P ? t_kv : t_q,
              std::max(start[std::size_t(r)], start[std::size_t(to)]));
      }
    }
    // The other message on the receiving link of message m, or -1.
    const auto in_partner = [&](std::size_t m) -> long {
      const int x = dst[m];
      if (m % 2 == 1) {  // an input into x; a result comes from x + h - P
        const int from = x + h - P;
        return h >= 1 && 2 * h < P && from >= 0 && from < h ? long(2 * from) : -1L;
      }
      const int from = x >= u ? x - u : (2 * u < P ? x - u + P : -1);  // the input into x
      return from >= 0 && u < T && has[2 * std::size_t(from) + 1] ? long(2 * from + 1) : -1L;
    };
    const auto before = [&](std::size_t a, std::size_t b) {  // a is taken before b
      return ready[a] < ready[b] || (ready[a] == ready[b] && a < b);
    };
    for (std::size_t m0 = 0; m0 < 2 * n; ++m0) {
      if (!has[m0] || known[m0]) continue;
      {  // most messages share no link with an earlier one
        const std::size_t other = m0 ^ 1;
        const long pin = in_partner(m0);
        if (!(has[other] && before(other, m0)) && !(pin >= 0 && before(std::size_t(pin), m0))) {
          fin[m0] = std::max({ready[m0], out_free[m0 / 2], in_free[std::size_t(dst[m0])]}) + dt[m0];
          known[m0] = 1;
          continue;
        }
      }
      stack.clear();
      stack.push_back(int(m0));
      while (!stack.empty()) {
        const std::size_t m = std::size_t(stack.back());
        const std::size_t src = m / 2;
        const std::size_t other = m ^ 1;
        const long pin = in_partner(m);
        const bool wait_out = has[other] && before(other, m);
        const bool wait_in = pin >= 0 && before(std::size_t(pin), m);
        if (wait_out && !known[other]) {
          stack.push_back(int(other));
          continue;
        }
        if (wait_in && !known[std::size_t(pin)]) {
          stack.push_back(int(pin));
          continue;
        }
        const double link_out = wait_out ? fin[other] : out_free[src];
        const double link_in = wait_in ? fin[std::size_t(pin)] : in_free[std::size_t(dst[m])];
        fin[m] = std::max({ready[m], link_out, link_in}) + dt[m];
        known[m] = 1;
        stack.pop_back();
      }
    }
    for (std::size_t m = 0; m < 2 * n; ++m) {
      if (!has[m]) continue;
      const std::size_t src = m / 2, to = std::size_t(dst[m]);
      out_free[src] = std::max(out_free[src], fin[m]);
      in_free[to] = std::max(in_free[to], fin[m]);
      done[src] = std::max(done[src], fin[m]);
      done[to] = std::max(done[to], fin[m]);
    }
    prev_start.swap(start);
    prev_cend.swap(cend);
    start.swap(done);  // done is set afresh at the next step
  }
  const ForwardBufferBytes bytes = buffer_bytes(p);
  for (int r = 0; r < P; ++r) {
    RankPlan& rp = pr.ranks[std::size_t(r)];
    rp.step_count = T;
    rp.idle_step_count = idle[std::size_t(r)];
    rp.compute_s = busy[std::size_t(r)];
    rp.sent = sent[std::size_t(r)];
    rp.network = network[std::size_t(r)];
    rp.workspace_bytes = forward_workspace_bytes(balanced_slots(r, P), bytes);
    pr.makespan_s = std::max(pr.makespan_s, start[std::size_t(r)]);
  }
}

/// The balanced forward (BalancedSchedule) without a message list: at step
/// t the inputs of step t + 1 (a K/V block to an owner, a Q block to a
/// helper; posted at the start of step t by both ends) and the results of
/// step t - 1 (posted by the helper after its compute) complete. A rank may
/// send (and receive) two of them in one step: on each link they go in the
/// order predict_reference() takes them (ready time, then the schedule's
/// order), one at a time.
template <class Partition, class Mask>
void balanced_model(Prediction& pr, const Problem& p, const Hardware& hw,
                    PairWork<Partition, Mask>& w, int stride, bool keep) {
  const int P = p.P, T = balanced_steps(P);
  const std::int64_t kv = payload_bytes(p, Payload::kv), qb = payload_bytes(p, Payload::q),
                     res = payload_bytes(p, Payload::result);
  struct Msg {
    int src, dst;
    std::int64_t bytes;
    double ready, fin;
    int src_step, dst_step;
  };
  std::vector<double> start(std::size_t(P), 0.0), cend(static_cast<std::size_t>(P)),
      done(static_cast<std::size_t>(P));
  std::vector<double> prev_start(std::size_t(P), 0.0), prev_cend(std::size_t(P), 0.0);
  std::vector<double> out_free(std::size_t(P), 0.0), in_free(std::size_t(P), 0.0);
  std::vector<StepPlan> cur(static_cast<std::size_t>(P)), last(static_cast<std::size_t>(P));
  std::vector<Msg> msgs;
  std::vector<int> order;
  for (int t = 0; t <= T; ++t) {  // t == T: what completes after the last step
    for (int r = 0; r < P; ++r) {
      if (t < T) {
        const BlockTask task = balanced_task(r, t, P);
        cur[std::size_t(r)] = task.idle() ? step_work(p, hw, {}, {})
                                          : step_work(p, hw, task, w(task.q_rank, task.k_rank));
      } else {
        cur[std::size_t(r)] = StepPlan{};
      }
      cend[std::size_t(r)] = start[std::size_t(r)] + cur[std::size_t(r)].compute_s;
      done[std::size_t(r)] = cend[std::size_t(r)];
    }
    // Due now, in the reference's list order (by sender, then step).
    msgs.clear();
    const int u = t + 1;
    for (int r = 0; r < P; ++r) {
      if (t >= 1) {  // the result of step t - 1 to the rank it helped
        const BlockTask task = balanced_task(r, t - 1, P);
        if (!task.idle() && task.q_rank != r)
          msgs.push_back({r, task.q_rank, res,
                          std::max(prev_cend[std::size_t(r)], prev_start[std::size_t(task.q_rank)]),
                          0.0, t - 1, t - 1});
      }
      if (t < T && u < T) {  // an input of step u
        int to = -1;
        std::int64_t bytes = 0;
        if (r + u < P)
          to = r + u, bytes = kv;
        else if (const int h = balanced_helper_of(r, u, P); h >= 0)
          to = h, bytes = qb;
        if (to >= 0)
          msgs.push_back(
              {r, to, bytes, std::max(start[std::size_t(r)], start[std::size_t(to)]), 0.0, t, t});
      }
    }
    order.resize(msgs.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = int(i);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return msgs[std::size_t(a)].ready < msgs[std::size_t(b)].ready;
    });
    for (int i : order) {
      Msg& m = msgs[std::size_t(i)];
      const double dt = hw.transfer_seconds(m.src * stride, m.dst * stride, double(m.bytes));
      m.fin = std::max({m.ready, out_free[std::size_t(m.src)], in_free[std::size_t(m.dst)]}) + dt;
      out_free[std::size_t(m.src)] = in_free[std::size_t(m.dst)] = m.fin;
      done[std::size_t(m.src)] = std::max(done[std::size_t(m.src)], m.fin);
      done[std::size_t(m.dst)] = std::max(done[std::size_t(m.dst)], m.fin);
      StepPlan& a =
          std::min(m.src_step, T - 1) == t ? cur[std::size_t(m.src)] : last[std::size_t(m.src)];
      a.bytes_sent += m.bytes;
      if (!hw.same_node(m.src * stride, m.dst * stride)) a.network_bytes += m.bytes;
      a.comm_s += dt;
      StepPlan& b =
          std::min(m.dst_step, T - 1) == t ? cur[std::size_t(m.dst)] : last[std::size_t(m.dst)];
      b.bytes_received += m.bytes;
      b.comm_s += dt;
    }
    // Step t - 1 is complete (results of step t - 1 land in it): record it.
    for (int r = 0; r < P; ++r) {
      if (t >= 1) pr.ranks[std::size_t(r)].add(last[std::size_t(r)], keep);
      cur[std::size_t(r)].start_s = start[std::size_t(r)];
      cur[std::size_t(r)].end_s = done[std::size_t(r)];
      if (t >= 1 && keep) {
        // The last step ends where the virtual step after it does.
        if (t == T) pr.ranks[std::size_t(r)].steps.back().end_s = done[std::size_t(r)];
      }
      last[std::size_t(r)] = cur[std::size_t(r)];
      prev_start[std::size_t(r)] = start[std::size_t(r)];
      prev_cend[std::size_t(r)] = cend[std::size_t(r)];
      start[std::size_t(r)] = done[std::size_t(r)];
    }
  }
  const ForwardBufferBytes bytes = buffer_bytes(p);
  for (int r = 0; r < P; ++r) {
    pr.makespan_s = std::max(pr.makespan_s, start[std::size_t(r)]);
    pr.ranks[std::size_t(r)].workspace_bytes = forward_workspace_bytes(balanced_slots(r, P), bytes);
  }
}

template <>
struct forward_model<BalancedSchedule> {
  static constexpr bool available = true;
  template <class Partition, class Mask>
  static void run(Prediction& pr, const Problem& p, const Hardware& hw,
                  PairWork<Partition, Mask>& w, int rank_stride, bool keep_steps) {
    if (keep_steps)
      balanced_model(pr, p, hw, w, rank_stride, true);
    else
      balanced_totals(pr, p, hw, w, rank_stride);
  }
};

}  // namespace detail
}  // namespace plan
}  // namespace blockattn
