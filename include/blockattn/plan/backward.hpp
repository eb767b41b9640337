// SPDX-License-Identifier: Apache-2.0
// The planner's backward: the steps of a schedule's backward description,
// their tiles, messages, workspace and timing.
#pragma once

#include <blockattn/plan/impl/passes.hpp>
#include <blockattn/plan/models/allgather.hpp>
#include <blockattn/plan/models/balanced.hpp>
#include <blockattn/plan/models/ring.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace blockattn {
namespace plan {

/// Predicts the backward of one partition x mask x schedule: the steps of
/// the schedule's backward description (Schedule::backward_type) with their
/// tiles at the backward kernels' tile sizes (Problem::bwd_block_q, _k),
/// priced at 10 D FLOPs per pair (Hardware::backward_rate()), its messages
/// (K/V blocks, packed query blocks, dQ and dK/dV partials at the sizes the
/// run sends) and workspace (backward_workspace_bytes(), RunStats'), timed as
/// predict_reference() times a forward: a message starts when both sides have
/// posted it and its links are free, in the order of readiness (ties: by
/// step, then rank). Generated step by step: O(P) memory besides the steps
/// kept (keep_steps) and, for a schedule other than the built-in ones, the
/// history of step starts (O(P x steps) doubles).
template <class Partition, class Schedule, class Mask>
Prediction predict_backward(const Problem& problem, const Mask& mask, const Hardware& hw,
                            bool count_pairs = false, int rank_stride = 1, bool keep_steps = true) {
  using B = typename Schedule::backward_type;
  Prediction pr;
  Problem p;
  if (auto invalid = detail::start_prediction<Partition, Schedule, Mask>(pr, problem, p))
    return std::move(*invalid);
  const int P = p.P;
  const int bq = p.backward_block_q(), bk = p.backward_block_k();
  detail::PairWork<Partition, Mask> w(mask, p.N, P, bq, bk, count_pairs);
  if (std::string why = detail::implement_why_not<Partition, Schedule>(mask, p.N, P, w);
      !why.empty())
    return detail::invalid(std::move(pr), std::move(why));
  ScheduleContext ctx;
  ctx.P = P;
  ctx.empty_pair = [&w](int q_rank, int k_rank) { return w.empty(q_rank, k_rank); };
  ctx.reach = w.ring_reach();
  const int steps = B::steps(ctx), total = steps + 1;
  pr.ranks.resize(std::size_t(P));
  const std::int64_t inputs = detail::input_bytes(p, true);
  const double pair_flops = 10.0 * bq * bk * p.dim * double(p.batch) * p.heads;
  // A message waits in the bucket of the step that completes it; its
  // receiver's post time (the start of dst_step) is filled in once that step
  // has started on every rank. The built-in descriptions post no receive
  // before the step that sends it, except the all-gather's at step 0 (whose
  // start is 0): they need no history of step starts. Other descriptions
  // keep it (P x steps doubles).
  constexpr bool gather = std::is_same<Schedule, AllGatherSchedule>::value;
  constexpr bool builtin = detail::forward_model<Schedule>::available;
  struct Pending {
    int src, dst, src_step, dst_step;
    std::int64_t bytes;
    double src_post, dst_post;
  };
  std::vector<std::vector<Pending>> due(static_cast<std::size_t>(total));
  std::vector<std::vector<std::pair<int, std::size_t>>> unresolved(static_cast<std::size_t>(total));
  std::vector<double> history(builtin ? 0 : std::size_t(P) * std::size_t(total), 0.0),
      done(std::size_t(P), 0.0), row(std::size_t(P), 0.0), out_free(std::size_t(P), 0.0),
      in_free(std::size_t(P), 0.0);  // row: the starts of the current step
  std::vector<BackwardSlots> slots(static_cast<std::size_t>(P));
  std::vector<int> used(gather ? std::size_t(P) : 0, 0);  // the all-gather's K/V slots so far
  std::vector<std::pair<double, const Pending*>> ready;
  std::vector<Pending> gathered;
  BackwardStep f;
  for (auto& rp : pr.ranks) {
    rp.input_bytes = inputs;
    if (keep_steps) rp.steps.reserve(std::size_t(steps));
  }
  const std::int64_t kv_bytes = detail::backward_payload_bytes(p, Payload::kv);
  for (int s = 0; s < total; ++s) {
    for (int r = 0; r < P; ++r) {
      RankPlan& rp = pr.ranks[std::size_t(r)];
      const double t0 = done[std::size_t(r)];  // the end of step s - 1 (0 at the start)
      row[std::size_t(r)] = t0;
      if (!builtin) history[std::size_t(r) * total + std::size_t(s)] = t0;
      if (s == steps) continue;
      f.clear();
      if constexpr (gather)
        detail::allgather_backward_step(ctx, r, s, used[std::size_t(r)], f);
      else
        B::step(ctx, r, s, f);
      add_backward_slots(slots[std::size_t(r)], f, r, s);
      StepPlan st;
      st.task = f.task;
      if (!f.task.idle()) st.tiles = w(f.task.q_rank, f.task.k_rank);
      st.flops = pair_flops * double(st.tiles.computed());
      st.compute_s =
          detail::backward_tile_seconds(p, hw, st.tiles) + (st.idle() ? 0.0 : hw.step_overhead);
      st.start_s = t0;
      done[std::size_t(r)] = t0 + st.compute_s;
      for (const ScheduledTransfer& t : f.transfers) {
        if (t.src != r || t.src_step != s) continue;
        if (gather && t.payload == Payload::kv) continue;  // generated when due (below)
        auto& bucket = due[std::size_t(std::min(t.done_step, steps))];
        Pending m{t.src,
                  t.dst,
                  t.src_step,
                  t.dst_step,
                  detail::backward_payload_bytes(p, t.payload),
                  t.after_compute ? done[std::size_t(r)] : t0,
                  0.0};
        if (t.dst_step >= s)
          unresolved[std::size_t(t.dst_step)].push_back(
              {std::min(t.done_step, steps), bucket.size()});
        else if (!builtin)
          m.dst_post = history[std::size_t(t.dst) * total + std::size_t(t.dst_step)];
        bucket.push_back(m);
      }
      ++rp.step_count;
      rp.idle_step_count += st.idle() ? 1 : 0;
      rp.compute_s += st.compute_s;
      if (keep_steps) rp.steps.push_back(st);
    }
    // Step s has started everywhere: the receivers' post times of step s.
    for (const auto& [b, i] : unresolved[std::size_t(s)]) {
      Pending& m = due[std::size_t(b)][i];
      m.dst_post = row[std::size_t(m.dst)];
    }
    std::vector<std::pair<int, std::size_t>>().swap(unresolved[std::size_t(s)]);
    // The all-gather's K/V of step s + 1, posted by both sides at step 0 (in
    // the order its description lists them: by sender), completed by step s.
    if constexpr (gather) {
      gathered.clear();
      if (s + 1 < steps)
        for (int r = 0; r < P; ++r) {
          const int to = (r + s + 1) % P;  // AllGatherSchedule::source(to, s + 1) == r
          if (!ctx.empty(to, r)) gathered.push_back({r, to, 0, 0, kv_bytes, 0.0, 0.0});
        }
      auto& bucket = due[std::size_t(s)];
      bucket.insert(bucket.begin(), gathered.begin(), gathered.end());
    }
    ready.clear();
    for (const Pending& m : due[std::size_t(s)])
      ready.push_back({std::max(m.src_post, m.dst_post), &m});
    std::stable_sort(ready.begin(), ready.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [at, m] : ready) {
      const std::size_t a = std::size_t(m->src), b = std::size_t(m->dst);
      const bool net = !hw.same_node(m->src * rank_stride, m->dst * rank_stride);
      const double dt =
          hw.transfer_seconds(m->src * rank_stride, m->dst * rank_stride, double(m->bytes));
      const double fin = std::max({at, out_free[a], in_free[b]}) + dt;
      out_free[a] = in_free[b] = fin;
      done[a] = std::max(done[a], fin);
      done[b] = std::max(done[b], fin);
      RankPlan &ra = pr.ranks[a], &rb = pr.ranks[b];
      ra.sent += m->bytes;
      ra.network += net ? m->bytes : 0;
      if (keep_steps && steps > 0) {
        StepPlan& x = ra.steps[std::size_t(std::min(m->src_step, steps - 1))];
        x.bytes_sent += m->bytes;
        x.network_bytes += net ? m->bytes : 0;
        x.comm_s += dt;
        StepPlan& y = rb.steps[std::size_t(std::min(m->dst_step, steps - 1))];
        y.bytes_received += m->bytes;
        y.comm_s += dt;
      }
    }
    std::vector<Pending>().swap(due[std::size_t(s)]);
    // Step s ends here; the last one with what completes after the loop.
    if (keep_steps && steps > 0 && s != steps - 1)
      for (int r = 0; r < P; ++r)
        pr.ranks[std::size_t(r)].steps[std::size_t(std::min(s, steps - 1))].end_s =
            done[std::size_t(r)];
  }
  for (int r = 0; r < P; ++r) {
    RankPlan& rp = pr.ranks[std::size_t(r)];
    rp.workspace_bytes = backward_workspace_bytes(
        slots[std::size_t(r)],
        detail::backward_buffer_bytes(p, local_length<Partition>(p.N, P, r)));
    pr.makespan_s = std::max(pr.makespan_s, done[std::size_t(r)]);
  }
  return detail::finished(std::move(pr), p, mask, hw);
}

}  // namespace plan
}  // namespace blockattn
