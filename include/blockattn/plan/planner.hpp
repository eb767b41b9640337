// SPDX-License-Identifier: Apache-2.0
// Cost model and planner for the distributed forward, backward and training
// step (Problem::pass; predict_backward for the backward): per rank and step, the
// tiles the kernels compute (the kernels' own classifier, so the counts are
// exact), the messages the schedule sends (the same sizes the run sends), and
// a timing simulation of the double-buffered steps on given hardware (compute
// rate F, link bandwidth B and latency). It predicts makespan, idle fraction,
// bytes moved and peak memory per rank for any partition x mask x schedule,
// and recommends the fastest combination that fits in memory.
//
//   plan::Problem pb = plan::problem_for<float, Kokkos::DefaultExecutionSpace>(N, P, batch, heads,
//                                             kv_heads, dim);
//   auto all = plan::compare(pb, CausalMask{}, plan::a100_nvlink());
//   const plan::Prediction& best = all[plan::recommend(all)];
//
// Host only; no Kokkos kernels run here (calibration is the caller's: see
// tools/plan.cpp).
//
// The model is in pieces: plan/impl/ (the simulation core, a pair's work,
// the backward's costs), plan/models/ (one fast model per schedule family:
// ring, all-gather, balanced), plan/reference.hpp (any description, step by
// step), plan/backward.hpp, plan/predict.hpp, plan/head_parallel.hpp
// (Ulysses, the hybrid); this header lists the built-in candidates once and
// compares them.
#pragma once

#include <blockattn/plan/head_parallel.hpp>
#include <blockattn/plan/predict.hpp>

#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace blockattn {
namespace plan {

/// The distributed schedules the planner knows, written once: compare()
/// plans their candidates (schedule_candidates), the tests cross them with
/// builtin_partitions, the CLI prints what compare() returns.
using builtin_schedules =
    std::tuple<RingSchedule, BurstSchedule, BalancedSchedule, AllGatherSchedule>;
/// The built-in partitions (every one runs under the KV ring).
using builtin_partitions = std::tuple<ContiguousPartition, StripedPartition, ZigzagPartition>;

/// The partitions compare() pairs a schedule with, and when it is a
/// candidate (`applies(pass, full_mask)`).
template <class Schedule>
struct schedule_candidates;
/// The KV ring on every built-in layout.
template <>
struct schedule_candidates<RingSchedule> {
  using partitions = builtin_partitions;
  static bool applies(Pass, bool) { return true; }
};
/// The Q ring: its forward is the KV ring's; its backward moves the queries.
template <>
struct schedule_candidates<BurstSchedule> {
  using partitions = std::tuple<ZigzagPartition>;
  static bool applies(Pass pass, bool) { return pass != Pass::forward; }
};
/// DistFlashAttn's balance of a contiguous layout's causal work.
template <>
struct schedule_candidates<BalancedSchedule> {
  using partitions = std::tuple<ContiguousPartition>;
  static bool applies(Pass, bool full_mask) { return !full_mask; }
};
/// Llama 3's layout.
template <>
struct schedule_candidates<AllGatherSchedule> {
  using partitions = std::tuple<ZigzagPartition>;
  static bool applies(Pass, bool) { return true; }
};

/// f(partition, schedule) (default-constructed tags) for every element of
/// the type lists' product Partitions x Schedules (std::tuple of types).
template <class Partitions, class Schedules, class F>
void for_each_pair(F&& f) {
  const auto row = [&](auto schedule) {
    std::apply([&](auto... partitions) { (f(partitions, schedule), ...); }, Partitions{});
  };
  std::apply([&](auto... schedules) { (row(schedules), ...); }, Schedules{});
}

/// Every built-in combination for this mask: each schedule of
/// builtin_schedules with the partitions and under the conditions of
/// schedule_candidates (the KV ring on contiguous, striped and zigzag; the Q
/// ring on zigzag when p.pass has a backward; the balanced schedule on
/// contiguous for masks other than full; the all-gather on zigzag), the
/// head-parallel all-to-all (Ulysses; invalid when P does not divide the
/// heads), and on two-level hardware (ranks_per_node > 0) the 2D hybrid for
/// every group size 1 < P_a < P that divides P and the heads, last. The first
/// entry is the contiguous ring, the baseline of speedup_over_ring().
template <class Mask>
std::vector<Prediction> compare(const Problem& p, const Mask& mask, const Hardware& hw,
                                bool count_pairs = false, bool keep_steps = true) {
  std::vector<Prediction> all;
  std::apply(
      [&](auto... schedules) {
        const auto one = [&](auto schedule) {
          using S = decltype(schedule);
          if (!schedule_candidates<S>::applies(p.pass, std::is_same<Mask, FullMask>::value)) return;
          for_each_pair<typename schedule_candidates<S>::partitions, std::tuple<S>>(
              [&](auto part, auto) {
                all.push_back(predict<decltype(part), S>(p, mask, hw, count_pairs, 1, keep_steps));
              });
        };
        (one(schedules), ...);
      },
      builtin_schedules{});
  all.push_back(predict_ulysses<ContiguousPartition>(p, mask, hw, count_pairs));
  // Two-level hardware: the 2D hybrid on every grid whose groups split the
  // heads (zigzag ring across groups; contiguous for the full mask, whose
  // work is even on any layout).
  if (hw.ranks_per_node > 0)
    for (int a = 2; a < p.P; ++a) {
      if (p.P % a != 0 || !UlyssesHeads::why_not(p.heads, p.kv_heads, a).empty()) continue;
      if constexpr (std::is_same<Mask, FullMask>::value)
        all.push_back(predict_hybrid<ContiguousPartition, RingSchedule>(p, mask, hw, a, count_pairs,
                                                                        keep_steps));
      else
        all.push_back(
            predict_hybrid<ZigzagPartition, RingSchedule>(p, mask, hw, a, count_pairs, keep_steps));
    }
  for (auto& x : all) x.ring_makespan_s = all[0].makespan_s;
  return all;
}

/// Index of the fastest valid prediction that fits in memory (ties: less
/// memory, then fewer bytes sent); -1 when none does.
inline int recommend(const std::vector<Prediction>& all) {
  int best = -1;
  for (int i = 0; i < int(all.size()); ++i) {
    const Prediction& x = all[std::size_t(i)];
    if (!x.valid || !x.fits) continue;
    if (best < 0) {
      best = i;
      continue;
    }
    const Prediction& b = all[std::size_t(best)];
    const double tol = 1e-9 * b.makespan_s;
    if (x.makespan_s < b.makespan_s - tol ||
        (x.makespan_s <= b.makespan_s + tol &&
         (x.peak_bytes() < b.peak_bytes() ||
          (x.peak_bytes() == b.peak_bytes() && x.max_bytes_sent() < b.max_bytes_sent()))))
      best = i;
  }
  return best;
}

}  // namespace plan
}  // namespace blockattn
