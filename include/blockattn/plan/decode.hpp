// SPDX-License-Identifier: Apache-2.0
// The decode step's latency over a KV cache sharded across P ranks
// (distributed/decode.hpp), for the tree and the ring merge:
//   local: the busiest rank reads its shard of K and V once (memory bound on
//          every device we know; the compute, 4 D FLOP per (row, key), is
//          counted when it is the larger), plus the step overhead;
//   tree:  two allreduces (the LSE max, then the scaled (O, 1) sums), each
//          ceil(log2 P) levels of recursive doubling: level l pairs ranks
//          2^l apart, inside a node while 2^l < ranks_per_node;
//   ring:  P - 1 steps, each one partial (O, LSE) of every row over the
//          ring's slowest link.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/plan/model.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace blockattn {
namespace plan {

/// One decode step's problem.
struct DecodeProblem {
  index_type cache = 0;  // cached tokens per sequence (all ranks together)
  int P = 1;             // ranks the cache is sharded over (round-robin)
  int batch = 1, rows = 1, heads = 8, kv_heads = 8, dim = 128;
  int dtype_bytes = 4;    // the cache's value type
  int compute_bytes = 4;  // the partial results' (fp32 for bf16 / fp16)
};

/// What one decode step costs on the busiest rank, in seconds.
struct DecodePrediction {
  index_type shard_tokens = 0;    // tokens per sequence on the busiest rank
  double shard_bytes = 0;         // K/V bytes it reads per step
  double local_s = 0;             // its split-KV attention
  double tree_s = 0, ring_s = 0;  // the merges
  int tree_levels = 0;            // steps of one allreduce (ceil log2 P)
  double partial_bytes = 0;       // one rank's partial results (O and LSE of every row)
  double tree_total() const { return local_s + tree_s; }
  double ring_total() const { return local_s + ring_s; }
};

/// The decode step of `pb` on `hw` (round-robin placement: the busiest
/// rank holds ceil(cache / P) tokens of each sequence).
inline DecodePrediction predict_decode(const Hardware& hw, const DecodeProblem& pb) {
  const char* fn = "plan::predict_decode";
  if (pb.P < 1 || pb.batch < 1 || pb.rows < 1 || pb.heads < 1 || pb.kv_heads < 1 ||
      pb.heads % pb.kv_heads != 0 || pb.dim < 1 || pb.cache < 0)
    impl::fail(fn, "problem: P = ", pb.P, ", batch = ", pb.batch, ", rows = ", pb.rows,
               ", heads = ", pb.heads, ", kv_heads = ", pb.kv_heads, ", dim = ", pb.dim,
               ", cache = ", pb.cache,
               "; expected positive sizes, kv_heads dividing heads, cache >= 0");
  DecodePrediction d;
  d.shard_tokens = (pb.cache + pb.P - 1) / pb.P;
  d.shard_bytes =
      2.0 * double(d.shard_tokens) * pb.batch * pb.kv_heads * pb.dim * double(pb.dtype_bytes);
  const double flop = 4.0 * double(d.shard_tokens) * pb.batch * pb.rows * pb.heads * pb.dim;
  const double read = hw.memory_bandwidth > 0 ? d.shard_bytes / hw.memory_bandwidth : 0.0;
  const double compute = hw.flops > 0 ? flop / hw.flops : 0.0;
  d.local_s = std::max(read, compute) + hw.step_overhead;
  const double rows = double(pb.batch) * pb.heads * pb.rows;
  d.partial_bytes = rows * (pb.dim + 1) * double(pb.compute_bytes);
  if (pb.P == 1) return d;
  // Tree: recursive doubling, level l between ranks 2^l apart.
  const double max_bytes = rows * double(pb.compute_bytes);
  for (int l = 0; (1 << l) < pb.P; ++l) {
    ++d.tree_levels;
    const int partner = 1 << l;
    d.tree_s += hw.transfer_seconds(0, partner, max_bytes) +
                hw.transfer_seconds(0, partner, d.partial_bytes);
  }
  // Ring: P - 1 steps over its slowest link: a node boundary when the ring
  // crosses one, else a link inside the node (or the one level).
  const bool crosses = hw.ranks_per_node > 0 && pb.P > hw.ranks_per_node;
  const double step =
      crosses ? hw.transfer_seconds(hw.ranks_per_node - 1, hw.ranks_per_node, d.partial_bytes)
              : hw.transfer_seconds(0, 1, d.partial_bytes);
  d.ring_s = double(pb.P - 1) * step;
  return d;
}

}  // namespace plan
}  // namespace blockattn
