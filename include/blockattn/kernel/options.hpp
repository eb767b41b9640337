// SPDX-License-Identifier: Apache-2.0
// Run-time options of the single-device calls and the largest head dim.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/fused.hpp>
#include <blockattn/kernel/host_matrix.hpp>
#include <blockattn/kernel/sinks.hpp>

#include <limits>

namespace blockattn {

/// Largest supported head dim.
inline constexpr int max_head_dim = 256;

/// fp32 forward products on CUDA tensor cores (ForwardOptions::fp32_tensor_cores).
enum class Fp32TensorCores {
  off,     ///< the fp32 kernels on CUDA cores
  tf32x3,  ///< three TF32 products per product: fp32-class (~2^-22 relative)
  tf32     ///< one TF32 product: 10-bit mantissas (PyTorch's allow_tf32)
};

/// Which implementation computes a block pair (kernel/dispatch.hpp): the
/// options ForwardOptions and DistributedOptions share.
struct ImplementationOptions {
  /// Run on BlockAttn's kernels even where a vendor's fused attention
  /// (cuDNN, on CUDA with bf16 / fp16) would take the call: for comparison,
  /// and for results that are the same bits on every backend and run.
  bool portable_only = false;
  /// bf16 inputs on a host space: AMX tile products where the CPU has them,
  /// AVX512-BF16 vector products on AMD's CPUs that have those (automatic;
  /// P rounded to bf16 before P V, see README "Numerics"), or the
  /// fp32 kernels (off: the fp32 forward's result rounded once, on every
  /// machine). host_matrix_engine() says what this machine runs.
  HostMatrix host_matrix = HostMatrix::automatic;
  /// 16-bit storage on CUDA: a call or block pair that cuDNN does not take (a
  /// mask that is not a band, a position map it cannot express, no cuDNN in
  /// the build; distributed: builds with cuDNN, whose K/V row layout it
  /// reads) runs on BlockAttn's tensor-core forward
  /// (kernel/cuda/flash_forward.hpp; head dims 64 and 128, no score policy;
  /// P rounded to 16 bits before P V, like cuDNN), or, when false, on the
  /// kernels that compute in fp32.
  bool tensor_cores = true;
  /// The backward of such calls and pairs (tensor_cores on; distributed: own
  /// queries, and travelled ones through a proxy O) on BlockAttn's
  /// tensor-core backward (kernel/cuda/flash_backward.hpp: deterministic, P
  /// and dS rounded to 16 bits before their products; finite inputs only,
  /// others take the fp32 kernels). Off by default: it compiles and its
  /// fragment maths is checked on the host, but it has not yet run on a GPU
  /// (bench/gpu_session.sh checks it against fp64 and times it).
  bool tensor_core_backward = false;
  /// 16-bit calls that cuDNN takes, when the mask hides keys: first check V
  /// for inf / NaN (one pass over V that the host waits for) and take
  /// BlockAttn's kernels where it holds one, since cuDNN multiplies the P = 0
  /// of masked keys into V (0 * inf = NaN in rows that cannot see it). false:
  /// skip the check (cuDNN's own behaviour for such inputs; no host wait).
  bool guard_masked_nonfinite = true;
  /// One answer however the work is split (docs/numerics.md "Invariant
  /// mode"): a row's O and LSE bitwise the same whatever the rank count,
  /// partition and schedule, and between attention_forward, the distributed
  /// forward, prefill_attention in any chunking and decode_attention (same
  /// machine, build and options). Two passes over the keys (the row's
  /// maximum first, so nothing is rescaled), tiles of invariant_tile keys on
  /// global positions summed whole in fp32, their partials added exactly
  /// (order-free fixed-point folds). fp32, bf16 and fp16 storage; BlockAttn's
  /// portable kernels only (no cuDNN, tensor cores or host matrix engine).
  bool invariant = false;
  /// Keys per canonical tile of the invariant mode: every block of keys a
  /// rank or call computes must hold whole tiles (a partition's pieces and a
  /// cache's shards cut at multiples of it; checked). 1 accepts any split
  /// (each key's term added exactly) at a higher cost. The same value gives
  /// the same bits; another value other bits.
  int invariant_tile = 64;
};

/// Run-time options of a forward call (and of a backward: attention_backward
/// reads the same struct); the implementation's in ImplementationOptions.
struct ForwardOptions : ImplementationOptions {
  /// Softmax scale; NaN (the default) means 1 / sqrt(head_dim).
  double scale = std::numeric_limits<double>::quiet_NaN();
  /// Global position of query row 0 and key row 0 (masks see global positions).
  index_type q_offset = 0;
  index_type k_offset = 0;
  /// Check the mask's classify() against allowed() on a sample of boxes
  /// before the work (kernel/policy_check.hpp); always on with
  /// -DBLOCKATTN_CHECK_POLICIES.
  bool check_policies = false;
  /// fp32 storage on CUDA: the single-device forward's products on tensor
  /// cores (kernel/cuda/flash_forward_f32.hpp; head dims 64 and 128, no score
  /// policy, 16-byte aligned rows, finite q, k, v: one pass over each that the
  /// host waits for, others take the fp32 kernels). tf32x3 splits each
  /// operand into two TF32 parts and adds three products, as PyTorch's fp32
  /// SDPA does on sm_80 and later; tf32 takes one (like allow_tf32). Off by
  /// default: it compiles and its fragment maths is checked on the host, but
  /// it has not yet run on a GPU (bench/gpu_session.sh checks it against fp64
  /// and times it).
  Fp32TensorCores fp32_tensor_cores = Fp32TensorCores::off;
  /// When set, the call adds the block pairs each implementation computed
  /// (BlockPathCounts: portable, fused, fused band pieces).
  BlockPathCounts* paths = nullptr;
  /// Attention sinks (kernel/sinks.hpp): one fp32 logit per query head, in
  /// the memory of the execution space, added to every row's softmax
  /// denominator (no value row). Empty: none. The forward returns the LSE with
  /// the sink in it; pass that LSE and the same sinks to the backward.
  SinkLogits sinks;
  /// Backward: dL/dsinks, one fp32 value per query head, written here (sum
  /// over the call's rows). Empty: not computed.
  SinkGradient sink_grad;
};

}  // namespace blockattn
