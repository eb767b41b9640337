// SPDX-License-Identifier: Apache-2.0
// The planner's inputs and outputs (plan/planner.hpp): the hardware presets
// (compute rate, link bandwidth and latency per level, memory), the problem
// (sizes, value type, tiles) and the prediction per partition x schedule (per
// rank and step: block pair, tiles, FLOPs, bytes, times; makespan, idle
// fraction, memory).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/work.hpp>
#include <blockattn/schedule/schedule.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace blockattn {
namespace plan {

/// What one rank of the machine can do.
struct Hardware {
  std::string name = "custom";
  double flops = 0;              // F: attention FLOP/s per rank on full tiles (4 D per pair)
  double partial_tile_cost = 1;  // time of a partial (masked) tile over a full tile's
  double bandwidth = 0;          // B: bytes/s per rank and direction (<= 0: free)
  double latency = 0;            // seconds per message
  double memory_bytes = 0;       // per rank (<= 0: unlimited)
  double step_overhead = 0;      // seconds per step with work (launches, host)
  /// Two link levels: ranks r and s with r / ranks_per_node == s / ranks_per_node
  /// share a node and talk over intra_bandwidth / intra_latency (NVLink,
  /// shared memory), all others over bandwidth / latency (the network).
  /// ranks_per_node <= 0: one level, every link is bandwidth / latency.
  int ranks_per_node = 0;
  double intra_bandwidth = 0;  // bytes/s per rank and direction inside a node (<= 0: free)
  double intra_latency = 0;    // seconds per message inside a node
  /// Device memory read rate, bytes/s per rank: what bounds decode (each step
  /// reads the rank's whole KV shard). <= 0: unknown (decode predictions
  /// then count only compute and messages).
  double memory_bandwidth = 0;
  /// The backward's rate on full tiles, FLOP/s counted as 10 D per pair (the
  /// recomputed S, dV, dP, dQ, dK products); <= 0: `flops`, i.e. the
  /// backward takes 2.5x the forward's time on the same tiles.
  double backward_flops = 0;
  /// The backward's partial tile time over its full tile's (<= 0: partial_tile_cost).
  double backward_partial_tile_cost = 0;
  double backward_rate() const { return backward_flops > 0 ? backward_flops : flops; }
  double backward_partial_cost() const {
    return backward_partial_tile_cost > 0 ? backward_partial_tile_cost : partial_tile_cost;
  }
  bool same_node(int r, int s) const {
    return ranks_per_node > 0 && r / ranks_per_node == s / ranks_per_node;
  }
  /// Time of one message of `bytes` from rank r to rank s.
  double transfer_seconds(int r, int s, double bytes) const {
    const bool near = same_node(r, s);
    const double bw = near ? intra_bandwidth : bandwidth, lat = near ? intra_latency : latency;
    return lat + (bw > 0 ? bytes / bw : 0.0);
  }
};

/// One level of links: a preset of `flops`, link `bandwidth` (one direction),
/// memory per rank and its read rate, no latency.
inline Hardware preset(const char* name, double flops, double bandwidth, double memory,
                       double memory_bandwidth) {
  Hardware hw{name, flops, 1, bandwidth, 0, memory, 0};
  hw.memory_bandwidth = memory_bandwidth;
  return hw;
}

/// Published per-host figures of Ring Attention (arXiv:2310.01889) Table 2 (FLOPS, HBM,
/// unidirectional interconnect bandwidth between hosts); memory_bandwidth: the
/// vendors' HBM read rates (A100 80GB 2.0 TB/s, TPU v3 0.9, v4 1.2, v5e 0.82).
inline Hardware a100_nvlink() {
  return preset("A100 NVLink", 312e12, 300e9, 80e9, 2.039e12);
}
inline Hardware a100_infiniband() {
  return preset("A100 InfiniBand", 312e12, 12.5e9, 80e9, 2.039e12);
}
inline Hardware tpu_v3() {
  return preset("TPU v3", 123e12, 112e9, 16e9, 0.9e12);
}
inline Hardware tpu_v4() {
  return preset("TPU v4", 275e12, 268e9, 32e9, 1.2e12);
}
inline Hardware tpu_v5e() {
  return preset("TPU v5e", 196e12, 186e9, 16e9, 0.819e12);
}
/// A two-level cluster of published figures: H100 SXM (989e12 dense bf16
/// FLOP/s, 80 GB HBM3), 8 per node on NVLink 4 (900 GB/s bidirectional: 450e9
/// per direction), one 400 Gb/s NIC per GPU between nodes (50e9 bytes/s).
/// Peak rates; calibrate (blockattn/plan/calibrate.hpp) for what a kernel reaches.
inline Hardware h100_cluster() {
  Hardware hw = preset("H100 x8/node NVLink + 400Gb/s", 989e12, 50e9, 80e9, 3.35e12);  // HBM3
  hw.ranks_per_node = 8;
  hw.intra_bandwidth = 450e9;
  return hw;
}

/// What a prediction times: the forward call, the backward call (given O,
/// LSE and dO: the gradients of one training step), or both in turn (a
/// training step's attention: makespans add, memory is the larger of the two).
enum class Pass : int { forward, backward, training };

inline const char* pass_name(Pass p) {
  switch (p) {
    case Pass::forward:
      return "forward";
    case Pass::backward:
      return "backward";
    case Pass::training:
      return "training";
  }
  return "pass";
}

/// The attention problem as the kernels see it.
struct Problem {
  index_type N = 0;  // global sequence length
  int P = 1;         // ranks
  int batch = 1, heads = 1, kv_heads = 1, dim = 128;
  int dtype_bytes = 4;    // storage type: what q, k, v, o hold and K/V, Q travel in
  int compute_bytes = 0;  // compute type: LSE, softmax state, partial results (0: dtype_bytes;
                          // 4 for bf16 / fp16, whose blocks are widened to fp32 to compute)
  int block_q = 64, block_k = 64;  // kernel tile sizes
  int dim_padded = 0;              // head dim as stored in packed blocks (0: dim)
  /// The longest local length (predict() sets it from the partition; every
  /// buffer that travels has this many rows); 0: N / P.
  index_type most = 0;
  /// The backward kernels' tile sizes and padded head dim (0: the forward's).
  int bwd_block_q = 0, bwd_block_k = 0, bwd_dim_padded = 0;
  Pass pass =
      Pass::forward;  // what predict(), predict_ulysses(), predict_hybrid() and compare() time
  index_type local() const { return most > 0 ? most : N / P; }
  int stored_dim() const { return dim_padded > 0 ? dim_padded : dim; }
  int accumulator_bytes() const { return compute_bytes > 0 ? compute_bytes : dtype_bytes; }
  int backward_block_q() const { return bwd_block_q > 0 ? bwd_block_q : block_q; }
  int backward_block_k() const { return bwd_block_k > 0 ? bwd_block_k : block_k; }
  int backward_stored_dim() const { return bwd_dim_padded > 0 ? bwd_dim_padded : stored_dim(); }
  bool widens() const { return accumulator_bytes() != dtype_bytes; }
};

/// A Problem with the tile sizes and padded head dim that DistributedAttention
/// uses for value type T on ExecSpace.
template <class T, class ExecSpace = Kokkos::DefaultExecutionSpace,
          class Shape = DefaultTileShape<compute_t<T>, impl::is_host_space_v<ExecSpace>>,
          class BackwardShape = BackwardTileShape<compute_t<T>, impl::is_host_space_v<ExecSpace>>>
Problem problem_for(index_type N, int P, int batch, int heads, int kv_heads, int dim) {
  Problem p;
  p.N = N;
  p.P = P;
  p.batch = batch;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.dim = dim;
  p.dtype_bytes = int(sizeof(T));
  p.compute_bytes = int(sizeof(compute_t<T>));
  impl::with_shape_for<Shape>(dim, [&](auto static_d, auto shape) {
    using S = decltype(shape);
    p.block_q = S::block_q;
    p.block_k = S::block_k;
    p.dim_padded = impl::padded_head_dim<S, decltype(static_d)::value>(dim);
  });
  impl::with_shape_for<BackwardShape>(dim, [&](auto static_d, auto shape) {
    using S = decltype(shape);
    p.bwd_block_q = S::block_q;
    p.bwd_block_k = S::block_k;
    p.bwd_dim_padded = impl::padded_head_dim<S, decltype(static_d)::value>(dim);
  });
  return p;
}

/// Ring Attention (arXiv:2310.01889) §3: the smallest block (tokens per rank) whose compute,
/// 4 d c^2 FLOPs per head, hides the transfer of its K and V, 2 c d bytes each
/// per KV head: c = F * kv_heads * dtype_bytes / (2 * heads * B). For bf16 and
/// heads = kv_heads this is the paper's c = F / B.
inline double overlap_block_size(const Hardware& hw, int dtype_bytes = 2, int heads = 1,
                                 int kv_heads = 1) {
  return hw.flops * kv_heads * dtype_bytes / (2.0 * heads * hw.bandwidth);
}
/// Ring Attention (arXiv:2310.01889) Table 2: the minimal sequence length per device, s = 6 c.
inline double ring_min_sequence(const Hardware& hw, int dtype_bytes = 2) {
  return 6.0 * overlap_block_size(hw, dtype_bytes);
}

/// One rank at one step.
struct StepPlan {
  BlockTask task;    // the block pair computed (task.idle(): none)
  TileCounts tiles;  // per (batch, head)
  double flops = 0;  // 4 D per pair of computed tiles (masked pairs of partial tiles included)
  double compute_s = 0;
  double comm_s = 0;  // busy time of this rank's links for the messages completing at this step
  double start_s = 0, end_s = 0;
  std::int64_t bytes_sent = 0, bytes_received = 0;
  /// Of bytes_sent, what goes to ranks on other nodes (Hardware::same_node;
  /// one-level hardware: all of it).
  std::int64_t network_bytes = 0;
  bool idle() const { return tiles.computed() == 0; }
};

struct RankPlan {
  /// Per step: kept when the prediction is asked for them (predict()'s
  /// keep_steps, compare()'s; the CLI's --steps and --data), else empty. The
  /// totals below are there either way.
  std::vector<StepPlan> steps;
  int step_count = 0;                // steps of the schedule (steps.size() when kept)
  int idle_step_count = 0;           // of those, steps without work
  double compute_s = 0;              // sum of the steps' compute_s
  std::int64_t sent = 0;             // sum of the steps' bytes_sent
  std::int64_t network = 0;          // sum of the steps' network_bytes
  std::int64_t input_bytes = 0;      // the caller's q, k, v, o, lse on this rank
  std::int64_t workspace_bytes = 0;  // what the schedule allocates (RunStats::workspace_bytes)
  std::int64_t alltoall_bytes = 0;   // hybrid: sent in the group's all-to-alls (RunStats')
  std::int64_t alltoall_network_bytes = 0;  // hybrid: of those, to ranks on other nodes
  double alltoall_s = 0;                    // hybrid: time of those all-to-alls
  std::int64_t peak_bytes() const { return input_bytes + workspace_bytes; }
  double busy_s() const { return compute_s; }
  std::int64_t bytes_sent() const { return alltoall_bytes + sent; }
  /// Of bytes_sent(), what crosses between nodes (the slow links).
  std::int64_t network_bytes_sent() const { return alltoall_network_bytes + network; }
  /// Adds one step to the totals (and to `steps` when keep).
  void add(const StepPlan& st, bool keep) {
    ++step_count;
    idle_step_count += st.idle() ? 1 : 0;
    compute_s += st.compute_s;
    sent += st.bytes_sent;
    network += st.network_bytes;
    if (keep) steps.push_back(st);
  }
};

/// The prediction for one partition x mask x schedule.
struct Prediction {
  std::string partition, schedule;
  int ulysses = 0;  // hybrid: ranks per all-to-all group (P_a); 0 otherwise
  bool valid = true;
  std::string why_not;  // when !valid
  std::vector<RankPlan> ranks;
  double makespan_s = 0;
  double single_device_s = 0;  // the whole sequence on one rank, same kernel model
  double ring_makespan_s = 0;  // the contiguous ring on the same problem (set by compare)
  bool fits = true;
  int passes = 1;  // 2 for a training step (the forward's steps, then the backward's)
  int steps() const { return ranks.empty() ? 0 : ranks[0].step_count; }
  /// Rank-steps without work.
  std::int64_t idle_steps() const {
    std::int64_t n = 0;
    for (const auto& r : ranks) n += r.idle_step_count;
    return n;
  }
  /// DistFlashAttn (arXiv:2310.03294) eq. (2): idle rank-steps over P^2 (the P steps of the
  /// ring on P ranks), per pass.
  double idle_step_fraction() const {
    const double P = double(ranks.size());
    return double(idle_steps()) / (P * P * passes);
  }
  /// 1 - (sum of compute time) / (P * makespan).
  double idle_time_fraction() const {
    double busy = 0;
    for (const auto& r : ranks) busy += r.busy_s();
    return makespan_s > 0 ? 1.0 - busy / (double(ranks.size()) * makespan_s) : 0.0;
  }
  std::int64_t peak_bytes() const {
    std::int64_t b = 0;
    for (const auto& r : ranks) b = std::max(b, r.peak_bytes());
    return b;
  }
  std::int64_t max_bytes_sent() const {
    std::int64_t b = 0;
    for (const auto& r : ranks) b = std::max(b, r.bytes_sent());
    return b;
  }
  std::int64_t total_bytes_sent() const {
    std::int64_t b = 0;
    for (const auto& r : ranks) b += r.bytes_sent();
    return b;
  }
  /// The most bytes a rank sends to other nodes.
  std::int64_t max_network_bytes_sent() const {
    std::int64_t b = 0;
    for (const auto& r : ranks) b = std::max(b, r.network_bytes_sent());
    return b;
  }
  double speedup_over_ring() const { return ring_makespan_s / makespan_s; }
  double speedup_over_single() const { return single_device_s / makespan_s; }
};

}  // namespace plan
}  // namespace blockattn
