// SPDX-License-Identifier: Apache-2.0
// The single-device backward behind attention_backward(): packing, the choice
// between the fused and the two-kernel backward, and the launches. Also used
// by the distributed backward step loop.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/kernel/host/amx_backward.hpp>
#include <blockattn/kernel/host_matrix.hpp>
#include <blockattn/kernel/portable/backward_kernel.hpp>
#include <blockattn/kernel/portable/forward_launch.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>
#include <blockattn/policy/score.hpp>

#include <cmath>
#include <numeric>
#include <stdexcept>
#include <type_traits>

namespace blockattn {

namespace impl {

/// Everything a backward block call needs besides the views.
struct BackwardBlock {
  bool accumulate_dq = false, accumulate_dkv = false;
  bool run_dq = true, run_dkv = true;
  /// Which kernels: chosen from the sizes and the threads (automatic), or
  /// forced (tests compare both; the fused one only runs on host spaces).
  enum class Kernels { automatic, split, fused } kernels = Kernels::automatic;
  /// The fused kernel's teams per (batch, kv head) (KeyKernel::slices with `fused`); 0:
  /// chosen with the kernels.
  int key_slices = 0;
  /// The packed operands hold bf16 values (bf16 inputs): on host spaces with
  /// a matrix engine (per host_matrix, as the forward's), the pair runs on
  /// AMX tile products with P and dS rounded to bf16 (amx_backward.hpp).
  bool operands_bf16 = false;
  HostMatrix host_matrix = HostMatrix::automatic;
  /// The pair's operands in the matrix engine's layout, packed by the caller
  /// straight from its bf16 views (pack_amx_backward_views; the packed fp32
  /// blocks are then not read and may be empty), or empty: packed from the
  /// fp32 blocks at the launch. Only for a pair that runs on the engine.
  AmxBackwardOperands<Kokkos::HostSpace> matrix_operands;
};

/// Whether a backward of compute type T on ExecSpace has the AMX path in
/// this build (host spaces whose kernels are the AVX-512 ones, fp32 compute).
template <class ExecSpace, class T, class Shape>
inline constexpr bool backward_amx_capable =
    BLOCKATTN_AMX_BACKWARD&& is_host_space_v<ExecSpace>&& std::is_same<T, float>::value&&
        kernel_isa_v<ExecSpace, Shape> == HostIsa::avx512;

/// Whether the backward block pair runs on the host matrix engine in this
/// process (the path launch_backward takes); masks with a score policy too
/// (its pass runs on the key-major tiles, amx_bwd_score).
template <class ExecSpace, class T, class Shape, class Mask>
bool backward_uses_matrix(const BackwardBlock& blk, int dim) {
#if BLOCKATTN_AMX_BACKWARD
  if constexpr (backward_amx_capable<ExecSpace, T, Shape>)
    return blk.operands_bf16 && blk.run_dq && blk.run_dkv && dim <= amx_bwd_max_dim &&
           matrix_path(blk.host_matrix) != MatrixPath::none;
#endif
  (void)blk;
  (void)dim;
  return false;
}

#if BLOCKATTN_AMX_BACKWARD
/// The backward block pair on AMX tiles (amx_backward.hpp). `buffers`: where
/// a single-device call carves the operands and the dQ accumulator from.
template <class ExecSpace, class Mask, class QPos, class KPos, class DQV, class DKV, class DVV,
          class Buffers = NoCallBuffers>
void launch_backward_amx(const ExecSpace& exec, const ForwardExtents& e,
                         const PackedQueries<float, typename ExecSpace::memory_space>& queries,
                         const PackedKeys<float, typename ExecSpace::memory_space>& keys,
                         const DQV& dq, const DKV& dk, const DVV& dv, const Mask& mask,
                         const QPos& qpos, const KPos& kpos, float scale, const BackwardBlock& blk,
                         Buffers* buffers = nullptr) {
  using mem = typename ExecSpace::memory_space;
  using K = AmxBackwardKernel<ExecSpace, Mask, QPos, KPos, value_of<DKV>>;
  AmxBackwardOperands<mem> ops;
  if constexpr (std::is_same<mem, Kokkos::HostSpace>::value) {
    if (blk.matrix_operands.queries.data() != nullptr) ops = blk.matrix_operands;
  }
  if (ops.queries.data() == nullptr) {
    pack_amx_backward(exec, e, queries, keys, ops, buffers);
  } else if (ops.da != (e.dim + 31) / 32 * 32 ||
             ops.nq != (e.queries + K::BQ - 1) / K::BQ * K::BQ ||
             ops.nk != (e.keys + K::BK - 1) / K::BK * K::BK ||
             ops.queries.size() != 4 * std::size_t(e.batch) * e.heads * ops.q_size() ||
             ops.keys.size() != 3 * std::size_t(e.batch) * e.kv_heads * ops.k_size()) {
    throw std::logic_error(
        "BlockAttn: the matrix engine's backward operands differ from the pair's extents");
  }
  // A team per (batch, kv head), or per (batch, kv head, slice of its key
  // tiles) with its own dQ accumulator when there are fewer pairs than threads.
  const int pairs = e.batch * e.kv_heads, threads = exec.concurrency();
  const bool busy = pairs >= threads && (pairs % threads == 0 || pairs >= 4 * threads);
  const int k_tiles = ops.nk / K::BK;
  int slices = blk.key_slices > 0 ? blk.key_slices : busy ? 1 : threads / std::gcd(threads, pairs);
  slices = slices < k_tiles ? slices : k_tiles;
  slices = slices > 16 ? 16 : slices;
  using acc_view = Kokkos::View<float*, Kokkos::LayoutRight, mem>;
  const acc_view dqt = allocate_view<acc_view>(
      buffers, "blockattn::amx_dq_accumulator",
      std::size_t(slices) * e.batch * e.heads * std::size_t(ops.da) * ops.nq);
  Kokkos::deep_copy(exec, dqt, 0.0f);
  K f;
  static_cast<BlockExtents&>(f) = e;
  f.q_ops = ops.queries.data();
  f.k_ops = ops.keys.data();
  f.q_bad = ops.q_bad.data();
  f.do_bad = ops.do_bad.data();
  f.k_bad = ops.k_bad.data();
  f.lse2 = ops.lse2.data();
  f.drow = ops.drow.data();
  f.dqt = dqt.data();
  f.dk = typename K::out4(dk);
  f.dv = typename K::out4(dv);
  f.mask = mask;
  f.qpos = qpos;
  f.kpos = kpos;
  f.da = ops.da;
  f.nq = ops.nq;
  f.nk = ops.nk;
  f.group = e.heads / e.kv_heads;
  f.slices = slices;
  f.accumulate = blk.accumulate_dkv;
  f.matrix_tiles = matrix_path(blk.host_matrix) == MatrixPath::tiles;
  f.scale = scale;
  using Policy = typename K::policy_type;
  Policy policy(exec, pairs * slices, 1);
  policy.set_chunk_size(1);
  const std::size_t bytes = K::scratch_bytes(ops.da);
  f.scratch_level = bytes <= std::size_t(policy.scratch_size_max(0)) ? 0 : 1;
  policy.set_scratch_size(f.scratch_level, Kokkos::PerTeam(bytes));
  Kokkos::parallel_for("blockattn::backward_amx", policy, f);
  finish_dq_transposed(exec, dqt.data(), dq, ops.nq, ops.da, scale, blk.accumulate_dq, slices);
  exec.fence();  // the operands and the accumulator are freed (or returned) after this
}
#endif

/// dQ (queries side) and dK, dV (keys side) contributions of one block pair.
/// The query and key sides are packed; dq, dk, dv are
/// written or accumulated per `blk`.
/// `buffers`: where a single-device call carves its dQ accumulators from.
template <class ExecSpace, class T, int SD, class Shape, class Mask, class QPos, class KPos,
          class DQV, class DKV, class DVV, class Buffers = NoCallBuffers>
void launch_backward(const ExecSpace& exec, const ForwardExtents& e,
                     const PackedQueries<T, typename ExecSpace::memory_space>& queries,
                     const PackedKeys<T, typename ExecSpace::memory_space>& keys, const DQV& dq,
                     const DKV& dk, const DVV& dv, const Mask& mask, const QPos& qpos,
                     const KPos& kpos, T scale, const BackwardBlock& blk,
                     Buffers* buffers = nullptr) {
  using QK = QueryKernel<ExecSpace, T, SD, Shape, Mask, QPos, KPos, value_of<DQV>>;
  using KK = KeyKernel<ExecSpace, T, SD, Shape, Mask, QPos, KPos, value_of<DKV>>;
  static_assert(std::is_same<value_of<DKV>, value_of<DVV>>::value,
                "BlockAttn: dk and dv must have the same value type");
#if BLOCKATTN_AMX_BACKWARD
  if constexpr (backward_amx_capable<ExecSpace, T, Shape>) {
    if (e.queries > 0 && e.keys > 0 &&
        backward_uses_matrix<ExecSpace, T, Shape, Mask>(blk, e.dim)) {
      launch_backward_amx(exec, e, queries, keys, dq, dk, dv, mask, qpos, kpos, scale, blk,
                          buffers);
      return;
    }
  }
#endif
  if (blk.matrix_operands.queries.data() != nullptr)
    throw std::logic_error(
        "BlockAttn: matrix-engine operands given to a backward pair that does not run on it");
  auto setup = [&](auto& f) {
    static_cast<BlockExtents&>(f) = e;
    f.qside = queries;
    f.kside = keys;
    f.mask = mask;
    f.qpos = qpos;
    f.kpos = kpos;
    f.dim_padded = int(keys.k.extent(3));
    f.group = e.heads / e.kv_heads;
    f.q_tiles = (e.queries + Shape::block_q - 1) / Shape::block_q;
    f.k_tiles = (e.keys + Shape::block_k - 1) / Shape::block_k;
    f.scale = scale;
  };
  auto launch = [&](auto& f, int league, std::size_t bytes, const char* label) {
    using Policy = typename QK::policy_type;
    Policy policy =
        is_host_space_v<ExecSpace> ? Policy(exec, league, 1) : Policy(exec, league, Kokkos::AUTO);
    policy.set_chunk_size(1);
    f.scratch_level = bytes <= std::size_t(policy.scratch_size_max(0)) ? 0 : 1;
    policy.set_scratch_size(f.scratch_level, Kokkos::PerTeam(bytes));
    Kokkos::parallel_for(label, policy, f);
  };
  // One pass with 5 tile products (the fused KeyKernel) when a team per (batch, kv
  // head) keeps every thread busy: on host spaces, at least as many pairs as
  // threads and either a multiple of them or at least 4 per thread. Bitwise
  // the same results as the two kernels below.
  // With fewer pairs (fp32 compute only) the fused kernel runs too, each
  // pair's key tiles split over `slices` teams so that pairs x slices is a
  // multiple of the threads (at most 4 slices): 5 tile products instead of 7,
  // at the price of a dQ accumulator per slice and a dQ whose sums depend on
  // the thread count (dK and dV do not). fp64 keeps the two kernels: bitwise
  // what it computed before.
  const int pairs = e.batch * e.kv_heads, threads = exec.concurrency();
  const bool busy = pairs >= threads && (pairs % threads == 0 || pairs >= 4 * threads);
  const int k_tiles = (e.keys + Shape::block_k - 1) / Shape::block_k;
  int slices = blk.key_slices;
  if (slices <= 0) {
    const int g = std::gcd(threads, pairs);
    // At most 4 accumulators (memory); beyond that the two kernels.
    slices = !busy && std::is_same<T, float>::value && threads / g <= 4 ? threads / g : 1;
  }
  slices = slices < k_tiles ? slices : (k_tiles > 0 ? k_tiles : 1);
  using K = BackwardBlock::Kernels;
  if (is_host_space_v<ExecSpace> && blk.run_dq && blk.run_dkv && blk.kernels != K::split &&
      (busy || blk.kernels == K::fused || slices > 1)) {
    KK f;
    setup(f);
    f.dk = typename KK::out4(dk);
    f.dv = typename KK::out4(dv);
    f.accumulate = blk.accumulate_dkv;
    f.slices = slices;
    f.fused = true;
    using acc_view = typename PackedQueries<T, typename ExecSpace::memory_space>::row_view;
    f.dqacc =
        allocate_view<acc_view>(buffers, "blockattn::dq_accumulator", std::size_t(slices) * e.batch,
                                e.heads, f.q_tiles * Shape::block_q, f.dim_padded);
    Kokkos::deep_copy(exec, f.dqacc, T(0));
    launch(f, pairs * slices, KK::scratch_bytes(f.dim_padded, true), "blockattn::backward_fused");
    finish_dq(exec, f.dqacc, dq, e.queries, scale, blk.accumulate_dq, slices);
    return;
  }
  if (blk.run_dq) {
    QK f;
    setup(f);
    f.dq = typename QK::out4(dq);
    f.accumulate = blk.accumulate_dq;
    launch(f, e.batch * e.heads * f.q_tiles, QK::scratch_bytes(f.dim_padded, false),
           "blockattn::backward_dq");
  }
  if (blk.run_dkv) {
    KK f;
    setup(f);
    f.dk = typename KK::out4(dk);
    f.dv = typename KK::out4(dv);
    f.accumulate = blk.accumulate_dkv;
    f.slices = f.k_tiles > 0 ? f.k_tiles : 1;  // a team per key tile
    launch(f, e.batch * e.kv_heads * f.k_tiles, KK::scratch_bytes(f.dim_padded, false),
           "blockattn::backward_dkdv");
  }
}

}  // namespace impl

}  // namespace blockattn
