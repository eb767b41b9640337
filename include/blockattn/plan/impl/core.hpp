// SPDX-License-Identifier: Apache-2.0
// The planner's simulation core: messages and their bytes (the sizes the run
// sends), links (a node and the network), all-to-alls, the compute time of
// tiles, the buffers a schedule's description names, and why a layout cannot
// run. plan/planner.hpp is the entry point.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/work.hpp>
#include <blockattn/plan/model.hpp>
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

/// Of the ranks base .. base + P - 1, how many share a node with rank x
/// (x itself included).
inline int group_node_mates(const Hardware& hw, int base, int P, int x) {
  if (hw.ranks_per_node <= 0) return 1;
  const std::int64_t R = hw.ranks_per_node, node0 = std::int64_t(x) / R * R;
  const std::int64_t lo = std::max<std::int64_t>(base, node0),
                     hi = std::min<std::int64_t>(std::int64_t(base) + P, node0 + R);
  return int(hi - lo);
}

/// One all-to-all of `chunk` bytes per pair among `count` groups of P ranks
/// (ranks base .. base + P - 1, then the next P): each rank sends P - 1
/// messages one at a time; the slowest rank of the slowest group.
inline double alltoall_seconds(const Hardware& hw, int base, int P, int count, std::int64_t chunk) {
  double worst = 0;
  const double bytes = double(chunk);
  const double near = hw.transfer_seconds(0, 0, bytes);  // same node (one level: the network)
  const double far =
      hw.ranks_per_node > 0 ? hw.transfer_seconds(0, hw.ranks_per_node, bytes) : near;
  for (int g = 0; g < count; ++g) {
    const int b = base + g * P;
    // A group's ranks differ only by how many of their peers share their
    // node: ranks at the group's node boundaries, and one of each node between.
    const auto time_of = [&](int x) {
      const int mates = group_node_mates(hw, b, P, x) - 1;
      return hw.ranks_per_node > 0 ? mates * near + (P - 1 - mates) * far : (P - 1) * near;
    };
    if (hw.ranks_per_node <= 0) {
      worst = std::max(worst, P > 0 ? time_of(b) : 0.0);
      continue;
    }
    for (std::int64_t x = b; x < std::int64_t(b) + P;
         x = (x / hw.ranks_per_node + 1) * std::int64_t(hw.ranks_per_node))
      worst = std::max(worst, time_of(int(x)));
  }
  return worst;
}

/// Of the P - 1 peers of rank `base + r` in its all-to-all group (ranks
/// base .. base + P - 1), how many sit on other nodes.
inline int alltoall_remote_peers(const Hardware& hw, int base, int P, int r) {
  if (hw.ranks_per_node <= 0) return P - 1;
  return P - group_node_mates(hw, base, P, base + r);
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

/// Why Partition x Schedule cannot run N tokens over P ranks with a mask of
/// this type (the length, then the schedule's compile-time support), or "".
template <class Partition, class Schedule, class Mask>
std::string layout_why_not(index_type N, int P) {
  if (std::string why = length_why_not<Partition>(N, P); !why.empty()) return why;
  if constexpr (!Schedule::template supports<Partition, Mask>)
    return std::string("the ") + Schedule::name() + " schedule does not support the " +
           Partition::name() + " partition with this mask";
  return {};
}

/// `pr` marked not possible, for `why`.
inline Prediction invalid(Prediction pr, std::string why) {
  pr.valid = false;
  pr.why_not = std::move(why);
  return pr;
}

}  // namespace detail
}  // namespace plan
}  // namespace blockattn
