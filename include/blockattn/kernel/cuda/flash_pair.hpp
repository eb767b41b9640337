// SPDX-License-Identifier: Apache-2.0
// BlockAttn's tensor-core kernels (CUDA, 16-bit; kernel/cuda/flash_path.hpp)
// on one block pair of the step loops: the forward into a normalised
// partial, read from a packed K/V block in its rows layout; the backward's
// 16-bit gradients added into the pair's fp32 sums. The dispatcher
// (kernel/dispatch.hpp) decides when they run.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/cuda/flash_path.hpp>
#include <blockattn/kernel/impl/pack.hpp>
#include <blockattn/kernel/impl/pair_ops.hpp>

#include <utility>

namespace blockattn::impl {

/// The whole pair on BlockAttn's tensor-core forward (CUDA, 16-bit;
/// kernel/cuda/flash_path.hpp), reading the packed block kv in its rows
/// layout: normalised O and LSE of every row into part_o and part_lse
/// (enqueued on exec). False: the forward does not take the pair (nothing done).
template <class ExecSpace, class QV, class V, class PO, class PL, class Mask, class QP, class KP>
bool tensor_core_forward_pair(const ExecSpace& exec, const BlockExtents& e, const QV& q,
                              const PackedKV<V, typename ExecSpace::memory_space>& kv,
                              const PO& part_o, const PL& part_lse, const Mask& mask,
                              const QP& qpos, const KP& kpos, float scale) {
  if (kv.panel != 1) return false;
  FlashOperand k, v;
  k.data = kv.kt.data();
  k.stride[0] = std::int64_t(kv.kt.stride(0));
  k.stride[1] = std::int64_t(kv.kt.extent(3));  // panel 1: key rows of dim_padded
  k.stride[2] = std::int64_t(kv.kt.stride(1));
  v.data = kv.v.data();
  v.stride[0] = std::int64_t(kv.v.stride(0));
  v.stride[1] = std::int64_t(kv.v.stride(2));
  v.stride[2] = std::int64_t(kv.v.stride(1));
  return flash_forward(exec, e, flash_operand(q), k, v, part_o, part_lse, mask, qpos, kpos, scale);
}

/// The normalised result of tensor_core_forward_pair (part_o in the storage
/// type, part_lse) as a result in the compute type (out_o, out_lse).
template <class ExecSpace, class PO, class PL, class OO, class OL>
void tensor_core_result(const ExecSpace& exec, const BlockExtents& e, const PO& part_o,
                        const PL& part_lse, const OO& out_o, const OL& out_lse) {
  fill_unseen_rows(exec, out_o, out_lse, 0, 0);
  widen_result(exec, out_o, out_lse, part_o, part_lse, e.queries);
}

/// The backward of one block pair on BlockAttn's tensor-core backward
/// (CUDA, 16-bit; kernel/cuda/flash_path.hpp flash_backward), for pairs the
/// fused provider does not take (any mask on the pair's global positions):
/// the queries q, o (a travelled slot: its proxy O, fused_travelled_rows),
/// dout (e.queries rows, storage V) and lse (natural log) against the K/V
/// block k, v (e.keys rows). The pair's 16-bit dQ, dK, dV go into tq, tk,
/// tv and are added, widened, into dq, dk, dv (the pair's sums in the
/// compute type), first zeroed unless acc_dq / acc_dkv: one rounding to 16
/// bits per pair, as a fused piece's. False, nothing done: the pair takes
/// the kernels (not compiled for ExecSpace, V, Mask; a head dim, stride or
/// alignment the kernel declines; inf / NaN in an operand).
template <class ExecSpace, class Mask, class QP, class KP, class QV, class OV, class DOV, class LV,
          class KV, class VV, class TQ, class TK, class GQ, class GK>
bool tensor_core_backward_pair(const ExecSpace& exec, const Mask& mask, const QP& qpos,
                               const KP& kpos, const BlockExtents& e, const QV& q, const OV& o,
                               const DOV& dout, const LV& lse, const KV& k, const VV& v,
                               const TQ& tq, const TK& tk, const TK& tv, const GQ& dq, const GK& dk,
                               const GK& dv, bool acc_dq, bool acc_dkv, float scale) {
  using V = typename TQ::non_const_value_type;
  if constexpr (flash_enabled<ExecSpace, V, Mask>()) {
    if (e.queries <= 0 || e.keys <= 0) return false;
    const auto rows = [](const auto& x, index_type n) {
      return Kokkos::subview(x, Kokkos::ALL, std::make_pair(index_type(0), n), Kokkos::ALL,
                             Kokkos::ALL);
    };
    if (!flash_backward(exec, e, q, k, v, o, lse, dout, rows(tq, e.queries), rows(tk, e.keys),
                        rows(tv, e.keys), mask, qpos, kpos, scale))
      return false;
    clear_pair_sums(exec, dq, dk, dv, acc_dq, acc_dkv);
    add_piece_rows(exec, dq, tq, 0, e.queries);
    add_piece_rows(exec, dk, tk, 0, e.keys);
    add_piece_rows(exec, dv, tv, 0, e.keys);
    return true;
  } else {
    (void)exec, (void)mask, (void)qpos, (void)kpos, (void)e, (void)q, (void)o, (void)dout,
        (void)lse, (void)k, (void)v, (void)tq, (void)tk, (void)tv, (void)dq, (void)dk, (void)dv,
        (void)acc_dq, (void)acc_dkv, (void)scale;
    return false;
  }
}

}  // namespace blockattn::impl
