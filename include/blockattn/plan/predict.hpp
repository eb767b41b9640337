// SPDX-License-Identifier: Apache-2.0
// predict(): one partition x mask x schedule, forward, backward or training,
// on the schedule's model (plan/models/) or the reference.
#pragma once

#include <blockattn/plan/backward.hpp>
#include <blockattn/plan/impl/passes.hpp>
#include <blockattn/plan/models/allgather.hpp>
#include <blockattn/plan/models/balanced.hpp>
#include <blockattn/plan/models/ring.hpp>
#include <blockattn/plan/reference.hpp>

#include <cstdint>
#include <string>
#include <utility>

namespace blockattn {
namespace plan {

/// Predicts one partition x mask x schedule: per rank and step the block
/// pair, its tiles (the kernels' classifier), the messages of the schedule's
/// description and their timing, as predict_reference() does, in O(P)
/// memory (O(P x steps) with keep_steps) and O(P x steps) time for the
/// schedules with a model (plan/models/: the KV ring, the all-gather, the
/// balanced schedule; detail::forward_model),
/// with the tiles of a block pair computed once per class of pairs where the
/// layout repeats (detail::PairWork). Other schedules go to
/// predict_reference(). count_pairs: also count allowed pairs (cost ~ pairs
/// of partial tiles). rank_stride: rank r of the prediction is rank r x
/// rank_stride of the machine (HybridAttention's rings: the ranks of one
/// member index). keep_steps: keep RankPlan::steps (else only the totals).
/// Problem::pass: backward goes to predict_backward(), training adds the
/// forward and the backward (detail::training()).
template <class Partition, class Schedule, class Mask>
Prediction predict(const Problem& problem, const Mask& mask, const Hardware& hw,
                   bool count_pairs = false, int rank_stride = 1, bool keep_steps = true) {
  if (problem.pass != Pass::forward) {
    Problem b = problem;
    b.pass = Pass::backward;
    Prediction back =
        predict_backward<Partition, Schedule>(b, mask, hw, count_pairs, rank_stride, keep_steps);
    if (problem.pass == Pass::backward) return back;
    Problem f = problem;
    f.pass = Pass::forward;
    return detail::training(
        predict<Partition, Schedule>(f, mask, hw, count_pairs, rank_stride, keep_steps), back);
  }
  if constexpr (!detail::forward_model<Schedule>::available) {
    return predict_reference<Partition, Schedule>(problem, mask, hw, count_pairs, rank_stride);
  } else {
    Prediction pr;
    Problem p;
    if (auto invalid = detail::start_prediction<Partition, Schedule, Mask>(pr, problem, p))
      return std::move(*invalid);
    const int P = p.P;
    detail::PairWork<Partition, Mask> w(mask, p.N, P, p.block_q, p.block_k, count_pairs);
    if (std::string why = detail::implement_why_not<Partition, Schedule>(mask, p.N, P, w);
        !why.empty())
      return detail::invalid(std::move(pr), std::move(why));
    pr.ranks.resize(std::size_t(P));
    const std::int64_t inputs = detail::input_bytes(p, false);
    for (auto& rp : pr.ranks) rp.input_bytes = inputs;
    detail::forward_model<Schedule>::run(pr, p, hw, w, rank_stride, keep_steps);
    return detail::finished(std::move(pr), p, mask, hw);
  }
}

}  // namespace plan
}  // namespace blockattn
