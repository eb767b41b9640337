// SPDX-License-Identifier: Apache-2.0
// The fused path of the block product for the step loops: which block pairs
// a vendor's fused attention takes (kernel/fused.hpp, kernel/band.hpp), the
// layout its K/V blocks travel in, and one band piece's forward.
//
//   storage = fused_storage_layout<V, ExecSpace>(layout)  the layout K/V
//             blocks of storage type V travel in: rows (panel 1) when a
//             provider is built in, so that it reads them in place;
//             widen_forward_block relays them into the kernels' panels
//   pair = fused_pair<ExecSpace, V>(mask, qpos, queries, kpos, keys, e, options)
//             pair.fused: every band piece goes to the provider
//   fused_forward_piece(exec, e, piece, q, kv, part_o, part_lse, scale)
//             the piece's rows of part_o (storage V) and part_lse (natural
//             log); the caller merges them (SoftmaxState::merge_partial)
//   fused_forward_result<ExecSpace, V>(exec, mask, qpos, kpos, e, q, kv, part_o, part_lse,
//                                      out_o, out_lse, scale, guard, pieces)
//             a pair's whole normalised result (a helper's task: another
//             rank's queries) on the provider, one band piece; false: the kernels
//   rows = fused_query_rows(q, o, dout, lse)   a backward's own query rows as operands
//   rows = fused_travelled_rows(exec, slot, dim, o_proxy, lse)   a travelled query slot's
//             (no O: a proxy O whose rowsum with dO is the slot's D)
//   fused_backward_pair<ExecSpace, V>(exec, mask, qpos, kpos, e, rows, k, v, tq, tk, tv,
//                                     dq, dk, dv, acc_dq, acc_dkv, scale, guard, pieces)
//             a backward block pair on the provider: every band piece's
//             gradients added into the pair's fp32 sums; false: the kernels
//   tensor_core_backward_pair(exec, mask, qpos, kpos, e, q, o, dout, lse, k, v, tq, tk, tv,
//                             dq, dk, dv, acc_dq, acc_dkv, scale)
//             the same for any mask on BlockAttn's tensor-core backward
//             (CUDA; ForwardOptions/DistributedOptions::tensor_core_backward)
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/band.hpp>
#include <blockattn/kernel/block_product.hpp>
#include <blockattn/kernel/fused.hpp>
#include <blockattn/kernel/impl/flash_path.hpp>
#include <blockattn/kernel/impl/fused_path.hpp>

#include <array>
#include <cstddef>
#include <utility>

namespace blockattn {

/// Whether a fused provider is built in for ExecSpace and storage type V.
template <class ExecSpace, class V>
constexpr bool fused_available_v = impl::fused_enabled<ExecSpace, V>();

/// The layout K/V blocks of storage type V travel in (see the top of this file).
template <class V, class ExecSpace>
BlockLayout fused_storage_layout(const BlockLayout& layout) {
  BlockLayout l = layout;
  if constexpr (fused_available_v<ExecSpace, V>) {
    l.kt_panel = 1;
    l.v_panel = l.dim_padded;
  }
  return l;
}

/// A block pair's band pieces and whether the fused provider takes them all.
struct FusedPair {
  bool fused = false;
  BandSplit split;
};

/// The fused forward of one band piece: queries q (batch, rows, heads, dim;
/// storage V) against the packed block kv (rows layout), into rows
/// [piece.row_begin, piece.row_end) of part_o and part_lse.
template <class ExecSpace, class QV, class V, class PO, class PL>
FusedForwardCall fused_forward_call(const BlockExtents& e, const BandPiece& piece, const QV& q,
                                    const PackedKV<V, typename ExecSpace::memory_space>& kv,
                                    const PO& part_o, const PL& part_lse, float scale) {
  FusedForwardCall c;
  c.p = impl::fused_problem(e, piece, impl::fused_type<V>(), scale);
  c.q = impl::fused_rows(q, piece.row_begin);
  c.o = impl::fused_rows(part_o, piece.row_begin);
  c.lse = impl::fused_lse(part_lse, piece.row_begin);
  const std::int64_t dp = std::int64_t(kv.kt.extent(3));
  c.k.data = kv.kt.data() + piece.col_begin * dp;
  c.k.stride[0] = std::int64_t(kv.kt.stride(0));
  c.k.stride[1] = std::int64_t(kv.kt.stride(1));
  c.k.stride[2] = dp;
  c.k.stride[3] = 1;
  c.v.data = kv.v.data() + piece.col_begin * dp;
  c.v.stride[0] = std::int64_t(kv.v.stride(0));
  c.v.stride[1] = std::int64_t(kv.v.stride(1));
  c.v.stride[2] = std::int64_t(kv.v.stride(2));
  c.v.stride[3] = 1;
  return c;
}

/// Which implementation computes the pair: the fused provider when it is
/// built in for (ExecSpace, V), not options.portable_only, the pair's mask is
/// band pieces in cuDNN's form and the provider supports each piece's
/// problem (a probe call with the pair's shapes; q, kv, part_o, part_lse:
/// the Views the pieces will use).
template <class ExecSpace, class V, class Mask, class QP, class KP, class QV, class PO, class PL>
FusedPair fused_pair(const Mask& mask, const QP& qpos, const KP& kpos, const BlockExtents& e,
                     bool portable_only, const QV& q,
                     const PackedKV<V, typename ExecSpace::memory_space>& kv, const PO& part_o,
                     const PL& part_lse, float scale) {
  FusedPair f;
  if constexpr (fused_available_v<ExecSpace, V>) {
    if (portable_only || kv.panel != 1 || e.queries <= 0 || e.keys <= 0) return f;
    if (!impl::fused_shape_ok(e)) return f;
    if (!impl::unit_head_stride(q, part_o)) return f;
    f.split = band_split(mask, qpos, e.queries, kpos, e.keys);
    if (!f.split.expressible) return f;
    for (const BandPiece& p : f.split) {
      if (!cudnn_band(p).supported) return f;
      const FusedForwardCall c =
          fused_forward_call<ExecSpace>(e, p, q, kv, part_o, part_lse, scale);
      if (!impl::FusedProvider<ExecSpace, V>::supports(c)) return f;
    }
    f.fused = true;
  } else {
    (void)mask, (void)qpos, (void)kpos, (void)e, (void)portable_only, (void)q, (void)kv,
        (void)part_o, (void)part_lse, (void)scale;
  }
  return f;
}

/// Whether the mask allows every (query, key) pair of a block pair.
template <class Mask, class QP, class KP>
bool pair_covers_all(const Mask& mask, const QP& qpos, index_type queries, const KP& kpos,
                     index_type keys) {
  return queries <= 0 || keys <= 0 ||
         mask.classify(qpos(0), qpos(queries - 1) + 1, kpos(0), kpos(keys - 1) + 1) ==
             TileKind::full;
}

/// Whether a packed block's V holds inf or NaN (the host waits for the
/// answer): a fused provider would leak it into rows the mask hides it from
/// (kernel/impl/fused_path.hpp has_nonfinite).
template <class ExecSpace, class V>
bool packed_v_has_nonfinite(const ExecSpace& exec,
                            const PackedKV<V, typename ExecSpace::memory_space>& kv) {
  return impl::has_nonfinite(exec, kv.v);
}

/// The whole pair on BlockAttn's tensor-core forward (CUDA, 16-bit;
/// kernel/impl/flash_path.hpp), reading the packed block kv in its rows
/// layout: normalised O and LSE of every row into part_o and part_lse
/// (enqueued on exec). False: the forward does not take the pair (nothing done).
template <class ExecSpace, class QV, class V, class PO, class PL, class Mask, class QP, class KP>
bool tensor_core_forward_pair(const ExecSpace& exec, const BlockExtents& e, const QV& q,
                              const PackedKV<V, typename ExecSpace::memory_space>& kv,
                              const PO& part_o, const PL& part_lse, const Mask& mask,
                              const QP& qpos, const KP& kpos, float scale) {
  if (kv.panel != 1) return false;
  impl::FlashOperand k, v;
  k.data = kv.kt.data();
  k.stride[0] = std::int64_t(kv.kt.stride(0));
  k.stride[1] = std::int64_t(kv.kt.extent(3));  // panel 1: key rows of dim_padded
  k.stride[2] = std::int64_t(kv.kt.stride(1));
  v.data = kv.v.data();
  v.stride[0] = std::int64_t(kv.v.stride(0));
  v.stride[1] = std::int64_t(kv.v.stride(2));
  v.stride[2] = std::int64_t(kv.v.stride(1));
  return impl::flash_forward(exec, e, impl::flash_operand(q), k, v, part_o, part_lse, mask, qpos,
                             kpos, scale);
}

/// The normalised result of tensor_core_forward_pair (part_o in the storage
/// type, part_lse) as a result in the compute type (out_o, out_lse).
template <class ExecSpace, class PO, class PL, class OO, class OL>
void tensor_core_result(const ExecSpace& exec, const BlockExtents& e, const PO& part_o,
                        const PL& part_lse, const OO& out_o, const OL& out_lse) {
  impl::fill_unseen_rows(exec, out_o, out_lse, 0, 0);
  impl::widen_result(exec, out_o, out_lse, part_o, part_lse, e.queries);
}

/// Runs one piece (see fused_forward_call); part_lse rows outside every
/// piece must hold -inf before the merge.
template <class ExecSpace, class QV, class V, class PO, class PL>
void fused_forward_piece(const ExecSpace& exec, const BlockExtents& e, const BandPiece& piece,
                         const QV& q, const PackedKV<V, typename ExecSpace::memory_space>& kv,
                         const PO& part_o, const PL& part_lse, float scale) {
  impl::FusedProvider<ExecSpace, V>::run(
      exec, fused_forward_call<ExecSpace>(e, piece, q, kv, part_o, part_lse, scale));
}

/// A block pair's normalised result on the fused path, for rows that merge
/// elsewhere (a helper's task: another rank's queries q, e.queries rows,
/// against the packed block kv in its rows layout), when the pair is one band
/// piece (what the balanced schedule's contiguous blocks give): it runs into
/// part_o, part_lse (storage type, natural log) and is widened into out_o
/// (compute type) and out_lse, which hold O = 0, LSE = -inf on the rows the
/// piece does not cover. False, nothing done: the pair takes the kernels (see
/// fused_pair; more than one piece; with `guard` and a mask that hides keys,
/// inf / NaN in V).
template <class ExecSpace, class V, class Mask, class QP, class KP, class QV, class PO, class PL,
          class OO, class OL>
bool fused_forward_result(const ExecSpace& exec, const Mask& mask, const QP& qpos, const KP& kpos,
                          const BlockExtents& e, const QV& q,
                          const PackedKV<V, typename ExecSpace::memory_space>& kv, const PO& part_o,
                          const PL& part_lse, const OO& out_o, const OL& out_lse, float scale,
                          bool guard, int& pieces) {
  if constexpr (fused_available_v<ExecSpace, V>) {
    const FusedPair pair =
        fused_pair<ExecSpace, V>(mask, qpos, kpos, e, false, q, kv, part_o, part_lse, scale);
    if (!pair.fused || pair.split.count != 1) return false;
    if (guard && !pair_covers_all(mask, qpos, e.queries, kpos, e.keys) &&
        packed_v_has_nonfinite(exec, kv))
      return false;
    using L = typename PL::non_const_value_type;
    impl::fill_unseen_rows(exec, out_o, out_lse, 0, 0);       // every row: O = 0, LSE = -inf
    Kokkos::deep_copy(exec, part_lse, -impl::infinity<L>());  // rows outside the piece
    fused_forward_piece(exec, e, pair.split.pieces[0], q, kv, part_o, part_lse, scale);
    impl::widen_result(exec, out_o, out_lse, part_o, part_lse, e.queries);
    pieces = 1;
    return true;
  } else {
    (void)exec, (void)mask, (void)qpos, (void)kpos, (void)e, (void)q, (void)kv, (void)part_o,
        (void)part_lse, (void)out_o, (void)out_lse, (void)scale, (void)guard, (void)pieces;
    return false;
  }
}

/// A distributed backward's own query rows as fused operands, from row 0:
/// Q, O, dO (storage type) and the forward's LSE (fp32, natural log, over
/// every key of the rows). `usable`: their head dims have unit strides.
struct FusedQueryRows {
  FusedTensor q, o, dout, lse;
  bool usable = false;
};

template <class QV, class OV, class DOV, class LV>
FusedQueryRows fused_query_rows(const QV& q, const OV& o, const DOV& dout, const LV& lse) {
  FusedQueryRows r;
  r.usable = impl::unit_head_stride(q, o, dout);
  r.q = impl::fused_rows(q, 0);
  r.o = impl::fused_rows(o, 0);
  r.dout = impl::fused_rows(dout, 0);
  r.lse = impl::fused_lse(lse, 0);
  return r;
}

/// A travelled query slot (another rank's Q, dO, LSE log2 e and D =
/// rowsum(dO o O) in the packed layout, as the Q ring and the balanced
/// helpers carry them: O does not travel) as fused operands, from row 0. A
/// fused backward takes O only to form D itself; it gets a proxy O whose
/// rowsum with dO is the travelled D up to one 16-bit rounding
/// (impl::travelled_operands), in o_proxy (storage V, the slot's dout
/// extents), and the LSE in the natural log in lse (fp32, the slot's lse2
/// extents). Enqueued on exec.
template <class ExecSpace, class T, class MemorySpace, class V, class OP, class LN>
FusedQueryRows fused_travelled_rows(const ExecSpace& exec,
                                    const impl::PackedQueries<T, MemorySpace, V>& slot, int dim,
                                    const OP& o_proxy, const LN& lse) {
  impl::travelled_operands(exec, slot.dout, slot.lse2, slot.drow, dim, o_proxy, lse);
  FusedQueryRows r;
  r.usable = slot.q.stride(3) == 1 && o_proxy.stride(3) == 1;
  r.q = impl::fused_packed_rows(slot.q, 0);
  r.o = impl::fused_packed_rows(o_proxy, 0);
  r.dout = impl::fused_packed_rows(slot.dout, 0);
  r.lse = impl::fused_lse(lse, 0);
  return r;
}

/// Rows [0, n) of a (batch, seq, heads, dim) View, or of a packed
/// (batch, heads, seq, dim_padded) query slot's rows seen in (batch, seq,
/// heads, dim) order (`packed`), as an unmanaged strided View: the operands
/// of tensor_core_backward_pair.
template <class V, class MemorySpace>
using StridedRows = Kokkos::View<const V****, Kokkos::LayoutStride, MemorySpace,
                                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class View>
auto strided_rows(const View& x, index_type n, bool packed = false, int dim = 0) {
  using V = typename View::non_const_value_type;
  const Kokkos::LayoutStride l =
      packed ? Kokkos::LayoutStride(x.extent(0), x.stride(0), std::size_t(n), x.stride(2),
                                    x.extent(1), x.stride(1), std::size_t(dim), x.stride(3))
             : Kokkos::LayoutStride(x.extent(0), x.stride(0), std::size_t(n), x.stride(1),
                                    x.extent(2), x.stride(2), x.extent(3), x.stride(3));
  return StridedRows<V, typename View::memory_space>(x.data(), l);
}

/// Rows [0, n) of a (batch, heads, seq) LSE View as an unmanaged strided View.
template <class View>
auto strided_lse(const View& x, index_type n) {
  using L = typename View::non_const_value_type;
  const Kokkos::LayoutStride l(x.extent(0), x.stride(0), x.extent(1), x.stride(1), std::size_t(n),
                               x.stride(2));
  return Kokkos::View<const L***, Kokkos::LayoutStride, typename View::memory_space,
                      Kokkos::MemoryTraits<Kokkos::Unmanaged>>(x.data(), l);
}

/// Whether BlockAttn's tensor-core backward is compiled for ExecSpace,
/// storage V and Mask (CUDA, 16-bit, no score policy).
template <class ExecSpace, class V, class Mask>
constexpr bool tensor_core_backward_available_v = impl::flash_enabled<ExecSpace, V, Mask>();

/// The backward of one block pair on BlockAttn's tensor-core backward
/// (CUDA, 16-bit; kernel/impl/flash_path.hpp flash_backward), for pairs the
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
  if constexpr (tensor_core_backward_available_v<ExecSpace, V, Mask>) {
    if (e.queries <= 0 || e.keys <= 0) return false;
    const auto rows = [](const auto& x, index_type n) {
      return Kokkos::subview(x, Kokkos::ALL, std::make_pair(index_type(0), n), Kokkos::ALL,
                             Kokkos::ALL);
    };
    if (!impl::flash_backward(exec, e, q, k, v, o, lse, dout, rows(tq, e.queries), rows(tk, e.keys),
                              rows(tv, e.keys), mask, qpos, kpos, scale))
      return false;
    impl::clear_pair_sums(exec, dq, dk, dv, acc_dq, acc_dkv);
    impl::add_piece_rows(exec, dq, tq, 0, e.queries);
    impl::add_piece_rows(exec, dk, tk, 0, e.keys);
    impl::add_piece_rows(exec, dv, tv, 0, e.keys);
    return true;
  } else {
    (void)exec, (void)mask, (void)qpos, (void)kpos, (void)e, (void)q, (void)o, (void)dout,
        (void)lse, (void)k, (void)v, (void)tq, (void)tk, (void)tv, (void)dq, (void)dk, (void)dv,
        (void)acc_dq, (void)acc_dkv, (void)scale;
    return false;
  }
}

/// The backward of one block pair on the fused path: the queries `rows`
/// (e.queries of them: own, or a travelled slot's) against the K/V block k,
/// v (e.keys rows, storage V). The provider writes each band piece's dQ, dK,
/// dV in the storage type into tq (query rows) and tk, tv (key rows), from
/// the forward's O (or its proxy) and LSE (so a pair's gradients are the
/// exact partials of the whole softmax); they are added, widened, into dq,
/// dk, dv (the pair's sums in the compute type), which are first zeroed
/// unless acc_dq / acc_dkv. Each piece's gradients are thus rounded to 16
/// bits once before the fp32 sum over the pairs (the fused bound:
/// docs/numerics.md). False, nothing done: the pair takes the
/// kernels (no provider, not band pieces in cuDNN's form, a shape or stride
/// the provider declines, or, with `guard` and a mask that hides keys of the
/// pair, inf / NaN in v). `pieces`: the band pieces run.
template <class ExecSpace, class V, class Mask, class QP, class KP, class KV, class VV, class TQ,
          class TK, class GQ, class GK>
bool fused_backward_pair(const ExecSpace& exec, const Mask& mask, const QP& qpos, const KP& kpos,
                         const BlockExtents& e, const FusedQueryRows& rows, const KV& k,
                         const VV& v, const TQ& tq, const TK& tk, const TK& tv, const GQ& dq,
                         const GK& dk, const GK& dv, bool acc_dq, bool acc_dkv, float scale,
                         bool guard, int& pieces) {
  if constexpr (fused_available_v<ExecSpace, V>) {
    if (!rows.usable || e.queries <= 0 || e.keys <= 0 || !impl::fused_shape_ok(e) ||
        !impl::unit_head_stride(k, v, tq, tk, tv))
      return false;
    const BandSplit split = band_split(mask, qpos, e.queries, kpos, e.keys);
    if (!split.expressible || split.count == 0) return false;
    std::array<FusedBackwardCall, std::tuple_size<decltype(BandSplit::pieces)>::value> calls;
    const std::size_t s = sizeof(V), f = sizeof(float);
    for (int i = 0; i < split.count; ++i) {
      const BandPiece& p = split.pieces[std::size_t(i)];
      if (!cudnn_band(p).supported) return false;
      FusedBackwardCall& c = calls[std::size_t(i)];
      c.p = impl::fused_problem(e, p, impl::fused_type<V>(), scale);
      c.q = impl::fused_offset(rows.q, p.row_begin, s);
      c.o = impl::fused_offset(rows.o, p.row_begin, s);
      c.dout = impl::fused_offset(rows.dout, p.row_begin, s);
      c.lse = impl::fused_offset(rows.lse, p.row_begin, f);
      c.k = impl::fused_rows(k, p.col_begin);
      c.v = impl::fused_rows(v, p.col_begin);
      c.dq = impl::fused_rows(tq, p.row_begin);
      c.dk = impl::fused_rows(tk, p.col_begin);
      c.dv = impl::fused_rows(tv, p.col_begin);
      if (!impl::FusedProvider<ExecSpace, V>::supports(c)) return false;
    }
    if (guard && !pair_covers_all(mask, qpos, e.queries, kpos, e.keys) &&
        impl::has_nonfinite(exec, v))
      return false;
    impl::clear_pair_sums(exec, dq, dk, dv, acc_dq, acc_dkv);
    for (int i = 0; i < split.count; ++i) {
      const BandPiece& p = split.pieces[std::size_t(i)];
      impl::FusedProvider<ExecSpace, V>::run(exec, calls[std::size_t(i)]);
      impl::add_piece_rows(exec, dq, tq, p.row_begin, p.row_end);
      impl::add_piece_rows(exec, dk, tk, p.col_begin, p.col_end);
      impl::add_piece_rows(exec, dv, tv, p.col_begin, p.col_end);
    }
    pieces = split.count;
    return true;
  } else {
    (void)exec, (void)mask, (void)qpos, (void)kpos, (void)e, (void)rows, (void)k, (void)v, (void)tq,
        (void)tk, (void)tv, (void)dq, (void)dk, (void)dv, (void)acc_dq, (void)acc_dkv, (void)scale,
        (void)guard, (void)pieces;
    return false;
  }
}

}  // namespace blockattn
