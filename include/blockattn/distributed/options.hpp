// SPDX-License-Identifier: Apache-2.0
// What a distributed call takes besides its Views (DistributedOptions) and
// what it reports (RunStats: per step the block pair, tiles, bytes, time).
// Shared by DistributedAttention, UlyssesAttention and HybridAttention.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/fused.hpp>
#include <blockattn/kernel/host_matrix.hpp>
#include <blockattn/kernel/options.hpp>
#include <blockattn/kernel/sinks.hpp>
#include <blockattn/kernel/work.hpp>

#include <cstdint>
#include <limits>
#include <vector>

namespace blockattn {

/// What one rank did at one step of a schedule.
struct StepStats {
  int step = 0;
  int source = 0;         // rank whose K/V block was used (Q ring: whose queries)
  int query_source = -1;  // rank whose queries were used (-1: idle step)
  bool computed = false;  // false: the whole block was masked out (no kernel)
  /// Which implementation computed the pair (kernel/fused.hpp): BlockAttn's
  /// kernels or a vendor's fused attention (none: nothing computed).
  BlockPath path = BlockPath::none;
  int fused_pieces = 0;  // band pieces the fused path ran (kernel/band.hpp)
  TileCounts tiles;      // per (batch, head); pairs only with count_pairs
  std::int64_t bytes_sent = 0;
  std::int64_t bytes_received = 0;
  double seconds = 0.0;  // wall time of the step on this rank (compute + wait)
  /// The part of `seconds` from the first launch of the step's compute to
  /// its fence (the transfers in flight are tested in between; the waits
  /// that complete them are not in it): this rank's busy time.
  double compute_seconds = 0.0;
};

/// What one rank did in one forward call.
struct RunStats {
  std::vector<StepStats> steps;
  int block_q = 0, block_k = 0;      // tile sizes used
  std::int64_t workspace_bytes = 0;  // memory the schedule allocated on this rank
  /// Besides workspace_bytes: the fused path's buffers (forward: a pair's
  /// normalised O and LSE, rows of the longest rank; backward: a band piece's
  /// dQ, dK, dV in the storage type, and where queries travel a slot's proxy
  /// O and natural-log LSE), where a fused provider is built in (cuDNN;
  /// 16-bit storage) and not portable_only.
  std::int64_t fused_workspace_bytes = 0;
  /// HybridAttention: bytes this rank sent in the all-to-alls inside its group
  /// (the steps hold the ring's across groups), and their wall time.
  std::int64_t alltoall_bytes = 0;
  double alltoall_seconds = 0.0;
  std::int64_t bytes_sent() const {
    std::int64_t b = alltoall_bytes;
    for (const auto& s : steps) b += s.bytes_sent;
    return b;
  }
  TileCounts tiles() const {
    TileCounts t;
    for (const auto& s : steps) t += s.tiles;
    return t;
  }
  /// The block pairs each implementation computed.
  BlockPathCounts paths() const {
    BlockPathCounts c;
    for (const auto& s : steps) {
      c.user += s.path == BlockPath::user ? 1 : 0;
      c.portable += s.path == BlockPath::portable || s.path == BlockPath::matrix ? 1 : 0;
      c.matrix += s.path == BlockPath::matrix ? 1 : 0;
      c.fused += s.path == BlockPath::fused ? 1 : 0;
      c.fused_pieces += s.fused_pieces;
    }
    return c;
  }
  double compute_seconds() const {
    double c = 0.0;
    for (const auto& s : steps) c += s.compute_seconds;
    return c;
  }
};

/// Run-time options of a distributed forward (and backward) call; the
/// implementation of its block pairs in ImplementationOptions.
struct DistributedOptions : ImplementationOptions {
  double scale = std::numeric_limits<double>::quiet_NaN();  // NaN: 1 / sqrt(head_dim)
  bool count_pairs = false;  // also count allowed pairs (host cost ~ pairs of partial tiles)
  bool communicate = true;   // false: compute the same steps on the local block only
                             // (measures compute time without communication; wrong result)
  /// > 0: a transfer that has not completed after this many seconds throws
  /// blockattn::timeout_error naming the step, the peer and the message
  /// (instead of waiting forever for a rank that failed or never posts).
  double timeout_seconds = 0.0;
  /// Check the mask's classify() against allowed() on a sample of boxes of
  /// the global sequence before the work (every rank the same sample);
  /// always on with -DBLOCKATTN_CHECK_POLICIES.
  bool check_policies = false;
  /// Attention sinks (kernel/sinks.hpp): one fp32 logit per query head, in
  /// the execution space's memory, the same on every rank (compared in the
  /// consensus). Each row's sink enters once, after the last merge of its
  /// partial results, on the rank that returns the row. Empty: none.
  SinkLogits sinks;
  /// Backward: dL/dsinks (one fp32 per query head), summed over the rows of
  /// every rank: the same values on every rank. Empty: not computed.
  SinkGradient sink_grad;
};

/// How the ranks' partial results (O, LSE) merge.
enum class MergeAlgorithm { tree, ring };

/// Options of decode_attention and prefill_attention.
struct ServeOptions {
  /// Softmax scale; NaN (the default) means 1 / sqrt(head_dim).
  double scale = std::numeric_limits<double>::quiet_NaN();
  MergeAlgorithm merge = MergeAlgorithm::tree;
  /// Key ranges per (sequence, kv head) on each rank; 0: automatic.
  int splits = 0;
  /// Compare the call's configuration across ranks first (one small
  /// allreduce): a mismatch is a clear error on every rank instead of a hang
  /// or a wrong answer. A serving loop that has checked may turn it off.
  bool check_config = true;
  /// > 0: a transfer of the ring merge that has not completed after this
  /// many seconds throws blockattn::timeout_error naming the step, the peer
  /// and the message (as DistributedOptions::timeout_seconds).
  double timeout_seconds = 0.0;
  /// Attention sinks (kernel/sinks.hpp): one fp32 logit per query head, in
  /// the execution space's memory, the same on every rank; folded into the
  /// normalisation of the merge over the ranks (a 16-bit output is rounded
  /// once). Empty: none.
  SinkLogits sinks;
  /// prefill_attention: a chunk of at least this many rows runs on
  /// attention_forward's kernels (the shard's keys packed once for the whole
  /// chunk, query tiles of up to 96 rows, bf16 on the host's matrix engine)
  /// where, on a host space, its query tiles keep at least half of the
  /// threads busy; otherwise on the split-KV decode kernel (query rows in
  /// tiles of up to 16, the keys read again for each tile), as decode_attention
  /// always does. A value above any chunk's rows keeps the decode kernel.
  /// -1 (automatic): 24 for bf16 caches whose decode kernel runs AVX512-BF16
  /// dot products (DecodeOptions::host_matrix), 12 otherwise. On a 2-core
  /// Zen 4 (`blockattn_bench_decode --prefill`, 4096 and 16384 cached tokens):
  /// fp32 and bf16 on fp32 vectors, the decode kernel ran chunks of 8 rows
  /// 1.2-1.6x faster than the forward's kernels, those ran 12 rows 0.98-1.29x
  /// and 16 rows 1.1-1.4x as fast as it (AVX-512 and AVX2 builds); bf16 on
  /// the dot products, the decode kernel ran 16 rows 1.3-1.6x faster, 24
  /// rows 0.94-1.06x, and the forward's kernels 32 rows 1.15-1.6x faster.
  int prefill_forward_rows = -1;
  /// bf16 on the host: a prefill chunk on the forward's kernels takes AMX /
  /// AVX512-BF16 tile products where automatic takes them
  /// (ForwardOptions::host_matrix); decode and short chunks on the split-KV
  /// kernel take AVX512-BF16 dot products where the engine runs vectors
  /// (DecodeOptions::host_matrix).
  HostMatrix host_matrix = HostMatrix::automatic;
  /// The invariant mode (ImplementationOptions::invariant): each row's O and
  /// LSE the bits attention_forward gives over the whole sequence with the
  /// same invariant_tile, whatever the rank count, the placement and the
  /// chunks of prefill. The placement must keep canonical tiles whole on one
  /// rank (interleave or tokens_per_rank multiples of invariant_tile; checked).
  /// Two passes over each shard on the portable kernels, with two small
  /// allreduces (the rows' bounds, then their exact sums) instead of the merge.
  bool invariant = false;
  int invariant_tile = 64;
};

}  // namespace blockattn
