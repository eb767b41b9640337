// SPDX-License-Identifier: Apache-2.0
// Single-device blockwise attention backward: dQ, dK, dV from Q, K, V, the
// forward's O and LSE, and dO. Uses the saved LSE; never re-runs the forward.
#pragma once

#include <blockattn/attention_forward.hpp>
#include <blockattn/config.hpp>
#include <blockattn/errors.hpp>
#include <blockattn/impl/backward_kernel.hpp>
#include <blockattn/mask.hpp>
#include <blockattn/positions.hpp>
#include <blockattn/tile_shape.hpp>

#include <cmath>

namespace blockattn {

namespace impl {

/// Everything a backward block call needs besides the views.
struct BackwardBlock {
  bool accumulate_dq = false, accumulate_dkv = false;
  bool run_dq = true, run_dkv = true;
  /// Which kernels: chosen from the sizes and the threads (automatic), or
  /// forced (tests compare both; the fused one only runs on host spaces).
  enum class Kernels { automatic, split, fused } kernels = Kernels::automatic;
};

/// dQ (queries side) and dK, dV (keys side) contributions of one block pair.
/// The query and key sides are packed; dq, dk, dv are
/// written or accumulated per `blk`.
template <class ExecSpace, class T, int SD, class Shape, class Mask, class QPos, class KPos,
          class DQV, class DKV, class DVV>
void launch_backward(const ExecSpace& exec, const ForwardExtents& e,
                     const PackedQueries<T, typename ExecSpace::memory_space>& queries,
                     const PackedKeys<T, typename ExecSpace::memory_space>& keys, const DQV& dq,
                     const DKV& dk, const DVV& dv, const Mask& mask, const QPos& qpos,
                     const KPos& kpos, T scale, const BackwardBlock& blk) {
  using QK = QueryKernel<ExecSpace, T, SD, Shape, Mask, QPos, KPos>;
  using KK = KeyKernel<ExecSpace, T, SD, Shape, Mask, QPos, KPos>;
  auto setup = [&](auto& f) {
    f.qrows = queries.q;
    f.dorows = queries.dout;
    f.lse2v = queries.lse2;
    f.drv = queries.drow;
    f.kt = keys.kt;
    f.vt = keys.vt;
    f.krows = keys.k;
    f.mask = mask;
    f.qpos = qpos;
    f.kpos = kpos;
    f.batch = e.batch;
    f.heads = e.heads;
    f.kv_heads = e.kv_heads;
    f.queries = e.queries;
    f.keys = e.keys;
    f.dim = e.dim;
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
  // One pass with 5 tile products (FusedKernel) when a team per (batch, kv
  // head) keeps every thread busy: on host spaces, at least as many pairs as
  // threads and either a multiple of them or at least 4 per thread. Bitwise
  // the same results as the two kernels below.
  const int pairs = e.batch * e.kv_heads, threads = exec.concurrency();
  const bool busy = pairs >= threads && (pairs % threads == 0 || pairs >= 4 * threads);
  using K = BackwardBlock::Kernels;
  if (is_host_space_v<ExecSpace> && blk.run_dq && blk.run_dkv && blk.kernels != K::split &&
      (busy || blk.kernels == K::fused)) {
    using FK = FusedKernel<ExecSpace, T, SD, Shape, Mask, QPos, KPos>;
    FK f;
    setup(f);
    f.dk = typename FK::out4(dk);
    f.dv = typename FK::out4(dv);
    f.accumulate = blk.accumulate_dkv;
    f.dqacc = typename PackedQueries<T, typename ExecSpace::memory_space>::row_view(
        "blockattn::dq_accumulator", e.batch, e.heads, f.q_tiles * Shape::block_q, f.dim_padded);
    launch(f, pairs, FK::scratch_bytes(f.dim_padded), "blockattn::backward_fused");
    finish_dq(exec, f.dqacc, dq, scale, blk.accumulate_dq);
    return;
  }
  if (blk.run_dq) {
    QK f;
    setup(f);
    f.dq = typename QK::out4(dq);
    f.accumulate = blk.accumulate_dq;
    launch(f, e.batch * e.heads * f.q_tiles, QK::scratch_bytes(f.dim_padded),
           "blockattn::backward_dq");
  }
  if (blk.run_dkv) {
    KK f;
    setup(f);
    f.dk = typename KK::out4(dk);
    f.dv = typename KK::out4(dv);
    f.accumulate = blk.accumulate_dkv;
    launch(f, e.batch * e.kv_heads * f.k_tiles, KK::scratch_bytes(f.dim_padded),
           "blockattn::backward_dkdv");
  }
}

template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class DOV, class DQV,
          class DKV, class DVV>
ForwardExtents validate_backward(const char* fn, const QV& q, const KV& k, const VV& v, const OV& o,
                                 const LV& lse, const DOV& dout, const DQV& dq, const DKV& dk,
                                 const DVV& dv, double scale) {
  const ForwardExtents e = validate_forward<ExecSpace>(fn, q, k, v, o, lse, scale);
  require_accessible<ExecSpace, typename DOV::memory_space>(fn, "dout");
  require_accessible<ExecSpace, typename DQV::memory_space>(fn, "dq");
  require_accessible<ExecSpace, typename DKV::memory_space>(fn, "dk");
  require_accessible<ExecSpace, typename DVV::memory_space>(fn, "dv");
  const char* names[4] = {"batch", "seq", "heads", "head_dim"};
  for (int d = 0; d < 4; ++d) {
    require_extent(fn, "dout", dout, d, names[d], q.extent(d), "the same extent of q");
    require_extent(fn, "dq", dq, d, names[d], q.extent(d), "the same extent of q");
    require_extent(fn, "dk", dk, d, names[d], k.extent(d), "the same extent of k");
    require_extent(fn, "dv", dv, d, names[d], v.extent(d), "the same extent of v");
  }
  return e;
}

template <class... Vs>
constexpr bool backward_grad_views_ok() {
  return (... && (Kokkos::is_view<Vs>::value && Vs::rank == 4));
}

}  // namespace impl

/// dQ, dK, dV of O = softmax(scale * Q K^T, masked) V, on one device.
///   q, k, v, o, lse: as passed to / returned by attention_forward (same mask and options)
///   dout: dL/dO, shape of o;  dq, dk, dv: outputs, shapes of q, k, v.
/// Rows with no allowed key (LSE = -inf) get zero gradients.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class DOV, class DQV,
          class DKV, class DVV, class Mask = FullMask,
          class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
void attention_backward(const ExecSpace& exec, const QV& q, const KV& k, const VV& v, const OV& o,
                        const LV& lse, const DOV& dout, const DQV& dq, const DKV& dk, const DVV& dv,
                        const Mask& mask = {}, const ForwardOptions& opts = {}) {
  impl::check_forward_view_types<QV, KV, VV, OV, LV>();
  impl::check_mask_policy<Mask>();
  static_assert(impl::backward_grad_views_ok<DOV, DQV, DKV, DVV>(),
                "BlockAttn: dout, dq, dk and dv must be rank-4 Kokkos::Views "
                "(batch, seq, heads, head_dim)");
  if constexpr (impl::forward_views_ok<QV, KV, VV, OV, LV>() && is_mask_policy_v<Mask> &&
                impl::backward_grad_views_ok<DOV, DQV, DKV, DVV>()) {
    using T = typename OV::non_const_value_type;
    static_assert(std::is_same<typename DQV::non_const_value_type, T>::value &&
                      std::is_same<typename DKV::non_const_value_type, T>::value &&
                      std::is_same<typename DVV::non_const_value_type, T>::value &&
                      std::is_same<typename DOV::non_const_value_type, T>::value,
                  "BlockAttn: dout, dq, dk and dv must have the value type of q");
    using mem = typename ExecSpace::memory_space;
    using Shape = BackwardTileShape<T, impl::is_host_space_v<ExecSpace>>;
    const char* fn = "attention_backward";
    impl::require_offsets(fn, opts);
    const impl::ForwardExtents e =
        impl::validate_backward<ExecSpace>(fn, q, k, v, o, lse, dout, dq, dk, dv, opts.scale);
    if (impl::check_policies_always || opts.check_policies)
      impl::check_mask_contract(fn, exec, mask, opts.q_offset, opts.q_offset + e.queries,
                                opts.k_offset, opts.k_offset + e.keys);
    const T s = impl::softmax_scale<T>(opts.scale, e.dim);
    impl::with_shape_for<Shape>(e.dim, [&](auto static_d, auto shape) {
      constexpr int SD = decltype(static_d)::value;
      using S = decltype(shape);
      const int dp = impl::padded_head_dim<S, SD>(e.dim);
      auto keys = impl::allocate_packed_keys<T, mem>(e.batch, e.kv_heads, e.keys, dp, S::block_k);
      impl::pack_keys(exec, k, v, keys);
      auto queries =
          impl::allocate_packed_queries<T, mem>(e.batch, e.heads, e.queries, dp, S::block_q);
      impl::pack_queries(exec, q, dout, o, lse, queries);
      impl::launch_backward<ExecSpace, T, SD, S>(
          exec, e, queries, keys, dq, dk, dv, mask, OffsetPositions{opts.q_offset},
          OffsetPositions{opts.k_offset}, s, impl::BackwardBlock{});
    });
  }
}

/// Same, on a default-constructed instance of the Views' execution space.
template <class QV, class KV, class VV, class OV, class LV, class DOV, class DQV, class DKV,
          class DVV, class Mask = FullMask, class = std::enable_if_t<Kokkos::is_view<QV>::value>>
void attention_backward(const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                        const DOV& dout, const DQV& dq, const DKV& dk, const DVV& dv,
                        const Mask& mask = {}, const ForwardOptions& opts = {}) {
  attention_backward(typename OV::execution_space{}, q, k, v, o, lse, dout, dq, dk, dv, mask, opts);
}

}  // namespace blockattn
