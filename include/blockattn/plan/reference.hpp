// SPDX-License-Identifier: Apache-2.0
// The planner's reference model: any schedule's description, step by step,
// every message in one list (predict() uses it for schedules it has no model
// of; the tests compare predict() with it).
#pragma once

#include <blockattn/plan/impl/passes.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace blockattn {
namespace plan {

/// The reference model of one partition x mask x schedule, for any schedule:
/// every rank's every step from the schedule's description (step()), every
/// message in one list, and an event simulation of them. Work per rank and
/// step comes from the kernels' tile classifier on the partition's global
/// positions; the timing simulation runs the steps as DistributedAttention
/// does: the transfers a step needs are posted at the start of the step
/// before and complete at its end, a rank's link sends and receives one
/// message at a time per direction, and a message starts when both sides
/// have posted it (messages ready at the same time go in the order the
/// schedule lists them). O(P x steps) memory and O(P^2 x steps) time for the
/// all-gather: predict() uses it for schedules it has no model of, the tests
/// compare predict() with it.
/// count_pairs: also count allowed pairs (cost ~ pairs of partial tiles).
/// rank_stride: rank r of the prediction is rank r x rank_stride of the
/// machine (HybridAttention's rings: the ranks of one member index).
template <class Partition, class Schedule, class Mask>
Prediction predict_reference(const Problem& problem, const Mask& mask, const Hardware& hw,
                             bool count_pairs = false, int rank_stride = 1) {
  Prediction pr;
  Problem p;
  if (auto invalid = detail::start_prediction<Partition, Schedule, Mask>(pr, problem, p))
    return std::move(*invalid);
  const int P = p.P;
  if constexpr (Schedule::template supports<Partition, Mask>)
    if (std::string why = Schedule::template can_implement<Partition>(mask, p.N, P); !why.empty())
      return detail::invalid(std::move(pr), std::move(why));
  const ScheduleContext ctx = schedule_context<Partition>(mask, p.N, P);
  const int steps = schedule_steps<Schedule>(ctx);
  std::vector<detail::Message> msgs;
  std::vector<std::int64_t> ws;
  detail::schedule_plan<Schedule>(p, ctx, msgs, ws);
  pr.ranks.resize(std::size_t(P));
  const std::int64_t inputs = detail::input_bytes(p, false);
  for (int r = 0; r < P; ++r) {
    RankPlan& rp = pr.ranks[std::size_t(r)];
    rp.input_bytes = inputs;
    rp.workspace_bytes = ws[std::size_t(r)];
    for (int s = 0; s < steps; ++s) {
      StepPlan st;
      st.task = schedule_task<Schedule>(ctx, r, s);
      st.tiles = task_work<Partition>(mask, p.N, P, st.task, p.block_q, p.block_k, count_pairs);
      st.flops =
          4.0 * double(st.tiles.computed()) * p.block_q * p.block_k * p.dim * p.batch * p.heads;
      st.compute_s = detail::tile_seconds(p, hw, st.tiles) + (st.idle() ? 0.0 : hw.step_overhead);
      rp.steps.push_back(st);
    }
  }
  // Timing: steps in order; a virtual last step holds what completes after the loop.
  const int total = steps + 1;
  std::vector<double> start(std::size_t(P) * total), cend(std::size_t(P) * total),
      end(std::size_t(P) * total);
  auto at = [&](std::vector<double>& v, int r, int s) -> double& {
    return v[std::size_t(r) * total + std::size_t(s)];
  };
  std::vector<double> out_free(std::size_t(P), 0.0), in_free(std::size_t(P), 0.0);
  for (int s = 0; s < total; ++s) {
    std::vector<double> done(std::size_t(P), 0.0);
    for (int r = 0; r < P; ++r) {
      at(start, r, s) = s == 0 ? 0.0 : at(end, r, s - 1);
      at(cend, r, s) =
          at(start, r, s) + (s < steps ? pr.ranks[std::size_t(r)].steps[s].compute_s : 0.0);
      done[std::size_t(r)] = at(cend, r, s);
    }
    std::vector<std::pair<double, const detail::Message*>> due;
    for (const auto& m : msgs)
      if (std::min(m.done_step, steps) == s) {
        const double src_post =
            m.after_compute ? at(cend, m.src, m.src_step) : at(start, m.src, m.src_step);
        due.push_back({std::max(src_post, at(start, m.dst, m.dst_step)), &m});
      }
    std::stable_sort(due.begin(), due.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [ready, m] : due) {
      const double dt =
          hw.transfer_seconds(m->src * rank_stride, m->dst * rank_stride, double(m->bytes));
      const double begin =
          std::max({ready, out_free[std::size_t(m->src)], in_free[std::size_t(m->dst)]});
      const double fin = begin + dt;
      out_free[std::size_t(m->src)] = in_free[std::size_t(m->dst)] = fin;
      done[std::size_t(m->src)] = std::max(done[std::size_t(m->src)], fin);
      done[std::size_t(m->dst)] = std::max(done[std::size_t(m->dst)], fin);
      const int step_src = std::min(m->src_step, steps - 1);
      auto& ss = pr.ranks[std::size_t(m->src)].steps[std::size_t(step_src)];
      ss.bytes_sent += m->bytes;
      if (!hw.same_node(m->src * rank_stride, m->dst * rank_stride)) ss.network_bytes += m->bytes;
      ss.comm_s += dt;
      auto& sd = pr.ranks[std::size_t(m->dst)].steps[std::size_t(std::min(m->dst_step, steps - 1))];
      sd.bytes_received += m->bytes;
      sd.comm_s += dt;
    }
    for (int r = 0; r < P; ++r) at(end, r, s) = done[std::size_t(r)];
  }
  for (int r = 0; r < P; ++r) {
    for (int s = 0; s < steps; ++s) {
      auto& st = pr.ranks[std::size_t(r)].steps[std::size_t(s)];
      st.start_s = at(start, r, s);
      st.end_s = s + 1 < steps ? at(end, r, s) : at(end, r, steps);
    }
    pr.makespan_s = std::max(pr.makespan_s, at(end, r, steps));
    RankPlan& rp = pr.ranks[std::size_t(r)];
    std::vector<StepPlan> kept;
    kept.swap(rp.steps);
    for (const StepPlan& st : kept) rp.add(st, true);
  }
  return detail::finished(std::move(pr), p, mask, hw);
}

}  // namespace plan
}  // namespace blockattn
