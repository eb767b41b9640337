// SPDX-License-Identifier: Apache-2.0
// Cost model and planner for the distributed forward: per rank and step, the
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
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/work.hpp>
#include <blockattn/plan/model.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/partition.hpp>
#include <blockattn/schedule/allgather.hpp>
#include <blockattn/schedule/balanced.hpp>
#include <blockattn/schedule/hybrid.hpp>
#include <blockattn/schedule/ring.hpp>
#include <blockattn/schedule/schedule.hpp>
#include <blockattn/schedule/ulysses.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace blockattn {
namespace plan {

namespace detail {

struct Message {
  int src = 0, dst = 0;
  std::int64_t bytes = 0;
  int src_step = 0, dst_step = 0;  // steps at whose start both sides post it
  bool after_compute = false;      // the sender posts it after its compute of src_step
  int done_step = 0;               // both sides wait for it at the end of this step
};

/// A packed K/V block, in the storage type (bytes = 0) or another.
inline std::int64_t packed_kv_bytes(const Problem& p, int bytes = 0) {
  const std::int64_t keys_padded =
      (p.local() + p.block_k - 1) / p.block_k * std::int64_t(p.block_k);
  return 2 * std::int64_t(p.batch) * p.kv_heads * keys_padded * p.stored_dim() *
         (bytes > 0 ? bytes : p.dtype_bytes);
}
/// Local rows of `heads` heads, in the storage type (bytes = 0) or another.
inline std::int64_t rows_bytes(const Problem& p, int heads, int dim, int bytes = 0) {
  return std::int64_t(p.batch) * p.local() * heads * dim * (bytes > 0 ? bytes : p.dtype_bytes);
}
/// One value per local query row and head, in the compute type (LSE, m, l).
inline std::int64_t state_bytes(const Problem& p) {
  return std::int64_t(p.batch) * p.heads * p.local() * p.accumulator_bytes();
}

/// One all-to-all of `chunk` bytes per pair among `count` groups of P ranks
/// (ranks base .. base + P - 1, then the next P): each rank sends P - 1
/// messages one at a time; the slowest rank of the slowest group.
inline double alltoall_seconds(const Hardware& hw, int base, int P, int count, std::int64_t chunk) {
  double worst = 0;
  for (int g = 0; g < count; ++g)
    for (int r = 0; r < P; ++r) {
      double t = 0;
      for (int j = 0; j < P; ++j)
        if (j != r) t += hw.transfer_seconds(base + g * P + r, base + g * P + j, double(chunk));
      worst = std::max(worst, t);
    }
  return worst;
}

/// Of the P - 1 peers of rank `base + r` in its all-to-all group (ranks
/// base .. base + P - 1), how many sit on other nodes.
inline int alltoall_remote_peers(const Hardware& hw, int base, int P, int r) {
  int n = 0;
  for (int j = 0; j < P; ++j)
    if (j != r && !hw.same_node(base + r, base + j)) ++n;
  return n;
}

inline double tile_seconds(const Problem& p, const Hardware& hw, const TileCounts& t) {
  if (hw.flops <= 0) return 0;
  const double per_tile = 4.0 * p.block_q * p.block_k * p.dim * double(p.batch) * p.heads;
  return (double(t.full) + hw.partial_tile_cost * double(t.partial)) * per_tile / hw.flops;
}

/// Bytes of one transfer's payload (the sizes DistributedAttention sends).
inline std::int64_t payload_bytes(const Problem& p, Payload what) {
  switch (what) {
    case Payload::kv:
      return packed_kv_bytes(p);
    case Payload::q:
      return rows_bytes(p, p.heads, p.dim);
    case Payload::result:  // partial O and LSE travel in the compute type
      return rows_bytes(p, p.heads, p.dim, p.accumulator_bytes()) + state_bytes(p);
    case Payload::dq:
    case Payload::dkv:
      break;  // backward payloads: the planner models the forward
  }
  return 0;
}

/// Messages and per-rank workspace, read from the schedule's own description
/// (blockattn/schedule/schedule.hpp): the transfers its step() lists and the buffers
/// forward_slots() derives from them, at the sizes the run allocates.
template <class Schedule>
void schedule_plan(const Problem& p, const ScheduleContext& c, std::vector<Message>& msgs,
                   std::vector<std::int64_t>& ws) {
  const int P = p.P;
  for (const ScheduledTransfer& t : schedule_transfers<Schedule>(c))
    msgs.push_back({t.src, t.dst, payload_bytes(p, t.payload), t.src_step, t.dst_step,
                    t.after_compute, t.done_step});
  ws.assign(std::size_t(P), 0);
  const std::int64_t q = payload_bytes(p, Payload::q), res = payload_bytes(p, Payload::result);
  for (int r = 0; r < P; ++r) {
    ForwardBufferBytes b;
    b.kv = packed_kv_bytes(p);
    b.q = q;
    b.result = res;
    b.state = 2 * state_bytes(p);
    if (p.widens()) {  // 16-bit storage: the block in use widened to fp32, and the fp32 O sum
      b.widened_kv = packed_kv_bytes(p, p.accumulator_bytes());
      b.accumulator = rows_bytes(p, p.heads, p.dim, p.accumulator_bytes());
    }
    ws[std::size_t(r)] = forward_workspace_bytes(forward_slots<Schedule>(c, r), b);
  }
}

/// Empty when Partition splits N over P ranks (any N >= 1 with length(),
/// else a positive multiple of multiple_of(P)), else why not.
template <class Partition>
std::string length_why_not(index_type N, int P) {
  if constexpr (splits_any_length_v<Partition>) {
    if (P < 1 || N < 1) return "N and P must be at least 1";
  } else if (P < 1 || N <= 0 || N % Partition::multiple_of(P) != 0) {
    return "N must be a positive multiple of " + std::to_string(Partition::multiple_of(P));
  }
  return {};
}

}  // namespace detail

/// Predicts one partition x mask x schedule. Work per rank and step comes from
/// the kernels' tile classifier on the partition's global positions; the
/// timing simulation runs the steps as DistributedAttention does: the
/// transfers a step needs are posted at the start of the step before and
/// complete at its end, a rank's link sends and receives one message at a
/// time per direction, and a message starts when both sides have posted it.
/// count_pairs: also count allowed pairs (cost ~ pairs of partial tiles).
/// rank_stride: rank r of the prediction is rank r x rank_stride of the
/// machine (HybridAttention's rings: the ranks of one member index).
template <class Partition, class Schedule, class Mask>
Prediction predict(const Problem& problem, const Mask& mask, const Hardware& hw,
                   bool count_pairs = false, int rank_stride = 1) {
  Prediction pr;
  pr.partition = Partition::name();
  pr.schedule = Schedule::name();
  const int P = problem.P;
  if (std::string why = detail::length_why_not<Partition>(problem.N, P); !why.empty()) {
    pr.valid = false;
    pr.why_not = std::move(why);
    return pr;
  }
  Problem p = problem;  // buffers sized for the longest rank, as DistributedAttention's
  p.most = max_local_length<Partition>(p.N, P);
  static_assert(impl::check_schedule<Schedule>(), "BlockAttn: predict needs a complete schedule");
  if constexpr (!Schedule::template supports<Partition, Mask>) {
    pr.valid = false;
    pr.why_not = std::string("the ") + Schedule::name() + " schedule does not support the " +
                 Partition::name() + " partition with this mask";
    return pr;
  } else {
    const std::string why = Schedule::template can_implement<Partition>(mask, p.N, P);
    if (!why.empty()) {
      pr.valid = false;
      pr.why_not = why;
      return pr;
    }
  }
  const ScheduleContext ctx = schedule_context<Partition>(mask, p.N, P);
  const int steps = schedule_steps<Schedule>(ctx);
  std::vector<detail::Message> msgs;
  std::vector<std::int64_t> ws;
  detail::schedule_plan<Schedule>(p, ctx, msgs, ws);
  pr.ranks.resize(std::size_t(P));
  const std::int64_t inputs =
      detail::rows_bytes(p, 2 * p.heads + 2 * p.kv_heads, p.dim) + detail::state_bytes(p);
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
    std::sort(due.begin(), due.end(),
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
  }
  pr.single_device_s =
      detail::tile_seconds(p, hw, count_tiles(mask, p.N, p.N, p.block_q, p.block_k, {}, {}, false));
  pr.fits = hw.memory_bytes <= 0 || double(pr.peak_bytes()) <= hw.memory_bytes;
  return pr;
}

/// Predicts UlyssesAttention (head-parallel all-to-all, arXiv:2309.14509) on
/// the partition's layout: every rank computes the whole sequence for H / P
/// heads (the same work on every rank, whatever the mask), after the
/// all-to-alls of Q, K, V and before those of O and LSE, which do not overlap
/// with the compute. An all-to-all costs each rank P - 1 messages per
/// direction, one at a time (latency + bytes / B each). Bytes and workspace
/// are those of ulysses_forward_volume() (blockattn/schedule/ulysses.hpp),
/// which the run reports in RunStats.
template <class Partition, class Mask>
Prediction predict_ulysses(const Problem& p, const Mask& mask, const Hardware& hw,
                           bool count_pairs = false) {
  Prediction pr;
  pr.partition = Partition::name();
  pr.schedule = "ulysses";
  const int P = p.P;
  if (std::string why = detail::length_why_not<Partition>(p.N, P); !why.empty()) {
    pr.valid = false;
    pr.why_not = std::move(why);
    return pr;
  }
  if (const std::string why = UlyssesHeads::why_not(p.heads, p.kv_heads, P); !why.empty()) {
    pr.valid = false;
    pr.why_not = why;
    return pr;
  }
  const UlyssesHeads u = UlyssesHeads::make(p.heads, p.kv_heads, P);
  const int cs = p.accumulator_bytes();
  const std::int64_t keys_padded = (p.N + p.block_k - 1) / p.block_k * std::int64_t(p.block_k);
  const std::int64_t packed =
      2 * std::int64_t(p.batch) * u.kv_heads_per_rank * keys_padded * p.stored_dim() * cs;
  // Chunks of the longest rank's tokens (every rank's when P divides N).
  Problem widest = p;
  widest.most = max_local_length<Partition>(p.N, P);
  const UlyssesForwardVolume vol =
      ulysses_forward_volume(u, p.batch, p.N, p.dim, p.dtype_bytes, cs, packed, widest.most);
  // Time: the all-to-alls in (Q, K, V) and out (O, LSE), P - 1 chunks each.
  const std::int64_t n = widest.local(), chunk_row = std::int64_t(p.batch) * n * p.dim;
  const auto a2a = [&](std::int64_t chunk_bytes) {
    return detail::alltoall_seconds(hw, 0, P, 1, chunk_bytes);
  };
  const std::int64_t s = p.dtype_bytes;
  const double in = a2a(chunk_row * u.heads_per_rank * s) +
                    2 * a2a(chunk_row * u.kv_heads_per_rank * s),
               out = a2a(chunk_row * u.heads_per_rank * s) +
                     a2a(std::int64_t(p.batch) * n * u.heads_per_rank * cs);
  Problem local = p;
  local.heads = u.heads_per_rank;
  StepPlan st;
  st.task = BlockTask{};
  st.tiles = count_tiles(mask, p.N, p.N, p.block_q, p.block_k, {}, {}, count_pairs);
  st.flops = 4.0 * double(st.tiles.computed()) * p.block_q * p.block_k * p.dim * p.batch *
             u.heads_per_rank;
  st.compute_s = detail::tile_seconds(local, hw, st.tiles) + hw.step_overhead;
  st.comm_s = in + out;
  st.bytes_sent = st.bytes_received = vol.sent;
  st.start_s = 0;
  st.end_s = in + st.compute_s + out;
  const std::int64_t inputs =
      detail::rows_bytes(widest, 2 * p.heads + 2 * p.kv_heads, p.dim) + detail::state_bytes(widest);
  pr.ranks.resize(std::size_t(P));
  for (int r = 0; r < P; ++r) {
    RankPlan& rp = pr.ranks[std::size_t(r)];
    rp.input_bytes = inputs;
    rp.workspace_bytes = vol.workspace;
    st.task.q_rank = st.task.k_rank = r;
    // The same bytes to each of the P - 1 peers.
    st.network_bytes = P > 1 ? vol.sent / (P - 1) * detail::alltoall_remote_peers(hw, 0, P, r) : 0;
    rp.steps.push_back(st);
  }
  pr.makespan_s = st.end_s;
  pr.single_device_s =
      detail::tile_seconds(p, hw, count_tiles(mask, p.N, p.N, p.block_q, p.block_k, {}, {}, false));
  pr.fits = hw.memory_bytes <= 0 || double(pr.peak_bytes()) <= hw.memory_bytes;
  return pr;
}

/// Predicts HybridAttention on a P = ulysses x (P / ulysses) grid: the
/// all-to-alls inside each group of `ulysses` consecutive ranks (Q, K, V in,
/// O and LSE out, as predict_ulysses on the group's N / P_r tokens; on the
/// intra-node links when a group sits on one node), around the ring of
/// Partition x Schedule across the groups for H / ulysses heads (predict()
/// on P_r ranks; its messages between ranks g x ulysses + a of different
/// groups). Bytes and workspace are what the run reports: the ring's steps,
/// RankPlan::alltoall_bytes = RunStats::alltoall_bytes, and the peak of
/// ulysses_forward_volume() around the ring's workspace. The ring's times and
/// network bytes are those of member 0's ranks (g x ulysses); exact for every
/// member when groups and nodes align (ulysses divides ranks_per_node or the
/// reverse).
template <class Partition, class Schedule, class Mask>
Prediction predict_hybrid(const Problem& p, const Mask& mask, const Hardware& hw, int ulysses,
                          bool count_pairs = false) {
  Prediction pr;
  pr.partition = Partition::name();
  pr.ulysses = ulysses;
  const int P = p.P;
  pr.schedule = std::string("hybrid ") + std::to_string(ulysses) + "x" +
                std::to_string(ulysses > 0 ? P / ulysses : 0) + " " + Schedule::name();
  auto invalid = [&](std::string why) {
    pr.valid = false;
    pr.why_not = std::move(why);
    return pr;
  };
  if (const std::string why = HybridGrid::why_not(P, ulysses); !why.empty()) return invalid(why);
  const HybridGrid g = HybridGrid::make(P, ulysses);
  if (const std::string why = hybrid_length_why_not<Partition>(p.N, g); !why.empty())
    return invalid(why);
  if (const std::string why = UlyssesHeads::why_not(p.heads, p.kv_heads, ulysses); !why.empty())
    return invalid(why);
  const UlyssesHeads u = UlyssesHeads::make(p.heads, p.kv_heads, ulysses);
  Problem inner = p;
  inner.P = g.ring;
  inner.heads = u.heads_per_rank;
  inner.kv_heads = u.kv_heads_per_rank;
  const Prediction ring = predict<Partition, Schedule>(inner, mask, hw, count_pairs, ulysses);
  if (!ring.valid) return invalid(ring.why_not);
  // The all-to-alls: chunks of the longest member's tokens (N / P when the
  // layout is even), as in predict_ulysses; a group's chunks are those of its
  // longest member.
  const int cs = p.accumulator_bytes();
  const auto group_tokens = [&](int group) {
    return hybrid_group_length<Partition>(p.N, g, group);
  };
  std::int64_t n = 0;
  for (int r = 0; r < P; ++r) n = std::max<std::int64_t>(n, hybrid_length<Partition>(p.N, g, r));
  const std::int64_t s = p.dtype_bytes, chunk_row = std::int64_t(p.batch) * n * p.dim;
  const auto a2a = [&](std::int64_t chunk) {
    return detail::alltoall_seconds(hw, 0, ulysses, g.ring, chunk);
  };
  const double in = a2a(chunk_row * u.heads_per_rank * s) +
                    2 * a2a(chunk_row * u.kv_heads_per_rank * s),
               out = a2a(chunk_row * u.heads_per_rank * s) +
                     a2a(std::int64_t(p.batch) * n * u.heads_per_rank * cs);
  Problem widest = p;
  widest.most = n;
  const std::int64_t inputs =
      detail::rows_bytes(widest, 2 * p.heads + 2 * p.kv_heads, p.dim) + detail::state_bytes(widest);
  pr.ranks.resize(std::size_t(P));
  for (int r = 0; r < P; ++r) {
    const RankPlan& rr = ring.ranks[std::size_t(g.group(r))];
    RankPlan& rp = pr.ranks[std::size_t(r)];
    const index_type Ng = group_tokens(g.group(r));
    const UlyssesForwardVolume vol =
        ulysses_forward_volume(u, p.batch, Ng, p.dim, p.dtype_bytes, cs, rr.workspace_bytes,
                               impl::EvenCut{Ng, ulysses}.length(0));
    rp.steps = rr.steps;
    for (auto& st : rp.steps) {
      st.start_s += in;
      st.end_s += in;
      if (st.task.q_rank >= 0) st.task.q_rank = g.rank_of(st.task.q_rank, g.member(r));
      if (st.task.k_rank >= 0) st.task.k_rank = g.rank_of(st.task.k_rank, g.member(r));
    }
    rp.input_bytes = inputs;
    rp.workspace_bytes = vol.workspace;
    rp.alltoall_bytes = vol.sent;
    rp.alltoall_network_bytes =
        ulysses > 1
            ? vol.sent / (ulysses - 1) *
                  detail::alltoall_remote_peers(hw, g.group(r) * ulysses, ulysses, g.member(r))
            : 0;
    rp.alltoall_s = in + out;
  }
  pr.makespan_s = in + ring.makespan_s + out;
  pr.single_device_s =
      detail::tile_seconds(p, hw, count_tiles(mask, p.N, p.N, p.block_q, p.block_k, {}, {}, false));
  pr.fits = hw.memory_bytes <= 0 || double(pr.peak_bytes()) <= hw.memory_bytes;
  return pr;
}

/// Every built-in combination for this mask: contiguous, striped and zigzag
/// with the KV ring, contiguous with the balanced schedule (masks other than
/// full), zigzag with the all-gather (Llama 3's layout), and the head-parallel
/// all-to-all (Ulysses; invalid when P does not divide the heads), and on
/// two-level hardware (ranks_per_node > 0) the 2D hybrid for every group size
/// 1 < P_a < P that divides P and the heads, last. The first entry is the
/// contiguous ring, the baseline of speedup_over_ring().
template <class Mask>
std::vector<Prediction> compare(const Problem& p, const Mask& mask, const Hardware& hw,
                                bool count_pairs = false) {
  std::vector<Prediction> all;
  all.push_back(predict<ContiguousPartition, RingSchedule>(p, mask, hw, count_pairs));
  all.push_back(predict<StripedPartition, RingSchedule>(p, mask, hw, count_pairs));
  all.push_back(predict<ZigzagPartition, RingSchedule>(p, mask, hw, count_pairs));
  if constexpr (!std::is_same<Mask, FullMask>::value)
    all.push_back(predict<ContiguousPartition, BalancedSchedule>(p, mask, hw, count_pairs));
  all.push_back(predict<ZigzagPartition, AllGatherSchedule>(p, mask, hw, count_pairs));
  all.push_back(predict_ulysses<ContiguousPartition>(p, mask, hw, count_pairs));
  // Two-level hardware: the 2D hybrid on every grid whose groups split the
  // heads (zigzag ring across groups; contiguous for the full mask, whose
  // work is even on any layout).
  if (hw.ranks_per_node > 0)
    for (int a = 2; a < p.P; ++a) {
      if (p.P % a != 0 || !UlyssesHeads::why_not(p.heads, p.kv_heads, a).empty()) continue;
      if constexpr (std::is_same<Mask, FullMask>::value)
        all.push_back(
            predict_hybrid<ContiguousPartition, RingSchedule>(p, mask, hw, a, count_pairs));
      else
        all.push_back(predict_hybrid<ZigzagPartition, RingSchedule>(p, mask, hw, a, count_pairs));
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
