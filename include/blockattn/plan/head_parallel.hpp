// SPDX-License-Identifier: Apache-2.0
// The head-parallel schedules' models: UlyssesAttention (the all-to-alls
// around one local attention) and HybridAttention (all-to-alls inside groups
// around a ring across them).
#pragma once

#include <blockattn/plan/predict.hpp>
#include <blockattn/schedule/hybrid.hpp>
#include <blockattn/schedule/ulysses.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

namespace blockattn {
namespace plan {

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
  if (p.pass == Pass::training) {
    Problem f = p, b = p;
    f.pass = Pass::forward;
    b.pass = Pass::backward;
    return detail::training(predict_ulysses<Partition>(f, mask, hw, count_pairs),
                            predict_ulysses<Partition>(b, mask, hw, count_pairs));
  }
  const bool bwd = p.pass == Pass::backward;
  Prediction pr;
  pr.partition = Partition::name();
  pr.schedule = "ulysses";
  const int P = p.P;
  if (std::string why = detail::length_why_not<Partition>(p.N, P); !why.empty())
    return detail::invalid(std::move(pr), std::move(why));
  if (std::string why = UlyssesHeads::why_not(p.heads, p.kv_heads, P); !why.empty())
    return detail::invalid(std::move(pr), std::move(why));
  const UlyssesHeads u = UlyssesHeads::make(p.heads, p.kv_heads, P);
  const int cs = p.accumulator_bytes();
  const std::int64_t b = p.batch, hq = u.heads_per_rank, hk = u.kv_heads_per_rank;
  const int bq = bwd ? p.backward_block_q() : p.block_q,
            bk = bwd ? p.backward_block_k() : p.block_k;
  // The local attention's packed buffers (compute type): the forward's K/V
  // block; the backward's keys (K^T, V^T panels, K rows) and rows (Q, dO, LSE, D).
  const std::int64_t keys_padded = detail::round_up(p.N, bk),
                     rows_padded = detail::round_up(p.N, bq);
  const std::int64_t packed = bwd ? (3 * hk * keys_padded * p.backward_stored_dim() +
                                     2 * hq * rows_padded * (p.backward_stored_dim() + 1)) *
                                        b * cs
                                  : 2 * b * hk * keys_padded * p.stored_dim() * cs;
  // Chunks of the longest rank's tokens (every rank's when P divides N).
  Problem widest = p;
  widest.most = max_local_length<Partition>(p.N, P);
  const UlyssesForwardVolume vol =
      bwd ? ulysses_backward_volume(u, p.batch, p.N, p.dim, p.dtype_bytes, cs, cs, packed,
                                    widest.most)
          : ulysses_forward_volume(u, p.batch, p.N, p.dim, p.dtype_bytes, cs, packed, widest.most);
  // Time: the all-to-alls in (Q, K, V; backward: and O, dO, LSE) and out (O,
  // LSE; backward: dQ, dK, dV in the compute type), P - 1 chunks each.
  const std::int64_t n = widest.local(), chunk_row = b * n * p.dim;
  const auto a2a = [&](std::int64_t chunk_bytes) {
    return detail::alltoall_seconds(hw, 0, P, 1, chunk_bytes);
  };
  const auto [in, out] =
      detail::head_alltoalls(a2a, bwd, chunk_row, hq, hk, p.dtype_bytes, cs, b * n * hq * cs);
  Problem local = p;
  local.heads = u.heads_per_rank;
  StepPlan st;
  st.task = BlockTask{};
  st.tiles = detail::whole_sequence_tiles(mask, p.N, bq, bk, count_pairs);
  st.flops = (bwd ? 10.0 : 4.0) * double(st.tiles.computed()) * bq * bk * p.dim * p.batch * hq;
  st.compute_s = (bwd ? detail::backward_tile_seconds(local, hw, st.tiles)
                      : detail::tile_seconds(local, hw, st.tiles)) +
                 hw.step_overhead;
  st.comm_s = in + out;
  st.bytes_sent = st.bytes_received = vol.sent;
  st.start_s = 0;
  st.end_s = in + st.compute_s + out;
  const std::int64_t inputs = detail::input_bytes(widest, bwd);
  pr.ranks.resize(std::size_t(P));
  for (int r = 0; r < P; ++r) {
    RankPlan& rp = pr.ranks[std::size_t(r)];
    rp.input_bytes = inputs;
    rp.workspace_bytes = vol.workspace;
    st.task.q_rank = st.task.k_rank = r;
    // The same bytes to each of the P - 1 peers.
    st.network_bytes = P > 1 ? vol.sent / (P - 1) * detail::alltoall_remote_peers(hw, 0, P, r) : 0;
    rp.add(st, true);
  }
  pr.makespan_s = st.end_s;
  return detail::finished(std::move(pr), p, mask, hw);
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
                          bool count_pairs = false, bool keep_steps = true) {
  if (p.pass == Pass::training) {
    Problem f = p, b = p;
    f.pass = Pass::forward;
    b.pass = Pass::backward;
    return detail::training(
        predict_hybrid<Partition, Schedule>(f, mask, hw, ulysses, count_pairs, keep_steps),
        predict_hybrid<Partition, Schedule>(b, mask, hw, ulysses, count_pairs, keep_steps));
  }
  const bool bwd = p.pass == Pass::backward;
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
  const Prediction ring =
      predict<Partition, Schedule>(inner, mask, hw, count_pairs, ulysses, keep_steps);
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
  // Backward: O, dO and LSE join Q, K, V on the way in; dQ, dK, dV go back
  // in the storage type (the ring's gradients).
  const auto [in, out] =
      detail::head_alltoalls(a2a, bwd, chunk_row, u.heads_per_rank, u.kv_heads_per_rank, s, s,
                             std::int64_t(p.batch) * n * u.heads_per_rank * cs);
  Problem widest = p;
  widest.most = n;
  const std::int64_t inputs = detail::input_bytes(widest, bwd);
  pr.ranks.resize(std::size_t(P));
  for (int r = 0; r < P; ++r) {
    const RankPlan& rr = ring.ranks[std::size_t(g.group(r))];
    // The ring's steps and sums; the group's all-to-alls and buffers below.
    RankPlan& rp = pr.ranks[std::size_t(r)] = rr;
    const index_type Ng = group_tokens(g.group(r));
    const index_type most = impl::EvenCut{Ng, ulysses}.length(0);
    const UlyssesForwardVolume vol =
        bwd ? ulysses_backward_volume(u, p.batch, Ng, p.dim, p.dtype_bytes, cs, p.dtype_bytes,
                                      rr.workspace_bytes, most)
            : ulysses_forward_volume(u, p.batch, Ng, p.dim, p.dtype_bytes, cs, rr.workspace_bytes,
                                     most);
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
  return detail::finished(std::move(pr), p, mask, hw);
}

}  // namespace plan
}  // namespace blockattn
