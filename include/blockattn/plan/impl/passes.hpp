// SPDX-License-Identifier: Apache-2.0
// What the backward and the training step add to the planner's model: the
// backward's payloads and buffers, its tile cost, a single device's time,
// the schedules' run-time support, and a training step from its two passes.
#pragma once

#include <blockattn/plan/impl/pair_work.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

namespace blockattn {
namespace plan {
namespace detail {

inline std::int64_t round_up(std::int64_t n, int b) {
  return (n + b - 1) / b * std::int64_t(b);
}

/// Bytes of one backward transfer's payload (the sizes the run's backward
/// sends): K and V rows in the storage type; a packed query block (Q, dO
/// rows padded to the backward's query tiles and head dim in the storage
/// type, LSE and D in the compute type); dQ and dK/dV partials in the
/// compute type.
inline std::int64_t backward_payload_bytes(const Problem& p, Payload what) {
  const std::int64_t b = p.batch, most = p.local(), s = p.dtype_bytes, cs = p.accumulator_bytes();
  const std::int64_t rows = b * p.heads * round_up(most, p.backward_block_q());
  switch (what) {
    case Payload::kv:
      return 2 * b * most * p.kv_heads * p.dim * s;
    case Payload::q:
      return 2 * rows * p.backward_stored_dim() * s + 2 * rows * cs;
    case Payload::dq:
      return b * most * p.heads * p.dim * cs;
    case Payload::dkv:
      return 2 * b * most * p.kv_heads * p.dim * cs;
    case Payload::result:
      break;
  }
  return 0;
}

/// The buffers of the backward of a rank holding `n` tokens, for
/// backward_workspace_bytes(): the caller's gradients are taken to be
/// LayoutRight Views of the storage type (16-bit ones get fp32 sums).
inline BackwardBufferBytes backward_buffer_bytes(const Problem& p, index_type n) {
  const std::int64_t b = p.batch, cs = p.accumulator_bytes(), dp = p.backward_stored_dim();
  BackwardBufferBytes bb;
  bb.kv = backward_payload_bytes(p, Payload::kv);
  bb.q = backward_payload_bytes(p, Payload::q);
  if (p.widens())
    bb.widened_q = 2 * b * p.heads * round_up(p.local(), p.backward_block_q()) * dp * cs;
  bb.keys = 3 * b * p.kv_heads * round_up(p.local(), p.backward_block_k()) * dp * cs;
  bb.dq = backward_payload_bytes(p, Payload::dq);
  bb.dkv = backward_payload_bytes(p, Payload::dkv);
  if (p.widens()) bb.own = b * n * (p.heads + 2 * std::int64_t(p.kv_heads)) * p.dim * cs;
  return bb;
}

/// Compute time of backward tiles: 10 D FLOPs per pair at Hardware::backward_rate(),
/// a partial tile at Hardware::backward_partial_cost() of a full one.
inline double backward_tile_seconds(const Problem& p, const Hardware& hw, const TileCounts& t) {
  const double rate = hw.backward_rate();
  if (rate <= 0) return 0;
  const double per_tile =
      10.0 * p.backward_block_q() * p.backward_block_k() * p.dim * double(p.batch) * p.heads;
  return (double(t.full) + hw.backward_partial_cost() * double(t.partial)) * per_tile / rate;
}

/// Starts a prediction: `pr` named for Partition x Schedule and `p` the
/// problem with buffers sized for the longest rank (as the run's). The
/// invalid prediction where Partition cannot split N over P or the schedule
/// does not take the partition with this mask, else nothing.
template <class Partition, class Schedule, class Mask>
std::optional<Prediction> start_prediction(Prediction& pr, const Problem& problem, Problem& p) {
  // One static_assert per missing member of the schedule (impl::check_schedule).
  static_assert(sizeof(impl::schedule_complete<Schedule>) > 0, "");
  pr.partition = Partition::name();
  pr.schedule = Schedule::name();
  if (std::string why = layout_why_not<Partition, Schedule, Mask>(problem.N, problem.P);
      !why.empty())
    return invalid(std::move(pr), std::move(why));
  p = problem;
  p.most = max_local_length<Partition>(p.N, p.P);
  return std::nullopt;
}

/// The whole sequence on one rank, same kernel model, for p.pass.
template <class Mask>
double single_device_seconds(const Problem& p, const Mask& mask, const Hardware& hw) {
  double t = 0;
  if (p.pass != Pass::backward)
    t += tile_seconds(p, hw, whole_sequence_tiles(mask, p.N, p.block_q, p.block_k, false));
  if (p.pass != Pass::forward)
    t += backward_tile_seconds(
        p, hw, whole_sequence_tiles(mask, p.N, p.backward_block_q(), p.backward_block_k(), false));
  return t;
}

/// `pr` with its last numbers: the whole sequence on one rank for p.pass,
/// and whether its peak fits in the hardware's memory.
template <class Mask>
Prediction finished(Prediction pr, const Problem& p, const Mask& mask, const Hardware& hw) {
  pr.single_device_s = single_device_seconds(p, mask, hw);
  pr.fits = hw.memory_bytes <= 0 || double(pr.peak_bytes()) <= hw.memory_bytes;
  return pr;
}

/// The caller's Views on a rank of the longest length: forward q, k, v, o,
/// LSE; backward q, o, dO, dQ; k, v, dK, dV; LSE.
inline std::int64_t input_bytes(const Problem& p, bool backward) {
  const int per_head = backward ? 4 : 2;
  return rows_bytes(p, per_head * p.heads + per_head * p.kv_heads, p.dim) + state_bytes(p);
}

/// The seconds of a head-parallel pass's all-to-alls, a2a(chunk bytes) each,
/// chunks of chunk_row elements per head: in Q, K, V (backward: and O, dO,
/// LSE), out O, LSE (backward: dQ, and dK, dV of kv_grad_bytes per element);
/// hq, hk heads per rank, s the storage bytes, lse_chunk an LSE chunk's bytes.
struct HeadAlltoalls {
  double in = 0, out = 0;
};
template <class A2a>
HeadAlltoalls head_alltoalls(const A2a& a2a, bool bwd, std::int64_t chunk_row, std::int64_t hq,
                             std::int64_t hk, std::int64_t s, std::int64_t kv_grad_bytes,
                             std::int64_t lse_chunk) {
  const double lse = a2a(lse_chunk);
  HeadAlltoalls r;
  r.in = (bwd ? 3 : 1) * a2a(chunk_row * hq * s) + 2 * a2a(chunk_row * hk * s) + (bwd ? lse : 0.0);
  r.out = a2a(chunk_row * hq * s) + (bwd ? 2 * a2a(chunk_row * hk * kv_grad_bytes) : lse);
  return r;
}

/// Schedule::can_implement() for predict() and predict_backward(), from the
/// pair table: for the balanced schedule with a mask tabled by difference,
/// its first pair (i, j > i) that is not empty is (0, the nearest such j),
/// since rank 0 meets every distance.
template <class Partition, class Schedule, class Mask>
std::string implement_why_not(const Mask& mask, index_type N, int P,
                              const PairWork<Partition, Mask>& w) {
  if constexpr (!Schedule::template supports<Partition, Mask>) {
    return {};
  } else {
    if (std::is_same<Schedule, BalancedSchedule>::value && w.by_difference()) {
      for (int j = 1; j < P; ++j)
        if (!w.empty(0, j)) return BalancedSchedule::reaches_later(0, j);
      return {};
    }
    return Schedule::template can_implement<Partition>(mask, N, P);
  }
}

/// A training step's attention from its forward and backward predictions:
/// times, steps (the backward's after the forward's), bytes and FLOPs add up;
/// the peak per rank is the larger of the two passes' (input_bytes: the
/// backward's Views; workspace_bytes: the rest of that peak).
inline Prediction training(Prediction f, const Prediction& b) {
  if (!f.valid) return f;
  if (!b.valid) return b;
  const double shift = f.makespan_s;
  for (std::size_t r = 0; r < f.ranks.size(); ++r) {
    RankPlan& x = f.ranks[r];
    const RankPlan& y = b.ranks[r];
    for (StepPlan st : y.steps) {
      st.start_s += shift;
      st.end_s += shift;
      x.steps.push_back(st);
    }
    const std::int64_t peak = std::max(x.peak_bytes(), y.peak_bytes());
    x.step_count += y.step_count;
    x.idle_step_count += y.idle_step_count;
    x.compute_s += y.compute_s;
    x.sent += y.sent;
    x.network += y.network;
    x.alltoall_bytes += y.alltoall_bytes;
    x.alltoall_network_bytes += y.alltoall_network_bytes;
    x.alltoall_s += y.alltoall_s;
    x.input_bytes = y.input_bytes;
    x.workspace_bytes = peak - y.input_bytes;
  }
  f.makespan_s += b.makespan_s;
  f.single_device_s += b.single_device_s;
  f.passes = 2;
  f.fits = f.fits && b.fits;
  return f;
}

}  // namespace detail
}  // namespace plan
}  // namespace blockattn
